"""The ONNX export: valid graphs, truly dynamic axes, a manifest that describes them, files checked by
sha256, and - through the one decode loop - the same tokens as the torch reference."""
from __future__ import annotations

import json
import random
import shutil
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from builder.contract import DEFAULT_LOOKUP, DEFAULT_MODE, DRAFT_CUT, LOOKUP_SPAN, MANIFEST
from builder.decode.loop import compare_to_reference, decode
from builder.decode.torch_backend import decode_ar
from builder.errors import CheckpointError
from builder.models.head import load_head
from builder.decode.onnx_backend import OnnxBackend
from builder.data.tasks import SPECIAL_TOKENS, TASKS, encode_prompt
from tests.conftest import INHOUSE, HEAD_DIR, expect_error, run


@pytest.fixture(scope="module")
def backend(onnx_dir):
    """Plain decoding over the base graph."""
    return OnnxBackend(onnx_dir)


@pytest.fixture(scope="module")
def heads(onnx_dir):
    """k -> the backend that drafts with the head graph of k drafts, as the page runs mode mtp with that k."""
    return {k: OnnxBackend(onnx_dir, "head", k) for k in range(1, 7)}


@pytest.fixture(scope="module")
def head(base):
    return load_head(HEAD_DIR, base)


def test_every_graph_passes_the_onnx_checker(onnx_dir):
    m = json.loads((onnx_dir / MANIFEST).read_text())
    files = [g["file"] for p in m["precisions"].values() for g in p["graphs"].values()]
    assert len(files) == 2 * (1 + 6 + 1), f"base, six head graphs and the drafter in fp32 and fp16: {files}"
    for name in files:
        onnx.checker.check_model(str(onnx_dir / name), full_check=True)  # reads the external weights too
        assert onnx.load(str(onnx_dir / name), load_external_data=False).opset_import[0].version == 18


def test_manifest_describes_the_graphs_as_onnxruntime_sees_them(onnx_dir, base, head, tokenizer):
    import onnxruntime as ort

    m = json.loads((onnx_dir / MANIFEST).read_text())
    for name, f in m["files"].items():
        assert (onnx_dir / name).stat().st_size == f["bytes"] and len(f["sha256"]) == 64
    dtypes = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(float16)": "float16"}
    for precision, dtype in (("fp32", "float32"), ("fp16", "float16")):
        spec = m["precisions"][precision]
        assert spec["dtype"] == dtype
        for graph in ("base", "head_k2", "drafter"):
            g = spec["graphs"][graph]
            session = ort.InferenceSession(str(onnx_dir / g["file"]), providers=["CPUExecutionProvider"])
            for want, got in ((g["inputs"], session.get_inputs()), (g["outputs"], session.get_outputs())):
                assert [(s["name"], s["dtype"], len(s["shape"])) for s in want] == \
                       [(x.name, dtypes[x.type], len(x.shape)) for x in got], f"{precision} {graph}: I/O differs from the manifest"
            past = [i for i in g["inputs"] if i["name"].startswith("past_")]
            assert past and all(i["dtype"] == dtype for i in past), f"{precision} {graph}: the KV cache is {dtype}"
    where = {o["name"]: o["location"] for g in m["precisions"]["fp32"]["graphs"].values() for o in g["outputs"]}
    assert where["choices"] == where["drafts"] == "cpu", "only token ids (and margins) are read back"
    assert where["confidence"] == "gpu", "the head's confidences are read back only where the decode cuts by them"
    assert where["hidden"] == "gpu" and all(where[n] == "gpu" for n in m["kv"]["present_outputs"])
    assert m["head"]["k"] == head.config.k_train and m["head"]["kv_layer"] == head.config.kv_layer
    assert m["head"]["by_k"] == {str(k): f"head_k{k}" for k in range(1, 7)}
    assert m["context_length"] == base.config.max_position_embeddings and m["eos_token_id"] == base.config.eos_token_id
    ids = tokenizer.token_to_id
    assert m["special_tokens"] == {t: ids(t) for t in SPECIAL_TOKENS if ids(t) is not None}
    assert m["tasks"] == {t: {"prefix": [ids(marker)], "suffix": [ids(sep)] if sep else []}
                          for t, (marker, sep) in TASKS.items() if ids(marker) is not None}
    assert m["kv"]["sequence_axis"] == 1 and m["defaults"] == {"k": 4, "max_new_tokens": 32, "mode": DEFAULT_MODE, "lookup": DEFAULT_LOOKUP}
    assert m["lookup_span"] == LOOKUP_SPAN, "the page's decode reads Python's span from here"
    assert m["draft_cut"] == DRAFT_CUT and set(DRAFT_CUT) == {"wasm", "webgpu"}, "the page's cut, by execution provider"


