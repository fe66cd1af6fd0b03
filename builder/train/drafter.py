"""Train the independent drafter: the baseline the MTP head is measured against.

A small Llama-family language model of its own (embeddings, decoder layers, KV cache, prefill), about
the size of the MTP head, trained by distillation on exactly the head's data: the same training-split
prompts of every task with the frozen base's greedy continuations (`distill.greedy_continuations`).
The loss is cross-entropy with the base's full next-token distribution (soft targets, temperature 1)
at every position, so the drafter learns the base's distribution, not only its argmax.

For a big base (SmolLM2) the drafter learns from a head trained with --cache-features (`--head DIR`):
every stage's data of that head, the base's final hidden states read from build/distill/ instead of
running the base at every step, and targets over the head's draft vocabulary (the base's distribution
there, renormalised), at the positions the base wrote: exactly what the head learns, so tau compares the
two draft sources on equal terms. Its own input embedding covers the whole vocabulary (it reads any
token), and so does its output (a standard checkpoint, tied).
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.corpus import HEAD_SOURCES, load_corpus, prompts_digest, validation_prompts
from ..data.tasks import load_tokenizer
from ..decode.drafter import torch_drafter
from ..errors import CheckpointError
from ..models.head import base_fingerprint, load_head
from ..models.llama import Llama, LlamaConfig, load_llama, save_llama
from .cards import render_card
from .distill import distilled, each_once, make_batches, measure_acceptance, training_prompts
from .head import HeadTrainConfig, distil_parts, stage_parts, training_stages
from .loop import Run, Schedule, sequential, train


@dataclass
class DrafterTrainConfig:
    seed: int = 0
    hidden_size: int = 128        # 2 layers of width 128, tied embeddings: 0.87 M parameters (the 6-layer base's head's size; the deep base's head is 0.47 M)
    layers: int = 2
    intermediate_size: int = 320
    heads: int = 4
    kv_heads: int = 2
    batch_size: int = 16
    steps: int = 6000
    lr: float = 3e-3
    warmup: int = 100
    eval_prompts: int = 60        # validation prompts per task for the tau table
    checkpoint_every: int = 200   # steps between checkpoints (in DRAFTER/checkpoint/, also on Ctrl-C)
    prompts_per_task: int = HeadTrainConfig.prompts_per_task  # the head's data (smaller in tests)
    new_tokens: int = HeadTrainConfig.new_tokens
    head: str | None = None       # a head trained with --cache-features: learn from its data and draft vocabulary


def drafter_config(base: LlamaConfig, cfg: DrafterTrainConfig) -> LlamaConfig:
    return LlamaConfig(vocab_size=base.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       max_position_embeddings=base.max_position_embeddings, rope_theta=base.rope_theta,
                       rms_norm_eps=base.rms_norm_eps, tie_word_embeddings=True,
                       bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)


def distill_loss(drafter: Llama, base: Llama, seqs: torch.Tensor, valid: torch.Tensor):
    """Cross-entropy with the base's whole next-token distribution at every position (padding aside), and
    the share of the base's tokens where the drafter's argmax agrees with the base's."""
    real = seqs != 0
    real[:, 0] = True  # position 0 is the task marker; padding is id 0 after the end
    with torch.no_grad():
        target = F.softmax(base(seqs)[0], dim=-1)  # (B, N, V) the base's next-token distribution
    logits = drafter(seqs)[0]
    loss = -(target * F.log_softmax(logits, dim=-1)).sum(-1)[real].mean()
    return loss, (logits.argmax(-1) == target.argmax(-1))[valid].float().mean().item()


def head_data(base: Llama, tok, corpus, head_dir: str, fingerprint: str):
    """The sequences every stage of the head in head_dir trained on (each once), with the final hidden states
    of the model that wrote them, the base or a feature's production model (build/distill/, distilled where missing), and the base's LM head rows of the head's draft
    vocabulary with their ids: what the head's soft targets are made of."""
    head = load_head(head_dir, base)
    if not head.config.draft_vocab:
        raise CheckpointError(f"the head in {head_dir} has no draft vocabulary: train the drafter on the base itself")
    stages = training_stages(json.loads((Path(head_dir) / "train_log.json").read_text()))
    parts = [part for stage in stages for part in stage_parts(tok, corpus, stage["train_config"])]
    data, feats = each_once(distil_parts(base, fingerprint, parts, head.config.kv_layer))
    hidden = [(f[0],) for f in feats]  # the read layer's keys and values are the head's, not the drafter's
    prompts = [p for ps, *_ in parts for p in ps]
    return data, hidden, prompts, (base.lm_head.weight[head.d2t].detach().clone(), head.d2t.clone())


