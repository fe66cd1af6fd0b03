"""Train the default base: a byte-level BPE tokenizer and a small Llama on the Python docs, with both tasks.

The training stream is a shuffled sequence of examples, each ended by <|endoftext|>:

    <|continue|>{paragraph}<|endoftext|>
    <|proofread|>{sentence with typos}<|fix|>{sentence}<|endoftext|>

Loss is taken on every token the model would be asked to write: the paragraph of a continue example,
the corrected sentence (and its end token) of a proofread example - not on the text with typos, which
the model only reads.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from .corpus import Corpus, load_corpus, proofread_pairs
from .model import Llama, LlamaConfig, save_llama
from .tasks import EOS, SPECIAL_TOKENS, TASKS, encode_text


@dataclass
class TrainConfig:
    seed: int = 0
    vocab_size: int = 4096
    block_size: int = 256        # tokens per training sequence (= the context window)
    batch_size: int = 16         # sequences per step
    steps: int = 1600
    lr: float = 1.5e-3           # peak learning rate, cosine decay to lr/10 after warmup
    warmup: int = 100
    weight_decay: float = 0.1
    proofread_share: float = 0.5  # proofread examples per continue example in the stream


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_stream(tok: Tokenizer, paragraphs: list[str], pairs: list[tuple[str, str]], seed: int):
    """(ids, weights): the concatenated examples and, per token, 1 where it is a training target."""
    sid = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    examples = []
    for text in paragraphs:
        body = encode_text(tok, text) + [sid[EOS]]
        examples.append(([sid[TASKS["continue"][0]]] + body, [0] + [1] * len(body)))
    for typo, fixed in pairs:
        prompt = [sid[TASKS["proofread"][0]]] + encode_text(tok, typo) + [sid[TASKS["proofread"][1]]]
        answer = encode_text(tok, fixed) + [sid[EOS]]
        examples.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    random.Random(seed).shuffle(examples)
    ids = np.fromiter((i for ex, _ in examples for i in ex), dtype=np.int64)
    weights = np.fromiter((w for _, ws in examples for w in ws), dtype=np.float32)
    return ids, weights


def batches(ids: np.ndarray, weights: np.ndarray, block: int, batch: int, rng: np.random.Generator):
    """Endless random windows: inputs (B, T), targets (B, T), target weights (B, T)."""
    while True:
        starts = rng.integers(0, len(ids) - block - 1, size=batch)
        idx = starts[:, None] + np.arange(block + 1)[None, :]
        x, w = torch.from_numpy(ids[idx]), torch.from_numpy(weights[idx])
        yield x[:, :-1], x[:, 1:], w[:, 1:]


def weighted_loss(model: Llama, x, y, w) -> torch.Tensor:
    logits, _, _ = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return (loss * w.flatten()).sum() / w.sum().clamp(min=1)


@torch.no_grad()
def stream_loss(model: Llama, ids: np.ndarray, weights: np.ndarray, block: int) -> float:
    """Mean weighted loss over consecutive windows covering the whole stream."""
    total, count = 0.0, 0.0
    n = (len(ids) - 1) // block
    for i in range(0, n, 16):
        rows = range(i, min(i + 16, n))
        idx = np.array([np.arange(r * block, r * block + block + 1) for r in rows])
        x, w = torch.from_numpy(ids[idx]), torch.from_numpy(weights[idx])
        logits, _, _ = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        total += float((loss * w[:, 1:].flatten()).sum())
        count += float(w[:, 1:].sum())
    return total / count


def lr_at(step: int, cfg) -> float:
    """The learning rate of every training command (base, head, drafter) at a step: linear warm-up over
    cfg.warmup steps (at most a tenth of the run), then cosine decay to cfg.lr / 10 at cfg.steps."""
    warmup = min(cfg.warmup, max(1, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_base(out: Path, cfg: TrainConfig, model_cfg: LlamaConfig | None = None, corpus: Corpus | None = None) -> dict:
    """Trains tokenizer and model, writes them to `out`, returns a log of what was done."""
    torch.manual_seed(cfg.seed)
    corpus = corpus or load_corpus()
    t0 = time.time()
    tok = train_tokenizer(corpus.train, cfg.vocab_size)
    model_cfg = model_cfg or LlamaConfig()
    model_cfg.vocab_size = tok.get_vocab_size()
    model_cfg.max_position_embeddings = cfg.block_size
    model_cfg.eos_token_id = tok.token_to_id(EOS)

    rng = random.Random(cfg.seed)
    pairs = proofread_pairs(corpus.train, cfg.seed)
    pairs = rng.sample(pairs, min(len(pairs), int(cfg.proofread_share * len(corpus.train))))
    ids, weights = build_stream(tok, corpus.train, pairs, cfg.seed)

    model = Llama(model_cfg)
    model.init_weights(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    data = batches(ids, weights, cfg.block_size, cfg.batch_size, np.random.default_rng(cfg.seed))
    model.train()
    losses = []
    bar = tqdm(range(cfg.steps), desc="train-base", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y, w = next(data)
        loss = weighted_loss(model, x, y, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    save_llama(model, out)
    tok.save(str(out / "tokenizer.json"))
    log = {"train_config": asdict(cfg), "train_seconds": round(time.time() - t0),
           "train_tokens_in_stream": int(len(ids)), "tokens_seen": cfg.steps * cfg.batch_size * cfg.block_size,
           "final_train_loss": float(np.mean(losses[-50:])), "parameters": model.num_params(),
           "corpus": {"train_paragraphs": len(corpus.train), "validation_paragraphs": len(corpus.validation),
                      "train_files": corpus.files[0], "validation_files": corpus.files[1],
                      "train_chars": sum(map(len, corpus.train)), "validation_chars": sum(map(len, corpus.validation)),
                      "proofread_pairs_trained": len(pairs)}}
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log


def evaluate(out: Path, corpus: Corpus, cfg: TrainConfig, n_proofread: int = 200) -> dict:
    """Validation loss and perplexity, the proofread exact-fix rate, and unedited samples."""
    from .corpus import validation_prompts
    from .generate import decode_ar
    from .model import load_llama
    from .tasks import decode, encode_prompt, load_tokenizer

    model, tok = load_llama(out), load_tokenizer(out)
    eos = model.config.eos_token_id
    pairs = proofread_pairs(corpus.validation, cfg.seed + 1)
    loss_c = stream_loss(model, *build_stream(tok, corpus.validation, [], cfg.seed), cfg.block_size)
    loss_p = stream_loss(model, *build_stream(tok, [], pairs, cfg.seed), cfg.block_size)
    fixed = 0
    for typo, correct in pairs[:n_proofread]:
        prompt = encode_prompt(tok, "proofread", typo)
        got = decode_ar(model, prompt, min(96, cfg.block_size - len(prompt)), eos)
        fixed += decode(tok, got.ids) == correct
    samples = []
    for p in validation_prompts(corpus, 3, seed=cfg.seed + 2):
        got = decode_ar(model, encode_prompt(tok, p["task"], p["prompt"]), 48, eos)
        samples.append({**p, "output": decode(tok, got.ids)})
    return {"loss_continue": loss_c, "perplexity_continue": math.exp(loss_c), "loss_proofread_answer": loss_p,
            "proofread_exact_fix": fixed / min(n_proofread, len(pairs)), "proofread_evaluated": min(n_proofread, len(pairs)),
            "samples": samples}


def train_and_report(out: Path, cfg: TrainConfig) -> dict:
    """What `train-base` does: train, save, evaluate on validation, write the model card."""
    corpus = load_corpus()
    log = train_base(out, cfg, corpus=corpus)
    log["validation"] = evaluate(out, corpus, cfg)
    (out / "train_log.json").write_text(json.dumps(log, indent=2, ensure_ascii=False) + "\n")
    write_card(out, log)
    return log


def write_card(out: Path, log: dict) -> None:
    from .model import load_config

    c, v, t = load_config(out), log["validation"], log["train_config"]
    samples = "\n".join(
        f"**{s['task']}** - prompt: `{s['prompt']}`\n\n> {s['output']}\n" for s in v["samples"])
    (out / "README.md").write_text(f"""# Frozen MTP base model

