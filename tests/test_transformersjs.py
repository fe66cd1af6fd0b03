"""The benchmark's transformers.js peer (builder/bench/transformersjs.py): @huggingface/transformers on a
local fp32 ONNX export of SmolLM2 (builder/bench/hf_onnx.py), in the same headless Chromium as the page.
The export is cached under build/hf-onnx/ (the first run exports it: a minute or two)."""
from __future__ import annotations

import pytest

from tests.conftest import ROOT

SMOL = ROOT / "models" / "base"


def test_transformersjs_decodes_the_smollm2_export_greedily_from_token_ids(browser):
    """8 greedy tokens of one short prompt, twice in one page. The export computes the reference's fp32
    values (onnxruntime's kernels round differently, by ~1e-4 in the logits), so all 8 tokens are set
    against torch with the exactness rule: equal, or a first difference only where the reference's margin
    is below NEAR_TIE (this prompt's smallest margin is 0.18, so in practice: equal)."""
    from builder.bench.transformersjs import run_transformersjs
    from builder.data.tasks import encode_prompt, load_tokenizer
    from builder.decode.loop import compare_to_reference
    from builder.decode.torch_backend import decode_ar
    from builder.models.llama import load_config, load_llama

    tok = load_tokenizer(SMOL)
    ids = encode_prompt(tok, "continue", "The quick brown fox")
    reference = decode_ar(load_llama(SMOL).eval(), ids, 8, load_config(SMOL)["eos_token_id"])

    run = run_transformersjs(browser, [ids, ids], 8, threads=1, warmup=False)
    info, (first, second) = run["transformersjs_info"], run["results"]
    assert info["version"] == info["package_version"] == "4.3.1"
    assert info["threads"] == 1 and info["crossOriginIsolated"] and info["device"] == "wasm"
    assert first["prompt_tokens"] == len(ids)  # transformers.js fed exactly the ids the page was given
    assert len(first["ids"]) == 8 and all(0 <= i < tok.get_vocab_size() for i in first["ids"])
    verdict, at = compare_to_reference(reference, first["ids"])
    assert verdict in ("equal", "near-tie"), f"{verdict} at {at}: {first['ids']} vs {reference.ids}"
    assert first["decode_ms"] > 0 and first["prefill_ms"] > 0 and first["tokens_per_s"] > 0
    assert second["ids"] == first["ids"]  # greedy: the same output every run


@pytest.mark.slow  # over 30 s in CI (2026-12-07)
def test_the_export_keeps_the_logits_transformersjs_asks_for(base, tmp_path):
    """num_logits_to_keep, as optimum's exports have it: 0 keeps every position's logits, n the last n
    (transformers.js feeds 1 when it generates, so a prompt never passes the LM head). Checked on the
    in-house base's export in onnxruntime: each is the matching rows of the whole, which equals torch."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from builder.bench.hf_onnx import export_graph

    onnx.save_model(export_graph(base), tmp_path / "model.onnx", save_as_external_data=True, location="model.onnx_data")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert "num_logits_to_keep" in [i.name for i in session.get_inputs()]
    cfg, T = base.config, 7
    ids = np.arange(5, 5 + T)[None]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, T), np.int64), "position_ids": np.arange(T)[None],
             **{i.name: np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
                for i in session.get_inputs() if i.name.startswith("past_key_values")}}
    logits = {n: session.run(["logits"], {**feeds, "num_logits_to_keep": np.array(n)})[0] for n in (0, 1, 3)}
    with torch.no_grad():
        want = base(torch.tensor(ids))[0].numpy()
    assert logits[0].shape == (1, T, cfg.vocab_size)
    np.testing.assert_allclose(logits[0], want, atol=1e-4)
    for n in (1, 3):
        assert logits[n].shape == (1, n, cfg.vocab_size)
        np.testing.assert_allclose(logits[n], logits[0][:, -n:], atol=1e-5)


@pytest.mark.slow  # over 30 s in CI (2026-12-07)
def test_the_8_and_4_bit_graphs_are_onnxruntimes_quantizations_of_the_export(base, tmp_path):
    """hf_onnx.quantized on the in-house base's export: q8 holds every MatMul's weights in int8 (MatMulInteger),
    q4 in 4-bit blocks (MatMulNBits); each file is a fraction of the fp32 weights, runs in onnxruntime, and
    keeps the model: its logits follow the fp32 ones (quantized: close, not equal)."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from builder.bench.hf_onnx import QUANTIZED, export_graph, quantized

    fp32 = tmp_path / "model.onnx"
    onnx.save_model(export_graph(base), fp32, save_as_external_data=True, location="model.onnx_data")
    cfg, T = base.config, 9
    feeds = {"input_ids": np.arange(5, 5 + T)[None], "attention_mask": np.ones((1, T), np.int64),
             "position_ids": np.arange(T)[None], "num_logits_to_keep": np.array(0),
             **{f"past_key_values.{i}.{kv}": np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
                for i in range(cfg.num_hidden_layers) for kv in ("key", "value")}}
    run = lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]  # noqa: E731
    want = run(fp32)
    weights = (tmp_path / "model.onnx_data").stat().st_size
    for dtype, op, share in (("q8", "MatMulInteger", 0.45), ("q4", "MatMulNBits", 0.35)):
        out = tmp_path / QUANTIZED[dtype]
        quantized(fp32, dtype, out)
        ops = {n.op_type for n in onnx.load(str(out)).graph.node}
        assert op in ops, (dtype, sorted(ops))
        assert out.stat().st_size < share * weights, (dtype, out.stat().st_size, weights)
        got = run(out)
        assert got.shape == want.shape and not np.array_equal(got, want)
        agree = (got.argmax(-1) == want.argmax(-1)).mean()
        assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95 and agree >= 0.5, (dtype, agree)


def test_transformersjs_loads_the_8_and_4_bit_weights_its_users_load(browser):
    """The q8 and q4 peers: transformers.js loads each dtype's file of the SmolLM2 export and decodes 8 greedy
    tokens from the given ids (their tokens are the quantized model's: not set against torch)."""
    from builder.bench.transformersjs import run_transformersjs
    from builder.data.tasks import encode_prompt, load_tokenizer

    tok = load_tokenizer(SMOL)
    ids = encode_prompt(tok, "continue", "The quick brown fox")
    for dtype in ("q8", "q4"):
        run = run_transformersjs(browser, [ids], 8, threads=1, warmup=False, dtype=dtype)
        info, (first,) = run["transformersjs_info"], run["results"]
        assert info["dtype"] == dtype and info["device"] == "wasm", info
        assert first["prompt_tokens"] == len(ids) and len(first["ids"]) == 8, first
        assert all(0 <= i < tok.get_vocab_size() for i in first["ids"]) and first["tokens_per_s"] > 0
