"""Train a feature's adapter (LoRA) on the frozen base: the feature's production model is base + adapter.

Data (data/everyday.py): the training split's pairs of the feature, as the task's chat prompt
(data/tasks.py) and the answer the feature should give, ended by the base's end token. The loss is
cross-entropy on the answer's tokens alone. The task's prompt prefix (the chat template's system turn and
the instruction) is the same for every example: each step runs it once, with the adapter as it stands and
no gradient, and every sequence of the batch goes on from its cache; the prefix is a third to a half of
a sequence, so this saves that much of each step (the adapter still shapes the prefix's cache at every
step; only the gradient through it is left out).

The base's parameters have requires_grad off and are checked bit-for-bit unchanged at the end. The run is
the one training loop's (loop.py): checkpointed (the adapter's tensors and its optimizer only) in the run
directory every few minutes and on Ctrl-C or SIGTERM, resumed by the same command.

Quality (`quality`): the held-out pairs of the feature (conversations no training saw), decoded greedily by
the base and by the production model, scored by the feature's checks (`SCORES`); the card shows both and
samples.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from ..data.everyday import FRAME_WORDS, PAIRS, held_out, senders, summary_faults
from ..data.tasks import decode, encode_chat, encode_prompt, encode_text, load_tokenizer
from ..errors import UserError
from ..models.adapter import add_adapter, load_adapter, projections, remove_adapter, save_adapter
from ..models.head import base_fingerprint
from ..models.llama import Llama, load_llama
from .cards import render_card
from .distill import greedy_continuations, kept
from .loop import Run, Schedule, train

logger = logging.getLogger(__name__)

FEATURES = ("proofread", "reply", "summarize")  # the features with an adapter (`continue` is the plain chat model)
NEW_TOKENS = {"proofread": 64, "reply": 40, "summarize": 48}  # the longest answer a model may write here


@dataclass
class AdapterTrainConfig:
    task: str
    examples: int = 8000      # training pairs (fewer when the split has fewer)
    steps: int = 600
    batch_size: int = 16      # sequences per step
    lr: float = 1e-3
    warmup: int = 30
    rank: int = 8             # the adapter's rank on every projection
    alpha: float = 16.0       # its scale is alpha / rank
    seed: int = 0
    eval_examples: int = 200  # held-out pairs quality() decodes


def encode_pair(tok, task: str, text: str, answer: str, eos: int) -> tuple[list[int], list[int]]:
    """(the prompt's ids after the task's prefix, the answer's ids ended by eos)."""
    prompt = encode_prompt(tok, task, text)[len(tok.tasks[task]["prefix"]):]
    return prompt, encode_text(tok, answer) + [eos]


def batches(examples: list[tuple[list[int], list[int]]], batch: int, seed: int, pad: int):
    """batch(step) -> (ids (B, T), answer mask (B, T)): each epoch a fresh order (a function of the seed and
    the epoch alone, so a resumed run sees what an unstopped one would), right-padded."""
    def batch_at(step: int):
        epoch, i = divmod(step * batch, len(examples))
        order = list(range(len(examples)))
        random.Random(seed * 1000 + epoch).shuffle(order)
        rows = [examples[order[(i + j) % len(order)]] for j in range(batch)]
        T = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((batch, T), pad, dtype=torch.long)
        answer = torch.zeros(batch, T, dtype=torch.bool)
        for r, (p, a) in enumerate(rows):
            ids[r, :len(p) + len(a)] = torch.tensor(p + a)
            answer[r, len(p):len(p) + len(a)] = True
        return ids, answer
    return batch_at


def answer_loss(base: Llama, prefix: list[int], ids: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the answers' tokens, each predicted from the prefix and everything before it."""
    with torch.no_grad():
        _, _, cache = base(torch.tensor([prefix]))
    B = ids.shape[0]
    past = [(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)) for k, v in cache]
    # the token at t predicts the token at t+1: logits where the next token is an answer's
    targets = answer[:, 1:]
    logits, _, _ = base(ids[:, :-1], past, logits_at=targets)
    return F.cross_entropy(logits, ids[:, 1:][targets])


class AdapterWeights(nn.Module):
    """The attached adapter's tensors as one module: what the run's checkpoint holds (not the base)."""

    def __init__(self, base: Llama):
        super().__init__()
        self.parts = nn.ModuleList(m for _, p in projections(base) for m in (p.lora_A, p.lora_B))


# --- quality: the feature's checks on held-out pairs ---------------------------------------------------

ASSISTANT = re.compile(r"\b(as an ai|an ai\b|ai assistant|language model|chatbot|assistant|i'm here to help|"
                       r"how (can|may) i (help|assist)|happy to help|i don't have (the ability|personal)|"
                       r"i'm (just )?a (computer|program|bot)|trained by|smollm|hugging face|inconvenience)", re.I)


def proofread_score(text: str, answer: str, target: str) -> dict:
    """A fixed sentence is right when it is the target exactly; a clean one when it is left as it was."""
    return {"kind": "clean" if text == target else "fix", "ok": answer.strip() == target}


def reply_score(text: str, answer: str, target: str) -> dict:
    """A reply is right when it is 1-20 words and never speaks as an assistant or chatbot."""
    words = len(answer.split())
    return {"kind": "reply", "ok": 1 <= words <= 20 and not ASSISTANT.search(answer), "words": words}


def summarize_score(text: str, answer: str, target: str) -> dict:
    """A summary is right when it passes every faithfulness check (everyday.summary_faults)."""
    faults, people = summary_faults(text, answer), len(senders(text))
    return {"kind": "faithful", "ok": not faults, "faults": faults,
            "part": "a notice" if not people else "one person's messages" if people == 1 else "a group chat"}


SCORES = {"proofread": proofread_score, "reply": reply_score, "summarize": summarize_score}


# --- summarize's targets: the base at its best, by context distillation ------------------------------------

FEW_SHOT_INSTRUCTION = ("Summarize these notifications in one short sentence. Keep the names, times and numbers "
                        "that matter, and add nothing that is not in them.\n")
FEW_SHOT = [  # written for this prompt: a message stack, a notice, a stack that asks something, two people talking
    ("Mia: are you still coming tonight?\nMia: bring chips if you can\nJon: I'll be there at 8",
     "Mia asks if you're still coming tonight and to bring chips, and Jon will be there at 8."),
    ("Your order #3391 from Paper Store has shipped. Estimated delivery: Friday.",
     "Your Paper Store order #3391 has shipped and should arrive on Friday."),
    ("Ana: the dentist moved my appointment\nAna: can you pick up Theo from school at 3?\nAna: thanks!!",
     "Ana asks you to pick up Theo from school at 3 because her dentist appointment moved."),
    ("Sam: did you finish the book?\nLea: not yet, I'm on chapter 9\nSam: no spoilers then!",
     "Lea has not finished the book and is on chapter 9, so Sam says no spoilers."),
]


def few_shot_prompt(tok, stack: str) -> list[int]:
    """The base asked for a summary of stack after the worked examples of FEW_SHOT, each a turn of the chat."""
    messages = []
    for example, summary in FEW_SHOT:
        messages += [{"role": "user", "content": FEW_SHOT_INSTRUCTION + example}, {"role": "assistant", "content": summary}]
    return encode_chat(tok, messages + [{"role": "user", "content": FEW_SHOT_INSTRUCTION + stack}])


SAMPLES = 6          # candidate summaries per stack: the base's greedy one, then samples
TEMPERATURE = 0.7


@torch.no_grad()
def few_shot_candidates(base: Llama, prompts: list[list[int]], eos: int, seed: int, batch: int = 12) -> list[list[tuple[list[int], float]]]:
    """SAMPLES continuations of every prompt by the base: the greedy one first, then samples at TEMPERATURE
    (a generator seeded by seed and the batch), each with its mean log-probability under the base (T = 1).

    The prompts' common head (the instruction and the worked examples, nine tenths of each) runs once; each
    prompt's own tail goes on from its cache, in batches of tails of one length (no padding: every row is its
    prompt's own decoding up to float rounding), and its cache is repeated for its samples."""
    shared = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1) if len(prompts) > 1 else len(prompts[0]) - 1
    _, _, head = base(torch.tensor([prompts[0][:shared]]))
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    groups = [g[j:j + batch] for _, g in sorted(by_length.items()) for j in range(0, len(g), batch)]
    out: list = [None] * len(prompts)
    gen = torch.Generator().manual_seed(seed)
    for rows in tqdm(groups, desc="few-shot candidates", unit="batch"):
        B, n = len(rows), SAMPLES
        tails = torch.tensor([prompts[i][shared:] for i in rows])
        past = [(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)) for k, v in head]
        logits, _, cache = base(tails, past, at=torch.tensor([tails.shape[1] - 1]))
        cache = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in cache]
        logits = logits[:, -1].repeat_interleave(n, 0)  # (B * n, V): row r * n is prompt r's greedy one
        greedy = torch.arange(B) * n
        seqs, logp = [], torch.zeros(B * n)
        done = torch.zeros(B * n, dtype=torch.bool)
        for _ in range(NEW_TOKENS["summarize"]):
            nxt = torch.multinomial(F.softmax(logits / TEMPERATURE, -1), 1, generator=gen)[:, 0]
            nxt[greedy] = logits[greedy].argmax(-1)
            nxt[done] = eos
            logp += torch.where(done, 0.0, F.log_softmax(logits, -1).gather(1, nxt[:, None])[:, 0])
            seqs.append(nxt)
            done |= nxt == eos
            if done.all():
                break
            logits, _, cache = base(nxt[:, None], cache)
            logits = logits[:, -1]
        full = torch.stack(seqs, 1).tolist()
        for r, i in enumerate(rows):
            cands = []
            for row, lp in zip(full[r * n:(r + 1) * n], logp[r * n:(r + 1) * n].tolist()):
                new = row[: row.index(eos)] if eos in row else row
                cands.append((new, lp / max(1, len(new))))
            out[i] = cands
    return out