def external(path):
    """(file, offset, length) of each weight a graph reads from a weights file."""
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: tuple(x.value for x in t.external_data if x.key in ("location", "offset", "length"))
            for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}


def test_every_weight_is_stored_once(onnx_dir, base, head):
    """The shipped checkpoints are saved in fp16, so one float16 weights file per model serves both
    precisions: the fp32 graphs read it behind Casts to fp32. The head graphs read the embedding / LM head
    from base.fp16.data and share head.fp16.data; every weights file is the size of its model's parameters
    at 2 bytes each (tied embeddings once), give or take the 64-byte alignment."""
    from builder.decode.drafter import load_drafter
    from tests.conftest import DRAFTER_DIR

    m = json.loads((onnx_dir / MANIFEST).read_text())
    params = {"base": base, "head": head, "drafter": load_drafter(DRAFTER_DIR, base)}
    assert sorted(f for f in m["files"] if f.endswith(".data")) == sorted(f"{model}.fp16.data" for model in params)
    for model, module in params.items():
        n = sum(t.numel() for t in module.parameters())  # parameters() yields a tied weight once
        small = sum(t.numel() for t in module.parameters() if t.numel() * 2 <= 1024)  # stay in the graph
        got = (onnx_dir / f"{model}.fp16.data").stat().st_size
        assert (n - small) * 2 <= got < (n - small) * 2 + 64 * 64, \
            f"{model}.fp16.data holds {got} bytes for {n} parameters of 2 bytes: a weight is stored twice"
    for precision, p in m["precisions"].items():
        heads = [external(onnx_dir / p["graphs"][f"head_k{k}"]["file"]) for k in range(1, 7)]
        assert all(h == heads[0] for h in heads), f"{precision}: the six head graphs read different weights"
        lm_head = external(onnx_dir / p["graphs"]["base"]["file"])
        files = {loc for loc, _, _ in heads[0].values()}
        assert files == {"base.fp16.data", "head.fp16.data"}, files
        assert set(heads[0].values()) & set(lm_head.values()), f"{precision}: the head has its own LM head copy"


@pytest.mark.slow  # over 30 s in CI (2026-12-07)
def test_graphs_exported_in_worker_processes_are_the_bytes_one_process_writes(tiny, tiny_onnx, tmp_path, monkeypatch):
    """The session's tiny export ran its graphs in forked workers (graphs.EXPORT_WORKERS, where there are cores);
    exported again in this one process, every graph and weights file of each precision is the same, byte for byte
    (a worker casts the models to fp16 once, for all its fp16 graphs)."""
    import os

    from builder.export import graphs
    from builder.export.manifest import export, read_manifest

    assert (os.cpu_count() or 1) > 1, "one core: the session's export ran in one process too, nothing to compare"
    monkeypatch.setattr(graphs, "EXPORT_WORKERS", 1)
    alone, forked = export(tiny, tmp_path)["files"], read_manifest(tiny_onnx)["files"]
    graphs_ = ("base", "drafter", *(f"head_k{k}" for k in range(1, 7)))
    assert {f for f in alone if f.endswith(".onnx")} == {f"{g}{s}.onnx" for g in graphs_ for s in ("", ".fp16")}
    assert {f: alone[f]["sha256"] for f in alone} == {f: forked[f]["sha256"] for f in alone}