def feature_loss(drafter: Llama, vocabulary, seqs: torch.Tensor, valid: torch.Tensor, hidden: torch.Tensor):
    """Cross-entropy with the base's next-token distribution over the draft vocabulary (from its cached
    final hidden states) at the positions whose next token the base wrote; the drafter's own softmax is
    over the whole vocabulary. Returns the loss and the share where the two argmaxes agree."""
    rows, d2t = vocabulary
    at = F.pad(valid[:, 1:], (0, 1))  # position t is scored on token t + 1
    with torch.no_grad():
        target = F.softmax(F.linear(hidden[at].float(), rows), dim=-1)  # (P, draft vocabulary)
    logits = drafter(seqs, logits_at=at)[0]  # (P, V)
    loss = -(target * F.log_softmax(logits, dim=-1)[:, d2t]).sum(-1).mean()
    return loss, (logits.argmax(-1) == d2t[target.argmax(-1)]).float().mean().item()


def train_drafter(base: Llama, tok, corpus, cfg: DrafterTrainConfig, run_dir: Path | None = None,
                  stop_at: int | None = None):
    """Distils and trains with the one training loop (loop.py); with a run directory, checkpointed every
    cfg.checkpoint_every steps and on Ctrl-C, and resumed from it to the weights of a run never stopped."""
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    fingerprint = base_fingerprint(base)
    feats = vocabulary = None
    if cfg.head:
        data, feats, prompts, vocabulary = head_data(base, tok, corpus, cfg.head, fingerprint)
    else:
        data_cfg = HeadTrainConfig(seed=cfg.seed, prompts_per_task=cfg.prompts_per_task, new_tokens=cfg.new_tokens)  # the head's data
        prompts = training_prompts(tok, corpus, data_cfg.prompts_per_task, data_cfg.seed)
        data = distilled(base, fingerprint, prompts, data_cfg.new_tokens)
    data_seconds = time.time() - t0

    drafter = Llama(drafter_config(base.config, cfg))
    drafter.init_weights(cfg.seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batch = sequential(make_batches(data, cfg.batch_size, random.Random(cfg.seed), feats))

    def step_loss(step: int):
        if feats is None:
            loss, agree = distill_loss(drafter, base, *batch(step))
        else:
            loss, agree = feature_loss(drafter, vocabulary, *batch(step))
        return loss, {"agree": agree}

    key = {"config": asdict(cfg), "base": fingerprint, "data": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()}
    state = train(drafter, opt, step_loss, Schedule(cfg.lr, cfg.warmup), Run(run_dir, key), steps=cfg.steps,
                  every_steps=cfg.checkpoint_every, every_minutes=0, stop_at=stop_at, desc="train-drafter",
                  postfix=lambda st: {"agree": f"{sum(s['agree'] for _, s in st.recent[-50:]) / len(st.recent[-50:]):.2f}"})
    recent = state.recent[-50:]
    return drafter, {"train_config": asdict(cfg), "data_seconds": round(data_seconds),
                     "train_seconds": round(state.train_seconds), "sequences": len(data), "resumed_at_step": state.resumed_at,
                     "final_loss": state.mean_loss(), "base_fingerprint": fingerprint,
                     "final_agreement_with_base": sum(s["agree"] for _, s in recent) / len(recent),
                     "drafter_parameters": sum(p.numel() for p in drafter.parameters())}


def train_and_report(base_dir: Path, out: Path, cfg: DrafterTrainConfig) -> dict:
    """What `train-drafter` does: distil, train, save (a standard checkpoint), measure tau, write the card."""
    base, tok = load_llama(base_dir), load_tokenizer(base_dir)
    corpus = load_corpus(HEAD_SOURCES)
    checkpoint = out / "checkpoint"
    drafter, log = train_drafter(base, tok, corpus, cfg, run_dir=checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    save_llama(drafter, out, {"base_fingerprint": log["base_fingerprint"]})
    shutil.copyfile(Path(base_dir) / "tokenizer.json", out / "tokenizer.json")
    ks = range(1, HeadTrainConfig().k + 1)  # the k of the head's table, for a side-by-side comparison
    prompts = validation_prompts(corpus, cfg.eval_prompts, tasks=tuple(tok.tasks))
    log["acceptance"] = measure_acceptance(base, tok, prompts, ks, drafter=torch_drafter(drafter))
    log["acceptance_prompts_sha256"] = prompts_digest(prompts)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    write_card(out, log)
    shutil.rmtree(checkpoint, ignore_errors=True)  # the drafter is saved: nothing left to resume
    return log


def write_card(out: Path, log: dict) -> None:
    """The drafter's card, rendered from templates/drafter_card.md.j2 (the numbers come from the log)."""
    render_card(out, "drafter_card.md.j2", log=log)