def distilled_summaries(base: Llama, tok, stacks: list[str], fingerprint: str, seed: int = 0) -> list[dict]:
    """The base's summaries of every stack under the few-shot prompt (`few_shot_candidates`, kept in
    build/distill/ in parts of 400 stacks, resumable), each with the faithfulness checks' faults. A stack's
    candidate is its greedy summary when that passes every check, else the passing sample the base finds
    likeliest, else the greedy one (with its faults): those with none are the training targets."""
    prompts = [few_shot_prompt(tok, s) for s in stacks]
    out, part = [], 400  # a part's stacks share batches by length: bigger parts, fuller batches
    for start in range(0, len(stacks), part):  # a part is kept by its own prompts: a longer run reuses a shorter's
        key = [fingerprint, prompts[start:start + part], NEW_TOKENS["summarize"], SAMPLES, TEMPERATURE, seed, start]
        got = kept(f"summaries-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]}.pt", lambda: few_shot_candidates(
            base, prompts[start:start + part], base.config.eos_token_id, seed * 7919 + start))
        for stack, cands in zip(stacks[start:start + part], got):
            rows = [{"stack": stack, "summary": (s := decode(tok, ids).strip()), "logp": lp,
                     "faults": summary_faults(stack, s) + echoes(stack, s)} for ids, lp in cands]
            passing = sorted((r for r in rows[1:] if not r["faults"]), key=lambda r: -r["logp"])
            best = rows[0] if not rows[0]["faults"] or not passing else passing[0]
            out.append({"stack": stack, "summary": best["summary"], "faults": best["faults"],
                        "greedy": best is rows[0], "passing": sum(not r["faults"] for r in rows)})
    return out


