"""Greedy decoding, plain and speculative, as one loop over a small backend interface.

The loop (`decode`) is written once; a backend runs the models. `TorchBackend` runs the PyTorch
modules; the ONNX backend satisfies the same interface with onnxruntime.

How a decode goes, for a prompt of P tokens:
- prefill: the base reads the first P - 1 prompt tokens (no decision yet);
- every step feeds the base `[token] + drafts`: `token` is the last decided token (at first the last
  prompt token), `drafts` are k guesses of the tokens after it (none in plain decoding). The base's
  greedy choice after each fed token is compared with the next draft: the longest agreeing prefix of
  n drafts is accepted, and the base's own choice after it is taken too, so a step decides n + 1
  tokens - exactly those plain greedy decoding would decide, one pass instead of n + 1.
- the cache is rolled back to the n + 1 fed tokens that were right (a prefix view, no copy).
`steps` counts the base passes after the prefill: plain decoding takes one per token.
Decoding stops after `max_new_tokens` tokens, once the end-of-sequence token is decided (it is kept
in `ids`, and dropped from the text), or when the sequence fills the context window (a clamp: the
prompt plus its new tokens never exceed it); `Decoded.stopped` says which.

`decode_naive` recomputes the whole sequence at every token with no cache; it exists only to check
the cached path (they must give the same tokens).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .model import KV, Llama
from .tasks import PromptError


@dataclass
class Decoded:
    ids: list[int] = field(default_factory=list)        # new tokens
    steps: int = 0                                      # base passes after the prefill
    accepted: list[int] = field(default_factory=list)   # per step, drafts accepted (plain decoding: empty)
    margins: list[float] = field(default_factory=list)  # per new token, top-1 minus top-2 base logit
    stopped: str = ""  # why decoding ended: one of STOP_REASONS
    prefill_seconds: float = 0.0  # wall time of the prefill (the same base pass in every mode)


STOP_REASONS = ("max-new-tokens", "end-of-sequence", "context-window")
DEFAULT_K = 4                 # drafts per speculative step: the one default of the CLI and (by the manifest) the page
DEFAULT_MAX_NEW_TOKENS = 32   # likewise


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


def decode(backend, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None, k: int = 0) -> Decoded:
    """Greedy decoding; with k > 0 the backend drafts k tokens per step and the base verifies them."""
    limit = room(prompt_ids, max_new_tokens, backend.context)
    out = Decoded()
    t0 = time.perf_counter()
    state = backend.prefill(prompt_ids[:-1])
    out.prefill_seconds = time.perf_counter() - t0
    token = prompt_ids[-1]
    while True:
        # never draft past the limit: that also keeps every fed position inside the context
        k_step = min(k, limit - len(out.ids) - 1)
        drafts = backend.draft(state, token, k_step) if k_step > 0 else []
        choices, margins, state = backend.verify(state, [token] + drafts)
        n = 0
        while n < len(drafts) and drafts[n] == choices[n]:  # acceptance: the base chose the draft itself
            n += 1
        state = backend.rollback(state, n + 1)  # keep [token, d_1..d_n]; the rejected drafts go
        out.steps += 1
        if k:
            out.accepted.append(n)
        for tok, margin in zip(choices[: n + 1], margins[: n + 1]):
            out.ids.append(tok)
            out.margins.append(margin)
            if tok == eos_id or len(out.ids) == limit:
                out.stopped = ("end-of-sequence" if tok == eos_id else
                               "max-new-tokens" if limit == max_new_tokens else "context-window")
                return out
        token = out.ids[-1]


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy choice and margin (top-1 minus top-2 logit) at each position of logits (T, V)."""
    top = logits.topk(2, dim=-1).values
    return logits.argmax(dim=-1), top[:, 0] - top[:, 1]  # argmax: the first of tied maxima, as ONNX ArgMax


