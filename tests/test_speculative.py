"""The one decode loop: speculative decoding with any draft source gives exactly the plain greedy tokens.

An oracle drafter that knows the reference continuation, and corrupts it on purpose, drives every
branch of the acceptance rule: all drafts accepted, none, a prefix, and rollback of the cache.
"""
from __future__ import annotations

import random

import pytest
import torch

from builder.decode.loop import decode
from builder.decode.torch_backend import TorchBackend, decode_ar
from builder.models.llama import Llama, LlamaConfig
from tests.conftest import check_steps

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)  # tied, a random model repeats its last token forever


class OracleDrafter:
    """Drafts the reference continuation, with each draft wrong with probability `p_wrong`."""

    def __init__(self, prompt, reference, p_wrong, seed):
        self.seq, self.p_wrong, self.rng = list(prompt) + list(reference), p_wrong, random.Random(seed)
        self.calls = []

    def draft(self, base, hidden, token, cache, k):
        pos = cache[0][0].shape[1] + 1  # the token sits at position S; drafts follow it
        assert self.seq[pos - 1] == token, "the loop must feed the last decided token"
        self.calls.append((pos, k))
        out = []
        for i in range(k):
            right = self.seq[pos + i] if pos + i < len(self.seq) else 0
            out.append((right + 1) % CFG.vocab_size if self.rng.random() < self.p_wrong else right)
        return out


@pytest.fixture(scope="module")
def base():
    m = Llama(CFG)
    m.init_weights(seed=0)
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # sharpen the logits: no near-ties in this random model
    return m.eval()


@pytest.mark.parametrize("p_wrong", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_speculative_tokens_equal_plain_greedy(base, k, p_wrong):
    for seed in range(4):
        prompt = torch.randint(0, CFG.vocab_size, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = decode_ar(base, prompt, 40, None)
        assert len(set(ref.ids)) >= 5, f"seed={seed}: the reference repeats itself, a weak check of the loop"
        drafter = OracleDrafter(prompt, ref.ids, p_wrong, seed)
        got = decode(TorchBackend(base, drafter), prompt, 40, None, k)
        first = next((i for i, (a, b) in enumerate(zip(got.ids, ref.ids)) if a != b), None)
        assert got.ids == ref.ids, f"k={k} p_wrong={p_wrong} seed={seed}: first mismatch at token {first}"
        assert got.margins == pytest.approx(ref.margins, abs=1e-4)
        assert len(got.accepted) == got.steps and all(0 <= a <= k for a in got.accepted)
        check_steps(got.accepted, len(got.ids), got.stopped)  # no end token here: exactly accepted + 1 per step
        if p_wrong == 0.0:
            assert got.steps == -(-40 // (k + 1)), "perfect drafts: every step accepts all k"
        if p_wrong == 1.0:
            assert set(got.accepted) == {0} and got.steps == 40


def test_drafts_never_run_past_max_new_tokens_or_the_context(base):
    prompt = list(range(1, 20))
    ref = decode_ar(base, prompt, CFG.max_position_embeddings - len(prompt), None)
    drafter = OracleDrafter(prompt, ref.ids, 0.0, 0)
    got = decode(TorchBackend(base, drafter), prompt, len(ref.ids), None, 6)
    assert got.ids == ref.ids
    assert all(pos + k <= CFG.max_position_embeddings for pos, k in drafter.calls)


def test_stops_at_end_of_sequence_inside_an_accepted_run(base):
    """Perfect drafts at k=4: every step decides 5 tokens; the end token is one first decided in the middle
    of a later step, whose remaining accepted tokens must be dropped."""
    prompt = [3, 1, 4, 1, 5]
    ref = decode_ar(base, prompt, 30, None)
    first_at = {}
    for i, t in enumerate(ref.ids):
        first_at.setdefault(t, i)
    eos = next(t for t, i in first_at.items() if i >= 5 and i % 5 != 4)  # pretend this token is the end token
    want = ref.ids[: first_at[eos] + 1]
    got = decode(TorchBackend(base, OracleDrafter(prompt, ref.ids, 0.0, 0)), prompt, 30, eos, 4)
    assert got.ids == want == decode_ar(base, prompt, 30, eos).ids
    assert got.stopped == "end-of-sequence" and got.accepted[-1] == 4
    assert sum(a + 1 for a in got.accepted) > len(got.ids), "the end token was not inside the last step"
    check_steps(got.accepted, len(got.ids), got.stopped)
