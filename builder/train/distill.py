"""What the head and the drafter learn from and are measured by.

Self-distillation data: prompts of every task from the training split (`training_prompts`); the frozen
base writes its own greedy continuation of each (`greedy_continuations`, in left-padded batches of similar
prompt length, and with the features the head reads when asked), kept in build/distill/ by (base,
prompts, length) (`distilled`): the head and the
drafter distil the same data, and on this CPU that is a quarter of each one's time. `make_batches`
serves it as padded batches in an order that depends on the content alone.

`measure_acceptance`: tau and acceptance by draft position on held-back prompts, and whether every
output equals plain greedy decoding: the tables of both model cards.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..data.corpus import Corpus, proofread_pairs, summary_pairs
from ..data.messages import training_messages
from ..data.tasks import encode_prompt, encode_text
from ..decode.loop import acceptance, compare_to_reference, decode
from ..decode.torch_backend import TorchBackend, decode_ar
from ..errors import CheckpointError
from ..models.llama import Llama, apply_rope, rope_cos_sin

logger = logging.getLogger(__name__)


def training_prompts(tok, corpus: Corpus, n: int, seed: int, per_task: dict[str, int] | None = None,
                     chat: int = 0) -> list[list[int]]:
    """Prompt ids of every task from the training split: continue prefixes of 4-40 tokens, proofread
    sentences with typos, summarize passages (n of each, or per_task[task], or as many as there are); and
    `chat` more reply prompts that are real messages (messages.training_messages)."""
    rng = random.Random(seed)
    prompts = []
    count = lambda task, pool: min((per_task or {}).get(task, n), len(pool))  # noqa: E731
    prefix = tok.tasks["continue"]["prefix"]
    for text in rng.sample(corpus.train, count("continue", corpus.train)):
        ids = encode_text(tok, text)
        prompts.append(prefix + ids[: rng.randint(4, min(40, max(4, len(ids) - 8)))] + tok.tasks["continue"]["suffix"])
    # fresh typos (another seed than the base's training pairs): the base has not memorised these fixes
    pairs = proofread_pairs(corpus.train, seed + 1000)
    for typo, _ in rng.sample(pairs, count("proofread", pairs)):
        prompts.append(encode_prompt(tok, "proofread", typo))
    if "summarize" in tok.tasks:  # passages of the training sections (none in a user's plain text files)
        passages = summary_pairs(corpus.train_sections)
        for passage, _ in rng.sample(passages, count("summarize", passages)):
            prompts.append(encode_prompt(tok, "summarize", passage))
    if "reply" in tok.tasks:  # a paragraph as the message to answer
        for text in rng.sample(corpus.train, count("reply", corpus.train)):
            prompts.append(encode_prompt(tok, "reply", " ".join(text.split()[:80])))
    if chat:
        if "reply" not in tok.tasks:
            raise CheckpointError("--chat-messages: this base offers no reply task")
        pool = training_messages()
        prompts += [encode_prompt(tok, "reply", m) for m in rng.sample(pool, min(chat, len(pool)))]
    return prompts


@torch.no_grad()
def greedy_continuations(base: Llama, prompts: list[list[int]], new_tokens: int, eos: int, batch: int = 32,
                         kv_layer: int | None = None):
    """The base's greedy continuation of every prompt, as (prompt_len, full sequence) pairs in prompt order.

    Prompts of similar length share a batch, left-padded: the padding's keys carry a -1e9 bias (exp gives
    them exactly 0) and positions count from the padding (rotary attention depends on distances only),
    so each row is its prompt's own decoding up to float rounding. With kv_layer, also per sequence the
    base's features there (fp16): final hidden states and layer kv_layer's keys (rotated back to the
    sequence's own positions) and values, what the head reads; one more step feeds the last token."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out, feats = [None] * len(prompts), [None] * len(prompts)
    device = next(base.parameters()).device
    for b in tqdm(range(0, len(order), batch), desc="self-distillation data", unit="batch"):
        rows = order[b:b + batch]
        L = len(prompts[rows[-1]])
        pads = [L - len(prompts[i]) for i in rows]
        ids = torch.tensor([[0] * p + prompts[i] for p, i in zip(pads, rows)], device=device)
        # as many steps as the shortest prompt has room for; each row keeps what its own prompt has room for
        # (a row's own positions stay within the context window, whatever the padding before them)
        own = [max(0, min(new_tokens, base.config.max_position_embeddings - len(prompts[i]))) for i in rows]
        room = max(own)
        bias = torch.zeros(len(rows), L + room + 1, device=device)
        for r, p in enumerate(pads):
            bias[r, :p] = -1e9
        logits, hidden, cache = base(ids, key_bias=bias[:, :L])
        seqs, hiddens, done = [ids], [hidden], torch.zeros(len(rows), dtype=torch.bool, device=device)
        for step in range(room):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seqs.append(nxt)
            done |= nxt[:, 0] == eos
            finished = bool(done.all()) or step == room - 1
            if finished and kv_layer is None:
                break
            logits, hidden, cache = base(nxt, cache, key_bias=bias[:, :L + step + 1])
            hiddens.append(hidden)
            if finished:
                break
        full = torch.cat(seqs, 1)
        for r, (i, p) in enumerate(zip(rows, pads)):
            new = full[r, L:L + own[r]].tolist()
            if eos in new:
                new = new[: new.index(eos) + 1]
            out[i] = (len(prompts[i]), prompts[i] + new)
        if kv_layer is None:
            continue
        hidden, (keys, values) = torch.cat(hiddens, 1), cache[kv_layer]
        for r, (i, p) in enumerate(zip(rows, pads)):
            n = len(out[i][1])
            cos, sin = rope_cos_sin(torch.tensor([-p], device=device), base.config.head_dim, base.config.rope_theta)
            k = apply_rope(keys[r:r + 1, p:p + n], cos, sin)[0]
            feats[i] = tuple(t.to("cpu", torch.float16).clone() for t in (hidden[r, p:p + n], k, values[r, p:p + n]))
    return out if kv_layer is None else (out, feats)


DISTILL_CACHE = Path(__file__).resolve().parents[2] / "build" / "distill"


def kept(name: str, compute):
    """compute()'s result, kept as build/distill/name: read back when there, else computed and saved (whole, then
    renamed into place), so a stopped run goes on where it was."""
    path = DISTILL_CACHE / name
    if path.is_file():
        return torch.load(path, weights_only=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    got = compute()
    torch.save(got, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return got


def distilled(base: Llama, fingerprint: str, prompts: list[list[int]], new_tokens: int, kv_layer: int | None = None,
              part: int = 512):
    """greedy_continuations, kept in build/distill/ by (base, prompts, length, kv_layer) in parts of `part`
    prompts, so a stopped run goes on where it was: train-head and train-drafter distil the same data.
    With kv_layer returns (data, features), as greedy_continuations does."""
    key = hashlib.sha256(json.dumps([fingerprint, prompts, new_tokens, kv_layer]).encode()).hexdigest()[:20]
    data, feats = [], []
    for start in range(0, len(prompts), part):
        got = kept(f"{key}/{start:07d}.pt", lambda: greedy_continuations(
            base, prompts[start:start + part], new_tokens, base.config.eos_token_id, kv_layer=kv_layer))
        if kv_layer is None:
            data += got
        else:
            data += got[0]
            feats += got[1]
    logger.info("the base's continuations of %d prompts: %s", len(prompts), DISTILL_CACHE / key)
    return data if kv_layer is None else (data, feats)


def each_once(parts: list) -> tuple[list, list]:
    """Several distillations (each as `distilled` returns it with kv_layer: (data, features)) as one, every
    sequence once (where it first came): stages whose prompts overlap."""
    data, feats, seen = [], [], set()
    for got, fs in parts:
        for d, f in zip(got, fs):
            if tuple(d[1]) not in seen:
                seen.add(tuple(d[1]))
                data.append(d)
                feats.append(f)
    return data, feats


def make_batches(data, batch: int, rng: random.Random, feats: list | None = None):
    """Endless batches of similar length, right-padded (causal attention ignores the padding). The order
    depends on the data's content only, not on the order it came in (distilled by one process or several).
    feats: per sequence of data, tensors (length, ..) to batch with it, zero-padded the same way."""
    order = sorted(range(len(data)), key=lambda i: (len(data[i][1]), data[i][1], data[i][0]))
    groups = [order[i:i + batch] for i in range(0, len(order), batch)]
    while True:
        rng.shuffle(groups)
        for g in groups:
            N = max(len(data[i][1]) for i in g)
            seqs = torch.zeros(len(g), N, dtype=torch.long)
            valid = torch.zeros(len(g), N, dtype=torch.bool)
            for r, i in enumerate(g):
                p, s = data[i]
                seqs[r, : len(s)] = torch.tensor(s)
                valid[r, p: len(s)] = True
            if feats is None:
                yield seqs, valid
                continue
            padded = [torch.zeros(len(g), N, *t.shape[1:], dtype=t.dtype) for t in feats[g[0]]]
            for r, i in enumerate(g):
                for out, t in zip(padded, feats[i]):
                    out[r, : len(t)] = t
            yield seqs, valid, *padded


def measure_acceptance(base: Llama, tok, prompts: list[dict], ks, max_new_tokens: int = 48, lookup: bool = False,
                       **source) -> dict:
    """Per task and k: tau, acceptance by draft position, and whether every output equals plain greedy.
    source: head=... or drafter=..., as TorchBackend takes them; lookup: prompt lookup first (loop.py). A prompt that leaves no room for
    max_new_tokens in the context window (a long summarize passage) is left out; "prompts" counts the rest."""
    eos, room = base.config.eos_token_id, base.config.max_position_embeddings - max_new_tokens
    table = {}
    for task in sorted({p["task"] for p in prompts}):
        items = [encode_prompt(tok, task, p["prompt"]) for p in prompts if p["task"] == task]
        items = [ids for ids in items if len(ids) <= room]
        refs = [decode_ar(base, ids, max_new_tokens, eos) for ids in items]
        for k in ks:
            accepted, mismatches, near_ties = [], 0, 0
            for ids, ref in zip(items, refs):
                out = decode(TorchBackend(base, **source), ids, max_new_tokens, eos, k, lookup=lookup)
                verdict, _ = compare_to_reference(ref, out.ids)
                mismatches += verdict == "mismatch"
                near_ties += verdict == "near-tie"
                accepted += out.accepted
            tau, by_position = acceptance(accepted, k)
            table[f"{task}/k={k}"] = {"task": task, "k": k, "prompts": len(items), "steps": len(accepted), "tau": tau,
                                      "accept_by_position": by_position, "mismatches": mismatches,
                                      "near_ties": near_ties}
    return table
