"""Greedy decoding, plain and speculative, as one loop over a small backend interface.

The loop (`decode`) is written once; a backend runs the models: `torch_backend.TorchBackend` the PyTorch
modules, `onnx_backend.OnnxBackend` the exported graphs with onnxruntime, through the same interface:

    backend.context                      the context window, in tokens
    backend.prefill(ids) -> state        the base reads ids (no decision yet)
    backend.verify(state, ids) -> (choices, margins, state)   the base's greedy choice after each fed id
    backend.rollback(state, n_fed) -> state                   keep the first n_fed ids just verified
    backend.draft(state, token, k) -> (drafts, confidence)    up to k guesses of the tokens after token, and
                                         the draft source's probability of each (None where it gives none)

How a decode goes, for a prompt of P tokens:
- prefill: the base reads the first P - 1 prompt tokens (no decision yet);
- every step feeds the base `[token] + drafts`: `token` is the last decided token (at first the last
  prompt token), `drafts` are k guesses of the tokens after it (none in plain decoding). The base's
  greedy choice after each fed token is compared with the next draft: the longest agreeing prefix of
  n drafts is accepted, and the base's own choice after it is taken too, so a step decides n + 1
  tokens - exactly those plain greedy decoding would decide, one pass instead of n + 1. An MTP head with
  a draft vocabulary drafts only after a token the base chose (its graphs read that choice's embedding
  from the base's outputs, not a copy of the whole embedding): at the first step, only when the
  prompt's last token is the base's own choice there (a chat template's end is); otherwise that step
  verifies it alone.
- the cache is rolled back to the n + 1 fed tokens that were right (a prefix view, no copy).
With `draft_cut`, a step verifies only the drafts before the running product of their confidences falls
below it (`cut_drafts`): the head's probability that a draft and those before it are all right, by which a
further draft pays for the base reading one more token only where that is likely enough. Where a pass over
more tokens costs more (WASM: about a sixth of a one-token pass a token, docs/web.md) the page cuts (the
manifest's `draft_cut`, by execution provider); native onnxruntime and torch, where it costs a few percent, do not.
With `lookup`, a step first tries prompt lookup (`prompt_lookup`): where the text's last three tokens
occurred before, in the prompt or the answer so far, the up to LOOKUP_SPAN x k tokens that followed them
there are the drafts (no model runs; a summary or a proofread sentence copies much of its prompt, often
further than k tokens); elsewhere the mode's own source drafts k. `Decoded.lookups` says which steps
lookup drafted.
`steps` counts the base passes after the prefill: plain decoding takes one per token.
Decoding stops after `max_new_tokens` tokens, once the end-of-sequence token is decided (it is kept
in `ids`, and dropped from the text), or when the sequence fills the context window (a clamp: the
prompt plus its new tokens never exceed it); `Decoded.stopped` says which.

The modes (`MODES`), their draft sources and defaults are defined once, in contract.py; the CLI, the
benchmark and (through the manifest) the page read them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..contract import LOOKUP_SPAN, NEAR_TIE
from ..errors import PromptError


@dataclass
class Decoded:
    ids: list[int] = field(default_factory=list)        # new tokens
    steps: int = 0                                      # base passes after the prefill
    accepted: list[int] = field(default_factory=list)   # per step, drafts accepted (plain decoding: empty)
    margins: list[float] = field(default_factory=list)  # per new token, top-1 minus top-2 base logit
    stopped: str = ""  # why decoding ended: one of contract.STOP_REASONS
    prefill_seconds: float = 0.0  # wall time of the prefill (the same base pass in every mode)
    lookups: list[bool] = field(default_factory=list)  # per step, whether prompt lookup drafted it (plain: empty)
    verified: list[int] = field(default_factory=list)  # per step, the tokens its base pass read (1 + drafts)




def prompt_lookup(ids: list[int], k: int) -> list[int]:
    """Prompt lookup's drafts after ids (the prompt and the tokens decided so far): the up to k tokens that
    followed the latest earlier occurrence of ids' last three tokens; none where those did not occur before.
    web/src/generate.mjs's promptLookup is the same function."""
    a, b, c = ids[-3:] if len(ids) >= 3 else (None, None, None)
    for i in range(len(ids) - 2, 1, -1):
        if ids[i] == c and ids[i - 1] == b and ids[i - 2] == a:
            return ids[i + 1:i + 1 + k]
    return []


