"""Train the MTP head on the frozen base by self-distillation.

1. Prompts of every task from the training split; the base writes its own greedy continuation of each
   (batched by prompt length, so no padding is needed).
2. For every sequence the frozen base runs once (no gradients) and gives its hidden states and its KV
   cache. Every position t from the last-but-one prompt token on is an anchor, as at decode time: the
   head drafts the chain seq[t+2], seq[t+3], .. from (hidden[t], seq[t+1]) and the base's cache up to
   t, its own output hidden fed to the next draft. The loss is cross-entropy with the base's whole
   next-token distribution (or, with targets="greedy", its greedy token) at each of the k draft positions.
   The chain is fed the base's tokens, not the head's own drafts: a draft only matters when every draft
   before it was accepted, i.e. equal to the base's token, so on every chain that counts the two agree.
3. The base's parameters have requires_grad off and are checked bit-for-bit unchanged at the end.

Data: the built-in corpus (corpus.HEAD_SOURCES: eight Debian documentation packages) or the user's own text files (`--data`, data/corpus.py),
whose held-back paragraphs give the final tau table. Runs on CUDA when there is one, else the CPU.
The run is the one training loop's (loop.py): checkpointed every `checkpoint_every` steps and on Ctrl-C
in HEAD_DIR/checkpoint/, resumed by the same command to the weights of a run never stopped; the base's
continuations are kept in build/distill/ (distill.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..contract import sha256_file
from ..data.corpus import HEAD_SOURCES, Corpus, load_corpus, load_text_corpus, prompts_digest, validation_prompts
from ..data.everyday import feature_texts
from ..data.messages import held_back
from ..data.tasks import TASKS, encode_prompt, load_tokenizer
from ..errors import CheckpointError, UserError
from ..models.adapter import load_adapter, remove_adapter
from ..models.head import HeadConfig, MTPHead, base_fingerprint, grow, induction_scores, init_random, load_head, save_head
from ..models.llama import Llama, load_llama
from .cards import macro, render_card
from .distill import distilled, each_once, greedy_continuations, make_batches, measure_acceptance, training_prompts
from .loop import RunState, Run, Schedule, sequential, train

logger = logging.getLogger(__name__)


@dataclass
class HeadTrainConfig:
    seed: int = 0
    k: int = 6                    # draft chain length trained
    prompts_per_task: int = 2000  # self-distillation prompts per task (6,000 sequences with three tasks)
    new_tokens: int = 64          # greedy tokens the base writes per prompt (proofread stops at its end token)
    batch_size: int = 16          # sequences per step
    steps: int = 2000
    lr: float = 1.5e-3
    warmup: int = 50
    weight_decay: float = 0.0
    eval_prompts: int = 60        # validation prompts per task for the tau table
    checkpoint_every: int = 100   # steps between checkpoints
    targets: str = "distribution"  # "greedy": the base's token; "distribution": its whole next-token distribution
    kv_layer: int | None = None   # the base layer whose KV cache the head reads; None: the one with the
                                  # strongest induction head (mtp.induction_scores), where copying lives
    task_prompts: dict[str, int] | None = None  # prompts of these tasks instead of prompts_per_task
    chat_messages: int = 0        # more reply prompts that are real short messages (data/messages.py)
    init: str | None = None       # a head (directory) trained for this base to go on from: a second stage
                                  # on more data; its architecture and base layer are kept
    layers: int | None = None     # the head's decoder layers (default 1); with init, more than it has adds
                                  # layers that start as the identity (mtp.grow)
    draft_vocab: int = 0          # a reduced draft vocabulary: the base's N most used tokens in the
                                  # distilled data (0: its whole vocabulary); with init, the N of the init
                                  # head's tokens used most (a smaller draft vocabulary, fewer rows a draft)
    cache_features: bool = False  # keep the base's hidden states and the read layer's keys/values from its
                                  # distillation (build/distill/), instead of running it at every step: a big base
    replay: bool = False          # with init: train on every earlier stage's data too (each sequence once), not
                                  # this stage's prompts alone, so a stage on one task's data does not forget the rest
    everyday: dict[str, int] | None = None  # this many of each feature's everyday training texts (data/everyday.py),
                                  # decoded by the feature's production model: the base plus ADAPTERS/TASK (continue,
                                  # or a feature without one: the base); instead of the corpus's prompts unless
                                  # task_prompts or chat_messages are given too. Needs cache_features
    adapters: str = "models/adapters"  # the features' adapters (with everyday)


def chain_loss(head: MTPHead, base: Llama, seqs: torch.Tensor, valid: torch.Tensor, k: int,
               counts: list[int] | None = None, targets: str = "greedy", feats=None):
    """Cross-entropy over the k draft positions of every anchor: at each draft position, the sum over
    anchors divided by counts[j - 1] (default: the targets counted here, i.e. the mean), averaged over
    positions. With the counts of a whole batch, the losses of its parts add up to the batch's loss.

    seqs (B, N) token ids; valid (B, N) True where the token is one the base wrote (a target).
    targets "greedy": cross-entropy with the base's token; "distribution": with the base's whole
    next-token distribution there (soft targets, as the drafter learns).
    feats: the base's (hidden, keys, values) of these sequences (distill.greedy_continuations), else the base runs here.
    With a reduced draft vocabulary the soft targets are the base's distribution over it, renormalised.
    Returns the loss and, per draft position, (correct, counted) for accuracy.
    """
    B, N = seqs.shape
    with torch.no_grad():
        if feats is None:
            base_logits, hidden, cache = base(seqs)
            base_k, base_v = cache[head.config.kv_layer]
        else:
            hidden, base_k, base_v = (t.float() for t in feats)
        if targets == "distribution" and (head.config.draft_vocab or feats is not None):
            base_logits = head.draft_logits(base, hidden)  # over what the head can draft
        index = None
        if head.config.draft_vocab:  # token id -> draft index, -1 where the head cannot draft it
            index = torch.full((base.config.vocab_size,), -1, dtype=torch.long, device=seqs.device)
            index[head.d2t] = torch.arange(head.config.draft_vocab, device=seqs.device)
    # anchors before a0 draft no target (their whole chain lies in the prompt): a long prompt (summarize)
    # would otherwise spend most of the step on them
    a0 = max(0, int(valid.any(0).nonzero()[0]) - k - 1) if valid.any() else 0
    anchors = torch.arange(a0, N, device=seqs.device)
    mask = torch.arange(N, device=seqs.device)[None] <= anchors[:, None]  # anchor t reads base positions <= t
    embed = base.model.embed_tokens
    h, chains, total, stats = hidden[:, a0:], head.new_chains(), 0.0, []
    pad = lambda t, j: F.pad(t[:, j:], (0, j))[:, a0:]  # noqa: E731  shift left by j, zero-padded, from a0
    for j in range(1, k + 1):
        h = head.step(h, embed(pad(seqs, j)), anchors + j, base_k, base_v, mask, chains)
        logits = head.draft_logits(base, h)  # (B, N - a0, V)
        target, ok = pad(seqs, j + 1), pad(valid, j + 1)
        if index is not None and targets != "distribution":  # a token the head cannot draft teaches nothing
            ok = ok & (index[target] >= 0)
        count = counts[j - 1] if counts else int(ok.sum())
        if not ok.any():
            loss = logits.sum() * 0
        elif targets == "distribution":  # the base's distribution of the token at t + j + 1: its logits at t + j
            soft = F.softmax(F.pad(base_logits[:, j:], (0, 0, 0, j))[:, a0:][ok], dim=-1)
            loss = -(soft * F.log_softmax(logits[ok], dim=-1)).sum() / max(1, count)
        else:
            goal = index[target[ok]] if index is not None else target[ok]
            loss = F.cross_entropy(logits[ok], goal, reduction="sum") / max(1, count)
        total = total + loss
        stats.append((int((head.token_ids(logits[ok].argmax(-1)) == target[ok]).sum()), int(ok.sum())))
    return total / k, stats


class Objective(torch.nn.Module):
    """The head's training loss as a module, what DistributedDataParallel wraps. The frozen base is an
    argument, not a submodule: DDP neither broadcasts nor reduces it."""

    def __init__(self, head: MTPHead):
        super().__init__()
        self.head = head

    def forward(self, base: Llama, seqs, valid, k: int, counts: list[int], targets: str, feats=None):
        return chain_loss(self.head, base, seqs, valid, k, counts, targets, feats)


def draft_vocabulary(data, n: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """The n tokens the base uses most in the distilled sequences (prompts, which answers copy from, and
    its own continuations), in id order: FR-Spec's frequency-ranked draft vocabulary; with `among`, the n
    of those ids used most (a head's vocabulary made smaller)."""
    counts = torch.zeros(max(max(s) for _, s in data) + 1, dtype=torch.long)
    for _, s in data:
        counts += torch.bincount(torch.tensor(s), minlength=len(counts))
    if among is not None:
        among = among.cpu()
        counts = F.pad(counts, (0, max(0, int(among.max()) + 1 - len(counts))))[among]
        return among[counts.topk(min(n, len(among))).indices].sort().values
    return counts.topk(min(n, len(counts))).indices.sort().values


def processes() -> tuple[int, int]:
    """(rank, world size): (0, 1) alone, else what torchrun set up (see join_processes)."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def join_processes(device: str) -> str:
    """Under torchrun (WORLD_SIZE in the environment) joins the process group: NCCL on GPUs, one per
    process (LOCAL_RANK), gloo on CPUs. Returns the device this process trains on."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        return f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("gloo")
    return device


def distil_together(base: Llama, prompts: list[list[int]], new_tokens: int, kv_layer: int | None = None):
    """Under torchrun: each process distils every world-th prompt, and every process gets all of it
    (with kv_layer, and the features: as greedy_continuations)."""
    import torch.distributed as dist

    rank, world = processes()
    parts = [None] * world
    dist.all_gather_object(parts, greedy_continuations(base, prompts[rank::world], new_tokens, base.config.eos_token_id,
                                                       kv_layer=kv_layer))
    if kv_layer is None:
        return [d for part in parts for d in part]
    return [d for part in parts for d in part[0]], [f for part in parts for f in part[1]]


def train_head(base: Llama, tok, corpus: Corpus, cfg: HeadTrainConfig, head_cfg: HeadConfig | None = None,
               run_dir: Path | None = None, stop_at: int | None = None):
    """Trains a head on the frozen base (on the base's device) with the one training loop (loop.py): with
    a run directory, checkpointed every cfg.checkpoint_every steps and on Ctrl-C, and resumed from it.

    Under torchrun every process takes its share of each batch (rows rank, rank + world, ..) and DDP
    sums the gradients, so N processes train what one process does with the same batch size; rank 0
    writes the checkpoints (a resumed run reads them on every process: one machine or a shared disk)."""
    torch.manual_seed(cfg.seed)
    rank, world = processes()
    for p in base.parameters():
        p.requires_grad_(False)
    before = base_fingerprint(base)
    device = next(base.parameters()).device
    scores = induction_scores(base)
    kv_layer = cfg.kv_layer if cfg.kv_layer is not None else max(range(len(scores)), key=scores.__getitem__)
    if not 0 <= kv_layer < len(scores):
        raise CheckpointError(f"--kv-layer {kv_layer}: the base has layers 0..{len(scores) - 1}")
    if cfg.init:  # checked against this base by fingerprint; it keeps its own base layer and chain length
        head = load_head(cfg.init, base.cpu()).train()
        base.to(device)
        if head.config.k_train != cfg.k:
            raise CheckpointError(f"the head in {cfg.init} was trained for k = {head.config.k_train}, not {cfg.k}")
        if cfg.layers is not None and cfg.layers < head.config.num_layers:
            raise CheckpointError(f"--layers {cfg.layers}: the head in {cfg.init} has {head.config.num_layers}; "
                                  f"a stage can add layers, not remove them")
        if cfg.layers:
            head = grow(head, cfg.layers, cfg.seed)
        if cfg.draft_vocab and cfg.draft_vocab >= (head.config.draft_vocab or base.config.vocab_size):
            raise CheckpointError(f"--draft-vocab {cfg.draft_vocab}: the head in {cfg.init} drafts "
                                  f"{head.config.draft_vocab or base.config.vocab_size:,} tokens; a stage can make "
                                  f"its draft vocabulary smaller, not larger")
    else:
        head = MTPHead(head_cfg or HeadConfig.for_base(base.config, k_train=cfg.k, kv_layer=kv_layer,
                                                       num_layers=cfg.layers or 1, draft_vocab=cfg.draft_vocab))
        init_random(head, cfg.seed)
    t0 = time.time()
    parts = stage_parts(tok, corpus, asdict(cfg))
    if cfg.replay:  # the earlier stages' prompts first, as they were drawn
        parts = [p for st in replayed_stages(cfg.init) for p in stage_parts(tok, corpus, st["train_config"])] + parts
    if any(adapter for *_, adapter in parts) and not cfg.cache_features:
        raise UserError("--everyday: a feature's production model (base + adapter) writes its data, and the head must "
                        "learn its hidden states and cache, not the base's alone: add --cache-features")
    prompts = [p for ps, *_ in parts for p in ps]
    feats, read = None, head.config.kv_layer if cfg.cache_features else None
    got = distil_parts(base, before, parts, read)
    if read is None:  # the data alone
        got = [(d, [None] * len(d)) for d in got]
    data, feats = each_once(got) if len(got) > 1 else got[0]
    feats = feats if read is not None else None
    data_seconds = time.time() - t0
    if head.config.draft_vocab and not cfg.init:
        head.d2t.copy_(draft_vocabulary(data, head.config.draft_vocab))
    elif cfg.init and cfg.draft_vocab:  # the init head's tokens this stage's data uses most
        head.restrict_vocabulary(draft_vocabulary(data, cfg.draft_vocab, head.d2t if head.config.draft_vocab else None))
    head.to(device)
    model = Objective(head)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    batch = sequential(make_batches(data, cfg.batch_size, random.Random(cfg.seed), feats))

    def step_loss(step: int):
        seqs, valid, *fs = batch(step)
        counts = [int(valid[:, j + 1:].sum()) for j in range(1, cfg.k + 1)]  # the whole batch's targets
        seqs, valid = (t[rank::world].to(device) for t in (seqs, valid))  # this process's share
        fs = [t[rank::world].to(device) for t in fs] or None
        loss, stats = model(base, seqs, valid, cfg.k, counts, cfg.targets, fs)
        shown = loss.detach()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(shown)  # the batch's loss, for the progress bar
        # DDP averages the processes' gradients: times world, they add up to the whole batch's
        return loss * world, {"loss": shown.item(), "accuracy": stats}

    def accuracy(state: RunState) -> dict:
        recent = [s["accuracy"] for _, s in state.recent[-50:]]
        acc = [sum(s[j][0] for s in recent) / max(1, sum(s[j][1] for s in recent)) for j in range(cfg.k)]
        return {"acc1": f"{acc[0]:.2f}", "acck": f"{acc[-1]:.2f}"}

    # what a resumed run must share: every setting but those that do not change the weights (a run stopped
    # while its tau table was measured goes on with another --eval-prompts)
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("eval_prompts", "checkpoint_every")}
    key = {"config": settings, "base": before,
           "data": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
           "adapters": [adapter_digest(adapter) for *_, adapter in parts if adapter],
           "init": hashlib.sha256((Path(cfg.init) / "model.safetensors").read_bytes()).hexdigest() if cfg.init else None}
    state = train(head, opt, step_loss, Schedule(cfg.lr, cfg.warmup), Run(run_dir if rank == 0 else None, key),
                  steps=cfg.steps, every_steps=cfg.checkpoint_every, every_minutes=0, stop_at=stop_at,
                  desc="train-head", quiet=rank > 0, postfix=accuracy)
    if base_fingerprint(base) != before:
        raise RuntimeError("the base's weights changed during head training")
    head.config.base_fingerprint = before
    return head, {"train_config": asdict(cfg), "device": str(device), "resumed_at_step": state.resumed_at,
                  "induction_scores": scores,
                  "data_seconds": round(data_seconds),
                  "train_seconds": round(state.train_seconds), "sequences": len(data),  # over resumes
                  "distilled_tokens": sum(len(s) - p for p, s in data),
                  # tokens (prompt and continuation) of every step the head trained (about: mean length)
                  "trained_tokens": cfg.steps * cfg.batch_size * sum(len(s) for _, s in data) / len(data),
                  "final_loss": state.mean_loss(),
                  "head_parameters": head.num_params(), "head_layers": head.config.num_layers, "base_parameters": sum(p.numel() for p in base.parameters()),
                  "base_layer_parameters": sum(p.numel() for p in base.model.layers[0].parameters())}


