"""Reference decoding: the KV-cached greedy loop equals a naive full-recompute loop."""
from __future__ import annotations

import pytest
import torch

from builder.decode.loop import decode, room
from builder.decode.torch_backend import TorchBackend, decode_ar, decode_naive
from builder.data.tasks import encode_prompt
from builder.errors import PromptError
from tests.conftest import HEAD_DIR


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
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
        with torch.no_grad():  # the margins: top-1 minus top-2 logit where each new token was chosen, one full pass
            logits = base(torch.tensor([ids + cached.ids]))[0][0, len(ids) - 1: -1]
        top = logits.sort(dim=-1, descending=True).values
        assert cached.margins == pytest.approx((top[:, 0] - top[:, 1]).tolist(), abs=1e-4), p["prompt"]


def test_decoding_stops_at_end_of_sequence(base, tokenizer, validation_prompts):
    eos = base.config.eos_token_id
    p = validation_prompts[30]  # proofread: the base ends its corrected sentence with <|endoftext|>
    out = decode_ar(base, encode_prompt(tokenizer, "proofread", p["prompt"]), 120, eos)
    assert out.ids[-1] == eos and eos not in out.ids[:-1], "decoding must stop right after the end token"
    assert out.stopped == "end-of-sequence"


def test_new_tokens_are_clamped_to_the_context_window(base):
    ctx = base.config.max_position_embeddings
    assert room([1] * (ctx - 8), 8, ctx) == 8
    assert room([1] * (ctx - 8), 9, ctx) == 8
    assert room([1] * (ctx - 1), 100, ctx) == 1
    with pytest.raises(PromptError, match=f"too long for the context window of {ctx} tokens: shorten it by at least 1"):
        room([1] * ctx, 1, ctx)
    with pytest.raises(PromptError, match="empty"):
        room([], 8, ctx)
    with pytest.raises(PromptError, match="at least 1"):
        room([1, 2], 0, ctx)


def test_reaching_the_context_window_stops_cleanly_and_says_so(base, tokenizer, corpus):
    """A prompt 5 tokens short of the window: every mode decides exactly those 5 tokens, the same ones."""
    from builder.models.head import load_head

    ctx = base.config.max_position_embeddings
    eos = base.config.eos_token_id
    for start in range(0, 400, 40):  # the first window-filling prompt the base does not end within 5 tokens
        ids = encode_prompt(tokenizer, "continue", " ".join(corpus.validation[start:start + 40]))[: ctx - 5]
        ref = decode_ar(base, ids, 50, eos)
        if eos not in ref.ids:
            break
    assert len(ids) == ctx - 5 and eos not in ref.ids
    assert len(ref.ids) == 5 and ref.stopped == "context-window"
    mtp = decode(TorchBackend(base, head=load_head(HEAD_DIR, base)), ids, 50, eos, k=4)
    assert mtp.ids == ref.ids and mtp.stopped == "context-window"
    assert decode_ar(base, ids, 5, eos).stopped == "max-new-tokens"
