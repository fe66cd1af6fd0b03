"""The independent drafter baseline: its size, its own cache by prefix, and exactness in torch and ONNX."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from builder.decode.drafter import load_drafter, torch_drafter
from builder.decode.loop import compare_to_reference, decode
from builder.decode.torch_backend import TorchBackend
from builder.errors import CheckpointError
from builder.models.llama import LlamaConfig, Llama, save_llama
from builder.models.head import load_head
from builder.decode.onnx_backend import OnnxBackend
from builder.data.tasks import encode_prompt
from tests.conftest import INHOUSE, DRAFTER_DIR, HEAD_DIR, expect_error, run


@pytest.fixture(scope="module")
def drafter(base):
    return load_drafter(DRAFTER_DIR, base)


def test_drafter_is_a_separate_model_no_smaller_than_the_head(base, drafter):
    head = load_head(HEAD_DIR, base)
    n_drafter = sum(p.numel() for p in drafter.parameters())
    n_head = head.num_params()
    # the baseline is no smaller than the head (2 layers x 128; the deep base's one-layer head is 192 wide
    # with a shared LM head, 0.47 M against 0.87 M): a bigger drafter makes MTP's comparison harder, not easier
    assert n_head <= n_drafter <= 2 * n_head, (n_drafter, n_head)
    assert drafter.config.vocab_size == base.config.vocab_size
    assert drafter.model.embed_tokens.weight.shape == (base.config.vocab_size, drafter.config.hidden_size)
    base_storage = {p.untyped_storage().data_ptr() for p in base.parameters()}
    shared = [n for n, p in drafter.named_parameters() if p.untyped_storage().data_ptr() in base_storage]
    assert shared == [], f"the drafter's {shared} are the base's tensors: it must be a model of its own"


def test_drafter_reads_only_the_tokens_decided_since_its_last_call(drafter):
    fed = []
    d = torch_drafter(drafter)
    forward = d.forward
    d.forward = lambda ids, cache: (fed.append(list(ids)), forward(ids, cache))[1]
    first = d.draft([1, 50, 60, 70], 3)
    assert fed == [[1, 50, 60, 70], [first[0]], [first[1]]], "prefill, then one run per draft"
    fed.clear()
    d.draft([1, 50, 60, 70, first[0], 99], 2)  # first draft accepted, then the base's own token 99
    assert fed[0] == [99], f"the accepted draft is already cached: only 99 is read, got {fed[0]}"
    fed.clear()
    d.draft([1, 50, 61], 1)  # another sequence: the cache is cut back to the common prefix [1, 50]
    assert fed == [[61]]


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_drafter_speculative_decoding_equals_the_reference(base, drafter, tokenizer, validation_prompts, reference):
    eos = base.config.eos_token_id
    counts = {"equal": 0, "near-tie": 0, "mismatch": 0}
    accepted = []
    for p in validation_prompts[::3]:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = reference.decoded(ids, 32)
        for k in (1, 4, 6):
            out = decode(TorchBackend(base, drafter=torch_drafter(drafter)), ids, 32, eos, k)
            verdict, at = compare_to_reference(ref, out.ids)
            counts[verdict] += 1
            assert verdict != "mismatch", f"{p['prompt']!r} k={k}: first mismatch at token {at}"
            accepted += out.accepted
    print(f"\ndrafter, torch: {counts}; mean accepted per step {sum(accepted) / len(accepted):.2f}")
    assert sum(accepted) > 0, "the drafter never agrees with the base: it learnt nothing"


def test_onnx_drafter_equals_the_reference(base, onnx_dir, tokenizer, validation_prompts, reference):
    eos = base.config.eos_token_id
    for p in validation_prompts[::6]:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = reference.decoded(ids, 32)
        for k in (2, 5):
            out = decode(OnnxBackend(onnx_dir, "drafter", k), ids, 32, eos, k)
            verdict, at = compare_to_reference(ref, out.ids)
            assert verdict != "mismatch", f"{p['prompt']!r} k={k}: first mismatch at token {at}"


@pytest.mark.slow  # over 30 s in CI (2026-12-07)
def test_generate_mode_drafter_from_the_cli(tmp_path):
    for backend in ("torch", "onnx"):
        r = run("generate", *INHOUSE, "--prompt", "The json module", "--mode", "drafter", "--k", "3", "--max-new-tokens", "12",
                "--backend", backend, "--onnx-dir", str(tmp_path / "onnx"), "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        ref = json.loads(run("generate", *INHOUSE, "--prompt", "The json module", "--max-new-tokens", "12", "--json", "--mode", "ar").stdout)
        assert out["mode"] == "drafter" and out["ids"] == ref["ids"] and len(out["accepted"]) == out["steps"]


def test_a_drafter_with_another_vocabulary_is_refused(tmp_path):
    other = Llama(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1))
    save_llama(other, tmp_path / "drafter")
    r = run("generate", *INHOUSE, "--prompt", "The json module", "--mode", "drafter", "--drafter", str(tmp_path / "drafter"))
    expect_error(r, "vocab_size", "cannot draft for this base")
    with pytest.raises(CheckpointError):
        load_drafter(tmp_path / "drafter", Llama(LlamaConfig()))


def test_interrupted_drafter_training_resumes_to_the_same_weights(corpus, tmp_path, monkeypatch, caplog):
    """Ctrl-C at step 5 saves the run; the same run again resumes there and ends with the weights of an
    uninterrupted run (the drafter trains on the head's data: the base's continuations of the same prompts)."""
    import builder.train.drafter as td
    from builder.train.drafter import DrafterTrainConfig, train_drafter
    from tests.test_mtp import tiny_setup

    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    cfg = DrafterTrainConfig(hidden_size=32, intermediate_size=64, heads=4, kv_heads=2, batch_size=4, steps=8,
                             checkpoint_every=3, prompts_per_task=8, new_tokens=8)
    straight, log = train_drafter(tiny, tok, small, cfg)
    assert log["sequences"] == 16 and log["resumed_at_step"] == 0

    calls, real_loss = [], td.distill_loss

    def interrupt_at_fifth_step(*args):  # once a step
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_loss(*args)

    caplog.set_level(logging.INFO, logger="builder")
    monkeypatch.setattr(td, "distill_loss", interrupt_at_fifth_step)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny, tok, small, cfg, run_dir=tmp_path / "ckpt")
    monkeypatch.setattr(td, "distill_loss", real_loss)
    assert "saved the run after step 4" in caplog.text
    resumed, log = train_drafter(tiny, tok, small, cfg, run_dir=tmp_path / "ckpt")
    assert log["resumed_at_step"] == 4
    for name, t in straight.state_dict().items():
        assert torch.equal(t, resumed.state_dict()[name]), f"{name} differs from the uninterrupted run"


def test_a_drafter_learns_from_a_heads_cached_features(corpus, tmp_path):
    """--head DIR (a big base): the drafter trains on every sequence of that head's data, its targets the
    base's distribution over the head's draft vocabulary made from the cached hidden states (what the base
    itself gives, to fp16's precision), and its own vocabulary stays the base's whole one."""
    import random

    import torch.nn.functional as F

    from builder.models.head import save_head
    from builder.train.distill import make_batches
    from builder.train.drafter import DrafterTrainConfig, feature_loss, head_data, train_drafter
    from builder.train.head import HeadTrainConfig, train_head
    from builder.models.head import base_fingerprint
    from tests.test_mtp import tiny_setup

    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    hcfg = HeadTrainConfig(prompts_per_task=8, new_tokens=8, steps=2, batch_size=4, k=3, draft_vocab=64, cache_features=True)
    head, hlog = train_head(tiny, tok, small, hcfg)
    save_head(head, tmp_path / "mtp")
    (tmp_path / "mtp" / "train_log.json").write_text(json.dumps(hlog))

    data, feats, _, (rows, d2t) = head_data(tiny, tok, small, str(tmp_path / "mtp"), base_fingerprint(tiny))
    assert len(data) == hlog["sequences"] and torch.equal(d2t, head.d2t)
    seqs, valid, hidden = next(make_batches(data, 4, random.Random(0), feats))
    at = F.pad(valid[:, 1:], (0, 1))
    with torch.no_grad():
        live = F.softmax(tiny(seqs)[0][at][:, d2t], dim=-1)
        cached = F.softmax(F.linear(hidden[at].float(), rows), dim=-1)
    assert torch.allclose(live, cached, atol=2e-2), (live - cached).abs().max()

    cfg = DrafterTrainConfig(hidden_size=32, intermediate_size=64, heads=4, kv_heads=2, batch_size=4, steps=12,
                             lr=1e-2, head=str(tmp_path / "mtp"))
    drafter, log = train_drafter(tiny, tok, small, cfg)
    assert log["sequences"] == hlog["sequences"]
    assert drafter.config.vocab_size == tiny.config.vocab_size
    fresh = Llama(drafter.config)
    fresh.init_weights(cfg.seed)
    with torch.no_grad():
        before, _ = feature_loss(fresh, (rows, d2t), seqs, valid, hidden)
        after, _ = feature_loss(drafter, (rows, d2t), seqs, valid, hidden)
    assert after < before, (before, after)
