"""Reference decoding: the KV-cached greedy loop equals a naive full-recompute loop."""
from __future__ import annotations

import pytest

from builder.generate import check_room, decode_ar, decode_naive
from builder.tasks import PromptError, encode_prompt


def test_cached_greedy_equals_naive_recompute_on_validation_prompts(base, tokenizer, validation_prompts):
    eos = base.config.eos_token_id
    prompts = validation_prompts[:6] + validation_prompts[30:36]  # both tasks
    for p in prompts:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        cached = decode_ar(base, ids, 24, eos)
        naive = decode_naive(base, ids, 24, eos)
        first = next((i for i, (a, b) in enumerate(zip(cached.ids, naive)) if a != b), None)
        assert cached.ids == naive, f"{p['task']} prompt {p['prompt']!r}: first mismatch at token {first}"
        assert cached.steps == len(cached.ids) == len(cached.margins)
        assert all(m >= 0 for m in cached.margins)


def test_decoding_stops_at_end_of_sequence(base, tokenizer, validation_prompts):
    eos = base.config.eos_token_id
    p = validation_prompts[30]  # proofread: the base ends its corrected sentence with <|endoftext|>
    out = decode_ar(base, encode_prompt(tokenizer, "proofread", p["prompt"]), 120, eos)
    assert out.ids[-1] == eos and eos not in out.ids[:-1], "decoding must stop right after the end token"


def test_prompt_must_leave_room_for_the_new_tokens(base):
    ctx = base.config.max_position_embeddings
    check_room([1] * (ctx - 8), 8, ctx)
    with pytest.raises(PromptError, match="context window"):
        check_room([1] * (ctx - 8), 9, ctx)
    with pytest.raises(PromptError, match="empty"):
        check_room([], 8, ctx)
    with pytest.raises(PromptError, match="at least 1"):
        check_room([1, 2], 0, ctx)