def test_fp32_graphs_of_a_checkpoint_saved_in_fp16_compute_in_fp32_on_its_values(tiny, tiny_onnx, tmp_path):
    """A float16 checkpoint (the tiny base, head and drafter rounded to fp16 and saved): the fp32 graphs
    hold its weights as float16 (half the bytes of the same checkpoint's fp32 export) behind Casts, which
    onnxruntime folds at load, and decode what torch decodes in fp32 on the same values, token for token."""
    import onnxruntime as ort
    from safetensors.torch import save_file

    from builder.export.manifest import Checkpoints, export, read_manifest
    from builder.decode.torch_backend import TorchBackend
    from builder.models.llama import load_llama, load_state

    rounded = {}
    for role, d in tiny.models().items():
        shutil.copytree(d, tmp_path / role)
        state = {k: v.half() for k, v in load_state(d).items()}
        save_file(state, tmp_path / role / "model.safetensors")
        rounded[role] = tmp_path / role
    ckpts = Checkpoints(rounded["base"], rounded["head"], rounded["drafter"])
    half, full = export(ckpts, tmp_path / "half", ("fp32",)), read_manifest(tiny_onnx)  # full: tiny's fp32 weights
    assert set(half["precisions"]["fp32"]["graphs"]["base"]["weights"]) == {"base.fp16.data"}
    for model in ("base", "head", "drafter"):
        ratio = half["files"][f"{model}.fp16.data"]["bytes"] / full["files"][f"{model}.data"]["bytes"]
        assert 0.45 < ratio < 0.55, f"{model}: {ratio:.2f}"
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    ort.InferenceSession(str(tmp_path / "half" / "base.onnx"), so, providers=["CPUExecutionProvider"])
    loaded = onnx.load(tmp_path / "loaded.onnx", load_external_data=False)
    assert not [n for n in loaded.graph.node if n.op_type == "Cast" and n.input[0].endswith(".fp16")], \
        "onnxruntime casts the weights once, at load, not in every run"
    base = load_llama(rounded["base"])
    prompt = [5, 9, 14, 3, 27, 8]
    want = decode(TorchBackend(base), prompt, 24, None)
    for backend in (OnnxBackend(tmp_path / "half"), OnnxBackend(tmp_path / "half", "head", 3)):
        assert decode(backend, prompt, 24, None, k=backend.k if backend.head else 0).ids == want.ids


def test_norms_and_rotary_embeddings_of_the_fp32_graphs_are_fused_operators(onnx_dir, base, head):
    """RMSNorm after a residual sum is onnxruntime's SkipSimplifiedLayerNormalization (8 nodes become 1):
    in the base, both norms of every layer but the first (which reads the embedding) and the final one; in
    each draft of the head, every norm after its first decoder layer's attention (two per layer), and the
    other three, of one row each (the token's embedding, the hidden state, the first layer's input), with a
    skip of zeros: no norm of the head is left unfused. Each rotary
    embedding of q and k is one RotaryEmbedding (7 nodes become 2, with a Reshape). The equality tests run
    the fused graphs."""
    m = json.loads((onnx_dir / MANIFEST).read_text())["precisions"]["fp32"]["graphs"]

    def ops(name):
        graph = onnx.load(str(onnx_dir / m[name]["file"]), load_external_data=False)
        assert "com.microsoft" in {o.domain for o in graph.opset_import}, name
        return Counter(n.op_type for n in graph.graph.node)

    layers = base.config.num_hidden_layers
    assert ops("base")["SkipSimplifiedLayerNormalization"] == 2 * layers
    assert ops("base")["Pow"] == 1, "only the norm of the embedding stays unfused"
    assert ops("base")["RotaryEmbedding"] == 2 * layers and ops("base")["Neg"] == 0
    per_draft = 2 * head.config.num_layers
    for k in (1, 6):
        assert ops(f"head_k{k}")["SkipSimplifiedLayerNormalization"] == (per_draft + 3) * k
        assert ops(f"head_k{k}")["Pow"] == 0
        assert ops(f"head_k{k}")["RotaryEmbedding"] == per_draft * k and ops(f"head_k{k}")["Neg"] == 0


@pytest.mark.parametrize("length", [1, 2, 7, 100])
def test_dynamic_axes_are_dynamic(backend, base, length):
    """A prefill of any length (past S = 0), then a verify of 3 tokens on top: the torch results. The prefill
    decides after its last token only (outputs_at), the verify after each."""
    ids = torch.randint(0, base.config.vocab_size, (length + 3,), generator=torch.Generator().manual_seed(length)).tolist()
    state = backend.prefill(ids[:length])
    with torch.no_grad():
        logits1, hidden, cache = base(torch.tensor([ids[:length]]))
        logits, hidden2, _ = base(torch.tensor([ids[length:]]), cache)
    assert state.hidden.shape == (1, 1, base.config.hidden_size) and len(state.choices) == 1
    assert all(t.shape[1] == length for t in state.cache.values())
    np.testing.assert_allclose(state.hidden, hidden[:, -1:].numpy(), atol=1e-4, err_msg=f"prefill of {length}")
    assert state.choices == [int(logits1[0, -1].argmax())]
    choices, margins, state = backend.verify(state, ids[length:])
    assert choices == logits[0].argmax(-1).tolist(), f"verify after a prefill of {length}"
    np.testing.assert_allclose(state.hidden, hidden2.numpy(), atol=1e-4)
    assert all(t.shape[1] == length + 3 for t in state.cache.values())


