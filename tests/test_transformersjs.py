"""The benchmark's transformers.js peer (builder/bench/transformersjs.py): @huggingface/transformers on a
local fp32 ONNX export of SmolLM2 (builder/bench/hf_onnx.py), in the same headless Chromium as the page.
The export is cached under build/hf-onnx/ (the first run exports it: a minute or two)."""
from __future__ import annotations

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
