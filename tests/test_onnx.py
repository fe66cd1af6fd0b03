"""The ONNX export: valid graphs, truly dynamic axes, a manifest that describes them, files checked by
sha256, and - through the one decode loop - the same tokens as the torch reference."""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import onnx
import pytest
import torch

from builder.export import MANIFEST, export
from builder.generate import compare_to_reference, decode, decode_ar
from builder.model import CheckpointError
from builder.mtp import load_head
from builder.onnx_backend import OnnxBackend
from builder.tasks import SPECIAL_TOKENS, TASKS, encode_prompt
from tests.conftest import BASE_DIR, HEAD_DIR, ROOT
from tests.test_cli import expect_error, run


@pytest.fixture(scope="module")
def backend(onnx_dir):
    return OnnxBackend(onnx_dir, with_head=True, fused=True)


@pytest.fixture(scope="module")
def head(base):
    return load_head(HEAD_DIR, base)


def test_both_graphs_pass_the_onnx_checker(onnx_dir):
    for name in ("base.onnx", "head.onnx", "head_k1.onnx", "step.onnx"):
        onnx.checker.check_model(str(onnx_dir / name), full_check=True)
        assert onnx.load(str(onnx_dir / name)).opset_import[0].version == 18


def test_manifest_describes_the_graphs_as_onnxruntime_sees_them(onnx_dir, backend, base, head, tokenizer):
    m = json.loads((onnx_dir / MANIFEST).read_text())
    for name, f in m["files"].items():
        assert (onnx_dir / name).stat().st_size == f["bytes"] and len(f["sha256"]) == 64
    dtypes = {"tensor(int64)": "int64", "tensor(float)": "float32"}
    for graph, session in (("base", backend.base), ("head", backend.session("head")), ("head_k2", backend.session("head_k2")),
                           ("step", backend.step)):
        spec = m["graphs"][graph]
        for want, got in ((spec["inputs"], session.get_inputs()), (spec["outputs"], session.get_outputs())):
            assert [(s["name"], s["dtype"], len(s["shape"])) for s in want] == \
                   [(g.name, dtypes[g.type], len(g.shape)) for g in got], f"{graph} graph I/O differs from the manifest"
    where = {o["name"]: o["location"] for g in m["graphs"].values() for o in g["outputs"]}
    assert where["choices"] == where["drafts"] == where["accepted"] == "cpu", "only token ids (and margins) are read back"
    assert where["hidden"] == "gpu" and all(where[n] == "gpu" for n in m["kv"]["present_outputs"])
    assert m["head"]["k"] == head.config.k_train and m["head"]["kv_layer"] == head.config.kv_layer
    assert m["context_length"] == base.config.max_position_embeddings and m["eos_token_id"] == base.config.eos_token_id
    ids = tokenizer.token_to_id
    assert m["special_tokens"] == {t: ids(t) for t in SPECIAL_TOKENS if ids(t) is not None}
    assert m["tasks"] == {t: {"prefix": [ids(marker)], "suffix": [ids(sep)] if sep else []}
                          for t, (marker, sep) in TASKS.items() if ids(marker) is not None}
    assert m["kv"]["sequence_axis"] == 1 and "prefix" in m["kv"]["rollback"]


@pytest.mark.parametrize("length", [1, 2, 7, 100])
def test_dynamic_axes_are_dynamic(backend, base, length):
    """A prefill of any length (past S = 0), then a verify of 3 tokens on top: the torch results."""
    ids = torch.randint(0, base.config.vocab_size, (length + 3,), generator=torch.Generator().manual_seed(length)).tolist()
    state = backend.prefill(ids[:length])
    with torch.no_grad():
        _, hidden, cache = base(torch.tensor([ids[:length]]))
        logits, hidden2, _ = base(torch.tensor([ids[length:]]), cache)
    assert state.hidden.shape == (1, length, base.config.hidden_size)
    assert all(t.shape[1] == length for t in state.cache.values())
    np.testing.assert_allclose(state.hidden, hidden.numpy(), atol=1e-4, err_msg=f"prefill of {length}")
    choices, margins, state = backend.verify(state, ids[length:])
    assert choices == logits[0].argmax(-1).tolist(), f"verify after a prefill of {length}"
    np.testing.assert_allclose(state.hidden, hidden2.numpy(), atol=1e-4)
    assert all(t.shape[1] == length + 3 for t in state.cache.values())


@pytest.mark.parametrize("length", [1, 7, 100])
def test_head_graph_drafts_what_the_torch_head_drafts(backend, base, head, length):
    ids = torch.randint(0, base.config.vocab_size, (length + 4,), generator=torch.Generator().manual_seed(length)).tolist()
    state = backend.prefill(ids[:length])
    _, _, state = backend.verify(state, ids[length:])
    state = backend.rollback(state, 2)  # the anchor is now the 2nd verified token, inside a longer buffer
    state.ahead = None  # draft with the head graph, not with drafts the step graph may have made
    with torch.no_grad():
        _, hidden, cache = base(torch.tensor([ids[: length + 2]]))
    token = ids[length + 2]
    assert backend.draft(state, token, 6) == head.draft(base, hidden[0, -1], token, cache, 6)
    assert backend.draft(state, token, 2) == head.draft(base, hidden[0, -1], token, cache, 2)