A small Llama-family causal language model trained from scratch on this machine, the default
**frozen base** of the Frozen MTP demo. Standard Hugging Face layout: it loads in `transformers`'
`LlamaForCausalLM` and `PreTrainedTokenizerFast` (`tokenizer.json`). Reproduce it with
`python -m builder train-base` (seeded).

## Architecture

| | |
| --- | --- |
| parameters | {log['parameters']:,} ({log['parameters'] / 1e6:.2f} M; embeddings tied to the LM head) |
| layers | {c['num_hidden_layers']} decoder layers (RMSNorm, rotary position embeddings, SwiGLU MLP) |
| width | hidden {c['hidden_size']}, MLP {c['intermediate_size']} |
| attention | {c['num_attention_heads']} query heads, {c['num_key_value_heads']} key/value heads (grouped-query), head size {c['hidden_size'] // c['num_attention_heads']} |
| context window | {c['max_position_embeddings']} tokens |
| vocabulary | {c['vocab_size']} byte-level BPE tokens (`tokenizers`, trained on the training split) |
| special tokens | `<|endoftext|>` (end of sequence, id {c['eos_token_id']}), `<|continue|>`, `<|proofread|>`, `<|fix|>` |

## Data

English prose from the reStructuredText sources of the Python 3.11 documentation, as shipped in
Debian's `python3.11-doc` package (`/usr/share/doc/python3.11/html/_sources/`), licensed under the
PSF License Agreement (see `/usr/share/doc/python3.11-doc/copyright`). Only prose paragraphs are kept
(directives, code, tables and headings dropped, inline markup reduced to text): see `builder/corpus.py`.

| split | files | paragraphs | characters |
| --- | --- | --- | --- |
| train | {log['corpus']['train_files']} | {log['corpus']['train_paragraphs']:,} | {log['corpus']['train_chars']:,} |
| validation (1 file in 20, by hash of its path) | {log['corpus']['validation_files']} | {log['corpus']['validation_paragraphs']:,} | {log['corpus']['validation_chars']:,} |

Two tasks, one prompt format each (`builder/tasks.py`, shared with the site):

- `continue`: `<|continue|>{{text}}`, the model continues the text (every training paragraph, ended by `<|endoftext|>`);
- `proofread`: `<|proofread|>{{text with typos}}<|fix|>`, the model writes the corrected sentence and
  `<|endoftext|>`. Typos are made from training sentences: dropped, swapped, doubled or substituted
  letters and common misspellings, 1-3 per sentence ({log['corpus']['proofread_pairs_trained']:,} pairs trained).

Loss is taken only on what the model writes (not on the sentence with typos).

## Training

{t['steps']} AdamW steps of {t['batch_size']} x {t['block_size']} tokens ({log['tokens_seen'] / 1e6:.1f} M tokens
seen, the stream holds {log['train_tokens_in_stream'] / 1e6:.2f} M), peak learning rate {t['lr']}, cosine decay,
seed {t['seed']}: **{log['train_seconds'] / 60:.0f} minutes** on a 2-core CPU (fp32). Final training loss
{log['final_train_loss']:.3f}.

## Validation

| measure | value |
| --- | --- |
| loss, continue text (nats/token) | {v['loss_continue']:.3f} |
| perplexity, continue text | {v['perplexity_continue']:.1f} |
| loss, proofread answers | {v['loss_proofread_answer']:.3f} |
| proofread exact-fix rate (greedy output equals the correct sentence) | {v['proofread_exact_fix']:.1%} of {v['proofread_evaluated']} validation sentences |

## Samples (greedy, unedited, validation prompts)

{samples}
""")
