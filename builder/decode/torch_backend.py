"""The decode loop's backend over the PyTorch modules, and the reference decoders.

`TorchBackend` satisfies loop.py's interface with the PyTorch base and one optional draft source.
`decode_ar` is the reference of docs/contract.md's exactness rule: plain greedy decoding with the PyTorch base.
`decode_naive` recomputes the whole sequence at every token with no cache; it exists only to check the
cached path (they must give the same tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.head import MTPHead
from ..models.llama import KV, Llama
from .loop import Decoded, decode


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy choice and margin (top-1 minus top-2 logit) at each position of logits (T, V)."""
    top = logits.topk(2, dim=-1).values
    return logits.argmax(dim=-1), top[:, 0] - top[:, 1]  # argmax: the first of tied maxima, as ONNX ArgMax


@dataclass
class TorchState:
    cache: list[KV]       # per layer (key, value), (1, S, n_kv, head_dim): positions 0..S-1
    hidden: torch.Tensor  # (T, C) the base's final hidden states of the last T fed tokens (after a prefill, its last
                          # only); the last is the anchor
    choices: list[int]    # the base's greedy choices there
    ids: list[int]        # the S tokens in the cache


class TorchBackend:
    """The decode loop's interface over the PyTorch base and, optionally, one draft source:

    `head`: anything with draft(base, hidden, token, cache, k) -> list[int] that reads the base's state,
    such as the MTP head (with a draft vocabulary, only after the base's own choice: see `draft`); `drafter`: anything with draft(context_ids, k) -> list[int] that reads only
    tokens, such as the independent drafter (drafter.py).
    """

    def __init__(self, base: Llama, head=None, drafter=None):
        if head is not None and drafter is not None:
            raise ValueError("one draft source: a head or a drafter")
        self.base, self.head, self.drafter = base, head, drafter
        self.context = base.config.max_position_embeddings

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> TorchState:
        """The base reads ids; it decides after the last only (as the graphs' prefill: graphs.py)."""
        logits, hidden, cache = self.base(torch.tensor([ids]), at=torch.tensor([len(ids) - 1]))
        return TorchState(cache, hidden[0], greedy(logits[0])[0].tolist(), list(ids))

    @torch.no_grad()
    def verify(self, state: TorchState, ids: list[int]):
        logits, hidden, cache = self.base(torch.tensor([ids]), state.cache)
        choice, margin = greedy(logits[0])
        return choice.tolist(), margin.tolist(), TorchState(cache, hidden[0], choice.tolist(), state.ids + ids)

    def rollback(self, state: TorchState, n_fed: int) -> TorchState:
        """Keep the first n_fed of the tokens just verified: a prefix view of every cache tensor."""
        drop = state.hidden.shape[0] - n_fed
        if drop == 0:
            return state
        cache = [(k[:, :-drop], v[:, :-drop]) for k, v in state.cache]
        return TorchState(cache, state.hidden[:n_fed], state.choices[:n_fed], state.ids[:-drop])

    def draft(self, state: TorchState, token: int, k: int) -> tuple[list[int], list[float] | None]:
        if self.head is not None:
            if isinstance(self.head, MTPHead) and self.head.config.draft_vocab and token != state.choices[-1]:
                return [], None  # as its graphs, which embed only the base's choices (graphs.HeadGraph; loop.py)
            return self.head.draft(self.base, state.hidden[-1], token, state.cache, k)
        if self.drafter is not None:
            return self.drafter.draft(state.ids + [token], k), None  # greedy ids, no probabilities
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