def echoes(stack: str, summary: str) -> list[str]:
    """A word of the worked message stacks' summaries (not a frame word) that the stack does not hold: the base
    copying an example ("asks you to pick up ..."), which the faithfulness checks allow as one new word but an
    adapter trained on such targets learns as a habit. Training targets only; the held-out check is theirs."""
    example = {w.lower() for x, s in FEW_SHOT if re.match(r"[A-Z][a-z]+: ", x) for w in re.findall(r"[A-Za-z']+", s)} - FRAME_WORDS
    have = {w.lower()[:5] for w in re.findall(r"[A-Za-z']+", stack)}
    words = [w for w in re.findall(r"[A-Za-z']+", summary) if w.lower() in example and w.lower()[:5] not in have]
    return [f"an example's words ({', '.join(words[:3])})"] if words else []


def digest(pairs: list[tuple[str, str]]) -> str:
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def answers(model: Llama, tok, task: str, texts: list[str], eos: int) -> list[str]:
    """The model's greedy answers to the task's prompts (batched, left-padded: distill.greedy_continuations)."""
    prompts = [encode_prompt(tok, task, t) for t in texts]
    with torch.no_grad():
        out = greedy_continuations(model, prompts, NEW_TOKENS[task], eos, batch=16)
    return [decode(tok, seq[n:]).strip() for n, seq in out]