@dataclass
class TorchState:
    cache: list[KV]       # per layer (key, value), (1, S, n_kv, head_dim): positions 0..S-1
    hidden: torch.Tensor  # (T, C) the base's final hidden states of the last T fed tokens; the last is the anchor
    ids: list[int]        # the S tokens in the cache


class TorchBackend:
    """The decode loop's interface over the PyTorch base and, optionally, one draft source:

    `head`: anything with draft(base, hidden, token, cache, k) -> list[int] that reads the base's state,
    such as the MTP head; `drafter`: anything with draft(context_ids, k) -> list[int] that reads only
    tokens, such as the independent drafter (builder/drafter.py).
    """

    def __init__(self, base: Llama, head=None, drafter=None):
        if head is not None and drafter is not None:
            raise ValueError("one draft source: a head or a drafter")
        self.base, self.head, self.drafter = base, head, drafter
        self.context = base.config.max_position_embeddings

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> TorchState:
        _, hidden, cache = self.base(torch.tensor([ids]))
        return TorchState(cache, hidden[0], list(ids))

    @torch.no_grad()
    def verify(self, state: TorchState, ids: list[int]):
        logits, hidden, cache = self.base(torch.tensor([ids]), state.cache)
        choice, margin = greedy(logits[0])
        return choice.tolist(), margin.tolist(), TorchState(cache, hidden[0], state.ids + ids)

    def rollback(self, state: TorchState, n_fed: int) -> TorchState:
        """Keep the first n_fed of the tokens just verified: a prefix view of every cache tensor."""
        drop = state.hidden.shape[0] - n_fed
        if drop == 0:
            return state
        cache = [(k[:, :-drop], v[:, :-drop]) for k, v in state.cache]
        return TorchState(cache, state.hidden[:n_fed], state.ids[:-drop])

    def draft(self, state: TorchState, token: int, k: int) -> list[int]:
        if self.head is not None:
            return self.head.draft(self.base, state.hidden[-1], token, state.cache, k)
        if self.drafter is not None:
            return self.drafter.draft(state.ids + [token], k)
        raise ValueError("this backend has no draft source")


def decode_ar(model: Llama, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None) -> Decoded:
    """The reference: plain greedy decoding with the PyTorch base."""
    return decode(TorchBackend(model), prompt_ids, max_new_tokens, eos_id)


@torch.no_grad()
def decode_naive(model: Llama, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Greedy decoding by recomputing the full sequence for every token: slow, obviously right."""
    seq = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits, _, _ = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
        if seq[-1] == eos_id:
            break
    return seq[len(prompt_ids):]


NEAR_TIE = 1e-3  # CONTRACT.md: a divergence is excused only where the reference's margin is below this


def compare_to_reference(ref: Decoded, ids: list[int]) -> tuple[str, int | None]:
    """CONTRACT.md's exactness rule. Returns ("equal", None), ("near-tie", i) where the first difference
    is at a reference position whose top-1/top-2 margin is below NEAR_TIE (the rest is not compared),
    or ("mismatch", i)."""
    for i, (a, b) in enumerate(zip(ref.ids, ids)):
        if a != b:
            return ("near-tie" if ref.margins[i] < NEAR_TIE else "mismatch"), i
    if len(ref.ids) != len(ids):
        return "mismatch", min(len(ref.ids), len(ids))
    return "equal", None


def acceptance(accepted: list[int], k: int) -> tuple[float, list[float]]:
    """CONTRACT.md's acceptance figures of speculative steps: tau, the mean over steps of accepted drafts
    + 1 (tokens decided per base pass; 1 for plain decoding, which records no steps), and for draft
    positions 1..k the share of steps that accepted the i-th draft."""
    if not accepted:
        return 1.0, [0.0] * k
    tau = sum(a + 1 for a in accepted) / len(accepted)
    return tau, [sum(a >= i for a in accepted) / len(accepted) for i in range(1, k + 1)]
