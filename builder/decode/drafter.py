"""The independent drafter as a draft source: a small language model of its own that reads only tokens.

Unlike the MTP head it keeps its own KV cache over the whole sequence and must prefill the prompt. It
keeps the cache of the longest prefix of the context it has already read (accepted drafts included), so
each step it reads only the tokens decided since, then drafts greedily, one token per forward pass.
The model is run through two functions, so the same logic serves PyTorch and ONNX:
    forward(ids, cache) -> (greedy token after the last id, new cache)    cache None: nothing read yet
    trim(cache, n) -> the cache of the first n positions (a prefix view)
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..contract import DRAFTER_K_MAX
from ..errors import CheckpointError
from ..models.head import base_fingerprint
from ..models.llama import Llama, load_config, load_llama

logger = logging.getLogger(__name__)



class IndependentDrafter:
    def __init__(self, forward, trim):
        self.forward, self.trim = forward, trim
        self.ids: list[int] = []  # the tokens whose keys and values are in self.cache, in order
        self.cache = None

    def draft(self, context: list[int], k: int) -> list[int]:
        """k greedy drafts after context (the sequence so far, its last token decided but not yet read)."""
        keep = 0
        while keep < min(len(self.ids), len(context) - 1) and self.ids[keep] == context[keep]:
            keep += 1
        cache = self.trim(self.cache, keep) if keep else None
        ids, feed, drafts = context[:keep], context[keep:], []
        for _ in range(k):
            token, cache = self.forward(feed, cache)
            ids = ids + feed
            feed = [token]
            drafts.append(token)
        self.ids, self.cache = ids, cache  # the last draft is not read: the next context decides it
        return drafts


def torch_drafter(model: Llama) -> IndependentDrafter:
    @torch.no_grad()
    def forward(ids, cache):
        logits, _, cache = model(torch.tensor([ids]), cache)
        return int(logits[0, -1].argmax()), cache

    return IndependentDrafter(forward, lambda cache, n: [(k[:, :n], v[:, :n]) for k, v in cache])


def drafter_for(base_dir: Path, drafter_dir: Path) -> Path | None:
    """drafter_dir when it holds a drafter distilled from the base in base_dir (its config.json records
    that base's fingerprint), else None (logged): the default drafter of `build`."""
    if not (Path(drafter_dir) / "config.json").is_file():
        logger.info("no drafter in %s: the site offers plain decoding and MTP", drafter_dir)
        return None
    if load_config(drafter_dir).get("base_fingerprint") != base_fingerprint(load_llama(base_dir)):
        logger.info("the drafter in %s was not distilled from %s: the site offers plain decoding and MTP "
                    "(--drafter DIR adds one)", drafter_dir, base_dir)
        return None
    return Path(drafter_dir)


def load_drafter(directory: str | Path, base: Llama) -> Llama:
    """An independent drafter checkpoint, checked to share the base's vocabulary and context."""
    drafter = load_llama(directory)
    for field in ("vocab_size", "max_position_embeddings", "eos_token_id"):
        if getattr(drafter.config, field) != getattr(base.config, field):
            raise CheckpointError(f"the drafter in {directory} has {field} {getattr(drafter.config, field)}, "
                                  f"the base {getattr(base.config, field)}: it cannot draft for this base")
    return drafter