def train_and_report(base_dir: Path, out: Path, cfg: HeadTrainConfig, data: Path | None = None,
                     device: str | None = None, restart: bool = False) -> dict:
    """What `train-head` does: distil, train, check the base, save, measure, write the model card.
    data: the user's text files (default: the built-in corpus); device: "cuda" when available, else "cpu"."""
    device = join_processes(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world = processes()
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: the distilled targets need not be bit-exact
    base, tok = load_llama(base_dir), load_tokenizer(base_dir)
    corpus = load_text_corpus(data) if data else load_corpus(HEAD_SOURCES)
    if cfg.replay:
        theirs = {st.get("data", "built-in corpus") for st in replayed_stages(cfg.init)}
        if theirs != {str(data or "built-in corpus")}:
            raise CheckpointError(f"--replay: the stages of {cfg.init} drew their prompts from {', '.join(sorted(theirs))}, "
                                  f"not {data or 'the built-in corpus'}: give the same --data")
    checkpoint = out / "checkpoint"
    if restart and checkpoint.exists():
        shutil.rmtree(checkpoint)
    if rank > 0:
        logging.getLogger("builder").setLevel(logging.WARNING)  # rank 0 speaks for all
    logger.info("training a head for %s on %s%s, data: %s", base_dir, device, f" x {world} processes" if world > 1 else "",
                data or "the built-in corpus (" + ", ".join(HEAD_SOURCES) + ")")
    head, log = train_head(base.to(device), tok, corpus, cfg, run_dir=checkpoint)
    log["processes"] = world
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
        if rank > 0:
            return log  # rank 0 saves the head, measures it and writes the card
    base, head = base.cpu(), head.cpu()
    log.update(base=str(base_dir), head=str(out), data=str(data or "built-in corpus"))
    if cfg.init and (Path(cfg.init) / "train_log.json").is_file():  # the stages before this one, for the card
        before = json.loads((Path(cfg.init) / "train_log.json").read_text())
        log["init_log"] = {k: v for k, v in before.items() if k != "acceptance"}
    save_head(head, out)
    logger.info("measuring tau on %d held-back prompts per task", cfg.eval_prompts)
    prompts = validation_prompts(corpus, min(cfg.eval_prompts, len(corpus.validation)), tasks=tuple(tok.tasks))
    log["acceptance"] = measure_acceptance(base, tok, prompts, range(1, head.config.k_train + 1), head=head)
    log["acceptance_prompts_sha256"] = prompts_digest(prompts)
    if any(st["train_config"].get("chat_messages") for st in training_stages(log)):  # reply on real messages too
        chat = [{"task": "reply", "prompt": m} for m in held_back()]
        log["acceptance_messages"] = measure_acceptance(base, tok, chat, range(1, head.config.k_train + 1), head=head)
        log["acceptance_messages_sha256"] = prompts_digest(chat)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    write_card(out, log, head.config)
    shutil.rmtree(checkpoint, ignore_errors=True)  # the head is saved: nothing left to resume
    return log


def stage_command(log: dict) -> str:
    """The train-head command line that reproduces one stage (its settings that differ from the defaults)."""
    t, d = log["train_config"], asdict(HeadTrainConfig())
    flags = {"seed": "--seed", "steps": "--steps", "prompts_per_task": "--prompts-per-task", "batch_size": "--batch-size",
             "lr": "--lr", "targets": "--targets", "kv_layer": "--kv-layer", "init": "--init", "layers": "--layers"}
    flags.update(draft_vocab="--draft-vocab", chat_messages="--chat-messages", eval_prompts="--eval-prompts")
    parts = [f"{flag} {t[key]}" for key, flag in flags.items() if t.get(key, d[key]) != d[key]]
    if t.get("cache_features"):
        parts.append("--cache-features")
    if t.get("replay"):
        parts.append("--replay")
    if log.get("base") not in (None, "models/base"):
        parts.insert(0, f"--base {log['base']}")
    if log.get("head") not in (None, "models/mtp"):  # where the stage wrote its head (a later stage's --init)
        parts.insert(0, f"--head {log['head']}")
    if t.get("task_prompts"):
        parts.append("--task-prompts " + ",".join(f"{k}={v}" for k, v in t["task_prompts"].items()))
    if t.get("everyday"):
        parts.append("--everyday " + ",".join(f"{k}={v}" for k, v in t["everyday"].items()))
        if t.get("adapters") not in (None, "models/adapters"):
            parts.append(f"--adapters {t['adapters']}")
    if log.get("data") not in (None, "built-in corpus"):
        parts.append(f"--data {log['data']}")
    return " ".join(["python -m builder train-head"] + parts)


def stage_context(log: dict) -> dict:
    """What templates/head_stage.md.j2's `stage` takes for one training stage: its log, its prompts of each task
    (the base's tasks, then a chat base's others) and the command that reproduces it."""
    t = log["train_config"]
    tasks = [*TASKS, *(task for task in t.get("task_prompts") or {} if task not in TASKS)]  # reply: a chat base's
    counts = {task: (t.get("task_prompts") or {}).get(task, t["prompts_per_task"]) for task in tasks}
    return {"log": log, "counts": counts, "command": stage_command(log)}


def stage_text(log: dict) -> str:
    """One training stage, in words (templates/head_stage.md.j2): its data, its targets, its steps and time."""
    return macro("head_stage.md.j2", "stage")(**stage_context(log))


FEATURES = ("continue", "proofread", "summarize", "reply")


def everyday_prompts(tok, task: str, n: int, seed: int) -> list[list[int]]:
    """n of the feature's everyday training texts (the adapters' training split) as its prompts; continue goes on
    with the reply set's messages."""
    if task not in FEATURES or task not in tok.tasks:
        raise UserError(f"--everyday {task}: the features are {', '.join(t for t in FEATURES if t in tok.tasks)}")
    return [encode_prompt(tok, task, text) for text in feature_texts(task, "train", n, seed)]


def stage_parts(tok, corpus: Corpus, t: dict) -> list[tuple[list[list[int]], int, str | None]]:
    """What one training stage drew (its own data, not what it replayed), from its settings (HeadTrainConfig as a
    dict, or its log's train_config): (prompts, new tokens, the adapter of the production model that decodes them
    or None for the base) parts."""
    everyday = t.get("everyday") or {}
    parts = []
    if not everyday or t.get("task_prompts") or t.get("chat_messages"):
        parts.append((training_prompts(tok, corpus, t["prompts_per_task"], t["seed"], t.get("task_prompts"),
                                       t.get("chat_messages", 0)), t["new_tokens"], None))
    root = Path(t.get("adapters") or "models/adapters")
    if everyday and not root.is_dir():
        raise UserError(f"--adapters {root}: no such folder (the features' adapters, models/adapters/TASK)")
    for task, n in everyday.items():
        adapter = root / task
        parts.append((everyday_prompts(tok, task, n, t["seed"] + 2000), t["new_tokens"],
                      str(adapter) if (adapter / "adapter_config.json").is_file() else None))
    return parts


def adapter_digest(directory: str) -> str:
    return sha256_file(Path(directory) / "adapter_model.safetensors")[:16]


def distil_parts(base: Llama, fingerprint: str, parts: list, kv_layer: int | None) -> list:
    """Each part's greedy continuations (and with kv_layer its features) by its production model: the base with
    the part's adapter attached for it (kept in build/distill/ under the base's and the adapter's digests)."""
    _, world = processes()
    got = []
    for prompts, n, adapter in parts:
        key = fingerprint
        if adapter:
            device = base.model.embed_tokens.weight.device
            load_adapter(base, adapter, fingerprint)
            base.to(device)
            key = f"{fingerprint}+{adapter_digest(adapter)}"
        try:
            got.append(distil_together(base, prompts, n, kv_layer) if world > 1 else distilled(base, key, prompts, n, kv_layer))
        finally:
            if adapter:
                remove_adapter(base)
    return got


def replayed_stages(init: str | None) -> list[dict]:
    """The stages `--replay` trains on again: every stage of the --init head, from its train_log.json."""
    if not init:
        raise CheckpointError("--replay replays the stages of the head given by --init: give --init")
    path = Path(init) / "train_log.json"
    if not path.is_file():
        raise CheckpointError(f"--replay: {path} is missing, the record of the stages to replay that train-head "
                              f"writes with the head")
    return training_stages(json.loads(path.read_text()))


def training_stages(log: dict) -> list[dict]:
    """Every training stage of a head, first to last: each stage's log holds the one it went on from."""
    return (training_stages(log["init_log"]) if "init_log" in log else []) + [log]


def write_card(out: Path, log: dict, hc: HeadConfig) -> None:
    """The head's card, rendered from templates/head_card.md.j2 (the numbers come from the log and the config)."""
    render_card(out, "head_card.md.j2", log=log, hc=hc, stages=[stage_context(st) for st in training_stages(log)])