def cut_drafts(drafts: list[int], confidence: list[float] | None, draft_cut: float) -> list[int]:
    """The drafts before the running product of their confidences falls below draft_cut (all of them where
    there is no cut or no confidence). web/src/generate.mjs's cutDrafts is the same function."""
    if not draft_cut or confidence is None:
        return drafts
    n, sure = 0, 1.0
    while n < len(drafts) and sure * confidence[n] >= draft_cut:
        sure *= confidence[n]
        n += 1
    return drafts[:n]


def room(prompt_ids: list[int], max_new_tokens: int, context: int) -> int:
    """How many new tokens decoding may produce: max_new_tokens, clamped so that the prompt and its new
    tokens fit the context window. A prompt that leaves no room for one new token is an error."""
    if len(prompt_ids) < 2:  # with a marker or BOS first, only a model without either meets this with text
        raise PromptError("the prompt is empty" if not prompt_ids else
                          "the prompt is a single token: decoding needs at least two, write a little more")
    if max_new_tokens < 1:
        raise PromptError(f"max new tokens must be at least 1, got {max_new_tokens}")
    if len(prompt_ids) >= context:
        raise PromptError(f"the prompt is {len(prompt_ids)} tokens, too long for the context window of {context} "
                          f"tokens: shorten it by at least {len(prompt_ids) - context + 1} tokens")
    return min(max_new_tokens, context - len(prompt_ids))


def decode(backend, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None, k: int = 0,
           lookup: bool = False, draft_cut: float = 0.0) -> Decoded:
    """Greedy decoding; with k > 0 the backend drafts k tokens per step (with lookup, prompt lookup first,
    up to LOOKUP_SPAN x k; with draft_cut, only those the draft source is sure enough of) and the base
    verifies them."""
    limit = room(prompt_ids, max_new_tokens, backend.context)
    out = Decoded()
    t0 = time.perf_counter()
    state = backend.prefill(prompt_ids[:-1])
    out.prefill_seconds = time.perf_counter() - t0
    token = prompt_ids[-1]
    while True:
        # never draft past the limit: that also keeps every fed position inside the context
        left = limit - len(out.ids) - 1
        k_step = min(k, left)
        drafts = prompt_lookup(prompt_ids + out.ids, min(LOOKUP_SPAN * k, left)) if lookup and k_step > 0 else []
        looked_up = bool(drafts)
        if k_step > 0 and not looked_up:
            drafts = cut_drafts(*backend.draft(state, token, k_step), draft_cut)
        choices, margins, state = backend.verify(state, [token] + drafts)
        n = 0
        while n < len(drafts) and drafts[n] == choices[n]:  # acceptance: the base chose the draft itself
            n += 1
        state = backend.rollback(state, n + 1)  # keep [token, d_1..d_n]; the rejected drafts go
        out.steps += 1
        out.verified.append(1 + len(drafts))
        if k:
            out.accepted.append(n)
            out.lookups.append(looked_up)
        for tok, margin in zip(choices[: n + 1], margins[: n + 1]):
            out.ids.append(tok)
            out.margins.append(margin)
            if tok == eos_id or len(out.ids) == limit:
                out.stopped = ("end-of-sequence" if tok == eos_id else
                               "max-new-tokens" if limit == max_new_tokens else "context-window")
                return out
        token = out.ids[-1]




def compare_to_reference(ref: Decoded, ids: list[int]) -> tuple[str, int | None]:
    """docs/contract.md's exactness rule. Returns ("equal", None), ("near-tie", i) where the first difference
    is at a reference position whose top-1/top-2 margin is below NEAR_TIE (the rest is not compared),
    or ("mismatch", i)."""
    for i, (a, b) in enumerate(zip(ref.ids, ids)):
        if a != b:
            return ("near-tie" if ref.margins[i] < NEAR_TIE else "mismatch"), i
    if len(ref.ids) != len(ids):
        return "mismatch", min(len(ref.ids), len(ids))
    return "equal", None


def acceptance(accepted: list[int], k: int) -> tuple[float, list[float]]:
    """docs/contract.md's acceptance figures of speculative steps: tau, the mean over steps of accepted drafts
    + 1 (tokens decided per base pass; 1 for plain decoding, which records no steps), and for draft
    positions 1..k, and on to the furthest a prompt lookup step accepted, the share of steps that accepted
    the i-th draft (so tau = 1 + their sum)."""
    if not accepted:
        return 1.0, [0.0] * k
    tau = sum(a + 1 for a in accepted) / len(accepted)
    return tau, [sum(a >= i for a in accepted) / len(accepted) for i in range(1, max(k, *accepted) + 1)]