def test_step_graph_drafts_from_the_anchor_the_acceptance_rule_picks(backend, base, head):
    """One fused run: verify [token, d1, d2, wrong], accept 2, and draft from there as the torch head does."""
    ids = torch.randint(0, base.config.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    state = backend.prefill(ids)
    a = backend.verify(state, [7])[0][0]              # the base's own continuation of ids + [7]: a, b, c
    b = backend.verify(state, [7, a])[0][1]
    c = backend.verify(state, [7, a, b])[0][2]
    fed = [7, a, b, (c + 1) % base.config.vocab_size]  # two right drafts, then a wrong one
    out, _, after = backend.verify(state, fed)
    assert out[:3] == [a, b, c] and after.ahead is not None and after.ahead[:2] == (2, c)
    after = backend.rollback(after, 3)
    with torch.no_grad():
        _, hidden, cache = base(torch.tensor([ids + fed[:3]]))
    runs = backend.runs
    assert backend.draft(after, c, 6) == head.draft(base, hidden[0, -1], c, cache, 6)
    assert backend.runs == runs, "the step graph's drafts are used, no head run"


class OracleDrafts:
    """The ONNX backend with drafts that are the reference continuation, each wrong with probability
    p_wrong: drives acceptance and rollback of the ONNX cache whatever the head has learnt."""

    def __init__(self, backend, seq, p_wrong, seed):
        self.backend, self.seq, self.p_wrong, self.rng = backend, seq, p_wrong, random.Random(seed)
        self.context, self.prefill, self.verify, self.rollback = (backend.context, backend.prefill,
                                                                  backend.verify, backend.rollback)

    def draft(self, state, token, k):
        pos = next(iter(state.cache.values())).shape[1] + 1
        right = [self.seq[p] if p < len(self.seq) else 0 for p in range(pos, pos + k)]
        return [(t + 1) % 7 if self.rng.random() < self.p_wrong else t for t in right]


@pytest.mark.parametrize("p_wrong", [0.0, 0.3])
def test_accepting_and_rolling_back_the_onnx_cache_gives_the_reference(backend, base, tokenizer, p_wrong):
    eos = base.config.eos_token_id
    ids = encode_prompt(tokenizer, "continue", "The json module provides")
    ref = decode_ar(base, ids, 40, eos)
    for k in (1, 3, 6):
        out = decode(OracleDrafts(backend, ids + ref.ids, p_wrong, k), ids, 40, eos, k)
        verdict, where = compare_to_reference(ref, out.ids)
        assert verdict == "equal", f"k={k} p_wrong={p_wrong}: {verdict} at token {where}"
        if p_wrong == 0.0:
            assert out.steps == -(-len(ref.ids) // (k + 1)) or eos in ref.ids


def test_onnx_backend_equals_the_torch_reference(backend, base, tokenizer, validation_prompts):
    """60 validation prompts of both tasks, modes ar and mtp with k = 1..6: CONTRACT.md's exactness rule."""
    eos = base.config.eos_token_id
    near_ties, checked = [], 0
    for p in validation_prompts:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = decode_ar(base, ids, 32, eos)
        for k in range(0, 7):
            backend.runs = 0
            out = decode(backend, ids, 32, eos, k)
            verdict, where = compare_to_reference(ref, out.ids)
            assert verdict != "mismatch", f"{p['task']} {p['prompt']!r} k={k}: first mismatch at token {where}"
            if verdict == "near-tie":
                near_ties.append((p["prompt"], k, where))
            elif k == 0:
                np.testing.assert_allclose(out.margins, ref.margins, atol=1e-3)
            checked += 1
            if k:
                assert backend.runs - 1 <= out.steps + 1, f"k={k}: {backend.runs} runs for {out.steps} steps: " \
                                                           "more than one per step (and one head run to start)"
    print(f"\nonnx exactness: {checked} decodes, {len(near_ties)} excused near-ties {near_ties}")
    assert len(near_ties) <= checked // 20, f"too many near-tie divergences: {near_ties}"


def test_unfused_backend_equals_the_reference_with_two_runs_per_step(onnx_dir, base, tokenizer, validation_prompts):
    """fused=False: the head graph drafts, the base graph verifies (what a page without step.onnx runs)."""
    backend = OnnxBackend(onnx_dir, with_head=True, fused=False)
    eos = base.config.eos_token_id
    for p in validation_prompts[:4] + validation_prompts[30:34]:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = decode_ar(base, ids, 24, eos)
        for k in (1, 4, 6):
            backend.runs = 0
            out = decode(backend, ids, 24, eos, k)
            verdict, where = compare_to_reference(ref, out.ids)
            assert verdict != "mismatch", f"{p['task']} {p['prompt']!r} k={k}: first mismatch at token {where}"
            assert backend.runs - 1 <= 2 * out.steps


def test_cli_onnx_backend_gives_the_torch_ids(onnx_dir):
    prompt = ["--prompt", "Teh list is sortd in place.", "--task", "proofread", "--json", "--max-new-tokens", "16"]
    t = run("generate", *prompt)
    o = run("generate", *prompt, "--backend", "onnx", "--onnx-dir", str(onnx_dir), "--mode", "mtp", "--k", "3")
    assert t.returncode == 0 and o.returncode == 0, t.stderr + o.stderr
    torch_out, onnx_out = json.loads(t.stdout), json.loads(o.stdout)
    assert onnx_out["ids"] == torch_out["ids"] and onnx_out["backend"] == "onnx"
    assert o.stderr == "", "a valid export is used as it is, not exported again"


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_tampered_onnx_file_is_refused_naming_the_file(onnx_dir, tmp_path, damage):
    d = tmp_path / "onnx"
    shutil.copytree(onnx_dir, d)
    victim = d / ("head.onnx" if damage == "flip" else "base.onnx")
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(data)
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()
    want = "missing" if damage == "remove" else "sha256 mismatch"
    with pytest.raises(CheckpointError, match=want) as e:
        OnnxBackend(d, with_head=True)
    assert victim.name in str(e.value)
    expect_error(run("generate", "--prompt", "Lists are", "--backend", "onnx", "--onnx-dir", str(d), "--mode", "mtp"),
                 victim.name, want)