def quality(model: Llama, tok, task: str, pairs: list[tuple[str, str]], eos: int) -> dict:
    """The feature's scores on pairs: the share right, per kind, with every answer."""
    got = answers(model, tok, task, [t for t, _ in pairs], eos)
    rows = [{"text": t, "target": g, "answer": a, **SCORES[task](t, a, g)} for (t, g), a in zip(pairs, got)]
    kinds, parts = {}, {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append(r["ok"])
        if "part" in r:  # summarize: the share right per kind of stack as well
            parts.setdefault(r["part"], []).append(r["ok"])
    share = lambda groups: {k: round(sum(v) / len(v), 4) for k, v in groups.items()}  # noqa: E731
    out = {"shares": share(kinds), "counts": {k: len(v) for k, v in kinds.items()}, "rows": rows}
    if parts:
        out["parts"] = {k: {"share": v, "count": len(parts[k])} for k, v in share(parts).items()}
    return out


# --- the run ---------------------------------------------------------------------------------------------

def train_adapter(base_dir: Path, out: Path, run_dir: Path, cfg: AdapterTrainConfig, *, minutes: float | None = None,
                  restart: bool = False, stop_at: int | None = None) -> dict:
    """Trains the feature's adapter on the frozen base, measures base and production model on the held-out
    pairs, saves the adapter (fp16) with its log and card in out; returns the log."""
    if cfg.task not in PAIRS:
        raise UserError(f"no adapter for the task {cfg.task!r}: choose one of {', '.join(PAIRS)}")
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(base_dir)
    if cfg.task not in tok.tasks:
        raise UserError(f"the base in {base_dir} does not offer the task {cfg.task!r} (a chat model does)")
    base = load_llama(base_dir)
    eos = base.config.eos_token_id
    fingerprint = base_fingerprint(base)
    before = {k: v.clone() for k, v in base.state_dict().items()}

    pairs = PAIRS[cfg.task]("train", cfg.examples, seed=cfg.seed)
    candidates = None
    if cfg.task == "summarize":  # targets: the base's own few-shot summaries that pass every check
        if tok.chat is None:
            raise UserError(f"summarize's targets come from the base's chat template, and {base_dir} has none")
        candidates = distilled_summaries(base, tok, [s for s, _ in pairs], fingerprint)
        pairs = [(c["stack"], c["summary"]) for c in candidates if not c["faults"]]
        logger.info("summarize: kept %d of %d candidate summaries", len(pairs), len(candidates))
    evaluation = held_out(cfg.task, cfg.eval_examples)
    # split_of keeps the conversations apart; a notice (slots filled at random) may come out the same in both
    held = {t for t, _ in evaluation}
    overlap = sum(t in held for t, _ in pairs)
    pairs = [(t, a) for t, a in pairs if t not in held]
    if overlap:
        logger.info("%s: %d training texts the held-out set also has left out", cfg.task, overlap)
    examples = [encode_pair(tok, cfg.task, t, a, eos) for t, a in pairs]
    prefix = tok.tasks[cfg.task]["prefix"]
    logger.info("%s: %d training pairs, %d held out", cfg.task, len(examples), len(evaluation))

    params = add_adapter(base, cfg.rank, cfg.alpha, seed=cfg.seed)
    weights = AdapterWeights(base)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    key = {"base": fingerprint, "config": {k: v for k, v in asdict(cfg).items() if k != "eval_examples"},
           "data": digest(pairs)}
    run = Run(run_dir, key)
    if restart and run.path.is_file():
        run.path.unlink()
    batch = batches(examples, cfg.batch_size, cfg.seed, pad=eos)

    def step_loss(step: int):
        ids, answer = batch(step)
        loss = answer_loss(base, prefix, ids, answer)
        return loss, {"loss": loss.item()}

    state = train(weights, opt, step_loss, Schedule(cfg.lr, cfg.warmup), run, steps=0 if minutes else cfg.steps,
                  minutes=minutes, every_minutes=5.0, stop_at=stop_at, desc=f"adapter {cfg.task}")
    base.eval()
    for k, v in base.state_dict().items():
        if k in before and not torch.equal(v, before[k]):
            raise RuntimeError(f"the base's {k} changed while its adapter trained")
    if stop_at is not None and state.step < state.steps:
        return {"stopped_at": state.step}

    save_adapter(base, out, cfg.rank, cfg.alpha, {"task": cfg.task, "base_fingerprint": fingerprint})
    remove_adapter(base)
    started = time.time()
    base_quality = quality(base, tok, cfg.task, evaluation, eos)
    load_adapter(base, out, fingerprint)
    adapter_quality = quality(base, tok, cfg.task, evaluation, eos)
    log = {"task": cfg.task, "config": asdict(cfg), "base_fingerprint": fingerprint,
           "train_pairs": len(examples), "train_digest": digest(pairs), "held_out": len(evaluation),
           "left_out_as_held_out": overlap,
           "candidates": None if candidates is None else {
               "count": len(candidates), "kept": len(pairs), "samples_per_stack": SAMPLES, "temperature": TEMPERATURE,
               "greedy": sum(c["greedy"] and not c["faults"] for c in candidates),
               "faults": fault_counts(candidates), "samples": candidates[:10]},
           "held_out_digest": digest(evaluation), "steps": state.step, "train_minutes": round(state.train_seconds / 60, 1),
           "final_loss": round(state.mean_loss(), 4), "eval_minutes": round((time.time() - started) / 60, 1),
           "adapter_bytes": (out / "adapter_model.safetensors").stat().st_size,
           "adapter_params": sum(p.numel() for p in params),
           "base": {k: v for k, v in base_quality.items() if k != "rows"},
           "adapter": {k: v for k, v in adapter_quality.items() if k != "rows"},
           "samples": [{"text": a["text"], "base": b["answer"], "adapter": a["answer"], "ok": a["ok"]}
                       for a, b in zip(adapter_quality["rows"], base_quality["rows"])]}
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    write_card(out, log)
    return log


def fault_counts(candidates: list[dict]) -> dict[str, int]:
    """How many candidates failed each check (a fault's kind: its words before any detail)."""
    counts: dict[str, int] = {}
    for c in candidates:
        for kind in {re.sub(r" \S+ not in the stack$", " not in the stack", f).split(" (")[0] for f in c["faults"]}:
            kind = re.sub(r"^\d+ words$", "not 3-25 words", kind)
            kind = re.sub(r"^[A-Z][a-z]+(?='s | )", "a sender", kind)  # who said what: one row, not one a name
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def write_card(out: Path, log: dict) -> None:
    """The adapter's card, rendered from templates/adapter_card.md.j2 (the numbers come from the log)."""
    render_card(out, "adapter_card.md.j2", log=log)
