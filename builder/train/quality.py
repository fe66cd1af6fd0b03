"""A base's own quality on the seed's tasks, for its model card: the share of validation sentences with
typos that its greedy proofread turns into exactly the correct sentence, and unedited samples of every
task it offers (validation text only: never trained on, by the head either).

    python -m builder.train.quality models/base [N_PROOFREAD] > quality.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..data.corpus import HEAD_SOURCES, load_corpus, proofread_pairs, validation_prompts
from ..data.tasks import load_tokenizer
from .base import scores


def quality(base: Path, n_proofread: int = 200, n_samples: int = 3, seed: int = 1) -> dict:
    corpus = load_corpus(HEAD_SOURCES)
    proofread = proofread_pairs(corpus.validation, seed)[:n_proofread]
    samples = validation_prompts(corpus, n_samples, seed=seed + 1, tasks=tuple(load_tokenizer(base).tasks))
    v = scores(base, {}, proofread, [], samples)
    v["proofread_examples"] = [{"prompt": t, "expected": c} for t, c in proofread[:5]]
    return v


if __name__ == "__main__":
    print(json.dumps(quality(Path(sys.argv[1]), *map(int, sys.argv[2:3])), indent=2, ensure_ascii=False))