@pytest.mark.parametrize("length", [1, 7, 100])
def test_head_graph_drafts_what_the_torch_head_drafts(heads, base, head, length):
    ids = torch.randint(0, base.config.vocab_size, (length + 4,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        _, hidden, cache = base(torch.tensor([ids[: length + 2]]))
    token = ids[length + 2]
    for k, backend in heads.items():
        state = backend.prefill(ids[:length])
        _, _, state = backend.verify(state, ids[length:])
        state = backend.rollback(state, 2)  # the anchor is now the 2nd verified token, inside a longer buffer
        for n in (k, 1):  # near the end of a generation fewer drafts are allowed: the first ones of the same graph
            (got, sure), (want, want_sure) = backend.draft(state, token, n), head.draft(base, hidden[0, -1], token, cache, n)
            assert got == want and len(sure) == n, f"head_k{k}, {n} drafts"
            assert np.allclose(sure, want_sure, atol=1e-5) and all(0 < s <= 1 for s in sure), f"head_k{k}: {sure} {want_sure}"


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
        return [(t + 1) % 7 if self.rng.random() < self.p_wrong else t for t in right], None


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


@pytest.mark.slow  # over 30 s in CI (2026-12-07)
def test_onnx_backend_equals_the_torch_reference(backend, heads, base, tokenizer, validation_prompts, reference):
    """60 validation prompts of both tasks, plain and mtp with k = 1..6, on the path the page runs (the
    head graph of k drafts, then the base verifying k + 1): docs/contract.md's exactness rule."""
    eos = base.config.eos_token_id
    near_ties, checked = [], 0
    for p in validation_prompts:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = reference.decoded(ids, 32)
        for k in range(0, 7):
            b = heads[k] if k else backend
            runs = b.runs
            out = decode(b, ids, 32, eos, k)
            verdict, where = compare_to_reference(ref, out.ids)
            assert verdict != "mismatch", f"{p['task']} {p['prompt']!r} k={k}: first mismatch at token {where}"
            if verdict == "near-tie":
                near_ties.append((p["prompt"], k, where))
            elif k == 0:
                np.testing.assert_allclose(out.margins, ref.margins, atol=1e-3)
            checked += 1
            head_runs = b.runs - runs - 1 - out.steps  # after the prefill and one verify per step
            assert (out.steps - 1 <= head_runs <= out.steps) if k else head_runs == 0, \
                f"k={k}: {head_runs} head runs for {out.steps} steps: one a step (none where no draft is allowed)"
    print(f"\nonnx exactness: {checked} decodes, {len(near_ties)} excused near-ties {near_ties}")
    assert len(near_ties) <= checked // 20, f"too many near-tie divergences: {near_ties}"


def test_cli_onnx_backend_gives_the_torch_ids(onnx_dir):
    prompt = ["--prompt", "Teh list is sortd in place.", "--task", "proofread", "--json", "--max-new-tokens", "16"]
    t = run("generate", *INHOUSE, *prompt, "--mode", "ar")
    o = run("generate", *INHOUSE, *prompt, "--backend", "onnx", "--onnx-dir", str(onnx_dir), "--mode", "mtp", "--k", "3")
    assert t.returncode == 0 and o.returncode == 0, t.stderr + o.stderr
    torch_out, onnx_out = json.loads(t.stdout), json.loads(o.stdout)
    assert onnx_out["ids"] == torch_out["ids"] and onnx_out["backend"] == "onnx"
    assert o.stderr == "", "a valid export is used as it is, not exported again"


@pytest.mark.parametrize("victim,damage", [("head.fp16.data", "flip"), ("base.onnx", "truncate"), ("base.fp16.data", "remove")])
def test_tampered_onnx_file_is_refused_naming_the_file(onnx_dir, tmp_path, victim, damage):
    d = tmp_path / "onnx"
    shutil.copytree(onnx_dir, d)
    victim = d / victim
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
        OnnxBackend(d, "head", 4)
    assert victim.name in str(e.value)
    expect_error(run("generate", *INHOUSE, "--prompt", "Lists are", "--backend", "onnx", "--onnx-dir", str(d), "--mode", "mtp"),
                 victim.name, want)
