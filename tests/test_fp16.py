"""The fp16 variant: exported beside fp32, chosen by the page where WebGPU has shader-f16, and exact within
its precision (MTP fp16 == plain fp16, in onnxruntime and in the page)."""
from __future__ import annotations

import json

from builder.decode.loop import compare_to_reference, decode
from builder.decode.onnx_backend import OnnxBackend
from builder.data.tasks import encode_prompt
from tests.conftest import INHOUSE, Page, check_steps, expect_error, run


def test_fp16_graphs_compute_in_fp16_on_weights_of_half_the_bytes(onnx_dir):
    """The fp16 graphs take and give float16, but the head's confidences (float32: the decode loop reads them
    as numbers, and a page's float16 arrays are no numbers). The shipped checkpoints are saved in fp16, so the fp32 graphs
    read the very same float16 weights files (test_onnx: every weight stored once)."""
    m = json.loads((onnx_dir / "manifest.json").read_text())
    fp32, fp16 = m["precisions"]["fp32"], m["precisions"]["fp16"]
    assert fp16["dtype"] == "float16" and set(fp16["graphs"]) == set(fp32["graphs"])
    for name, graph in fp16["graphs"].items():
        assert graph["file"] == f"{name}.fp16.onnx" and all(w.endswith(".fp16.data") for w in graph["weights"])
        assert graph["weights"] == fp32["graphs"][name]["weights"], f"{name}: the precisions read different weights"
        floats = {io["name"]: io["dtype"] for io in graph["inputs"] + graph["outputs"] if "int" not in io["dtype"]}
        assert floats.pop("confidence", "float32") == "float32", f"{name}: the head's confidence is float32"
        assert floats and set(floats.values()) == {"float16"}, f"{name}: {floats}"


def test_a_checkpoint_saved_in_fp32_keeps_fp32_weights_beside_fp16_ones_of_half_the_bytes(tiny_onnx):
    """A base saved in fp32 (most of its values no float16) is stored as it is for the fp32 graphs."""
    from builder.export.manifest import read_manifest

    m = read_manifest(tiny_onnx)
    assert m["precisions"]["fp32"]["graphs"]["base"]["weights"] == ["base.data"]
    for model in ("base", "head", "drafter"):
        ratio = m["files"][f"{model}.fp16.data"]["bytes"] / m["files"][f"{model}.data"]["bytes"]
        assert 0.45 < ratio < 0.55, f"{model}: fp16 weights are {ratio:.2f} of fp32"


def test_build_ships_only_the_precision_asked_for(onnx_dir, tmp_path):
    from builder.site.build import build
    from tests.conftest import SHIPPED

    manifest = build(SHIPPED, tmp_path / "site", onnx_dir, ("fp32",))
    models = tmp_path / "site" / "models"
    assert set(manifest["precisions"]) == {"fp32"}
    assert not list(models.glob("*.fp16.onnx")), "an fp32 site ships no fp16 graph"
    assert sorted(f.name for f in models.iterdir()) == sorted([*manifest["files"], "manifest.json"])


def test_fp16_mtp_equals_fp16_plain_in_onnxruntime(onnx_dir, tokenizer, validation_prompts):
    plain = OnnxBackend(onnx_dir, precision="fp16")
    mtp = OnnxBackend(onnx_dir, "head", 4, precision="fp16")
    eos = plain.manifest["eos_token_id"]
    verdicts = []
    for p in validation_prompts[:4] + validation_prompts[30:34]:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = decode(plain, ids, 32, eos)
        out = decode(mtp, ids, 32, eos, k=4)
        verdicts.append(compare_to_reference(ref, out.ids)[0])
        check_steps(out.accepted, len(out.ids), out.stopped)
        assert len(out.ids) > out.steps, "MTP accepted no drafts in fp16"
    assert "mismatch" not in verdicts and verdicts.count("equal") >= len(verdicts) - 1, verdicts


def test_cli_fp16_needs_the_onnx_backend():
    expect_error(run("generate", *INHOUSE, "--prompt", "Lists are", "--precision", "fp16"), "--backend onnx")


def test_page_picks_fp16_only_with_shader_f16(browser, tiny_url):
    url = tiny_url  # what the page picks, not what the model writes: the tiny random model loads in seconds
    page = Page(browser, url, "index.html?backend=webgpu")
    try:
        # the rule itself, on both kinds of adapter (SwiftShader has only one of them)
        pick = "([req, backend, f16]) => import('./runtime.mjs').then((m) => m.choosePrecision(req, backend, f16))"
        # (q4: the 4-bit graph first where the site has it, a GGUF base's: tests/test_gguf.py; not this one's)
        assert page.page.evaluate(pick, [None, "webgpu", True]) == {"precision": "fp16", "precisionNote": "fp16: the adapter has shader-f16", "q4": True}
        assert page.page.evaluate(pick, [None, "webgpu", False]) == {"precision": "fp32", "precisionNote": "fp32: the adapter lacks shader-f16", "q4": True}
        assert page.page.evaluate(pick, [None, "wasm", True]) == {"precision": "fp32", "precisionNote": "fp32 on WASM"}
        assert page.page.evaluate(pick, ["fp32", "webgpu", True]) == {"precision": "fp32", "precisionNote": "fp32, as requested"}
        # and the page on this adapter follows it, and loads the graphs of the precision it picked
        has_f16 = page.page.evaluate("async () => (await navigator.gpu.requestAdapter()).features.has('shader-f16')")
        info = page.info
        want = page.page.evaluate(pick, [None, "webgpu", has_f16])
        assert {k: info[k] for k in ("precision", "precisionNote")} == {k: want[k] for k in ("precision", "precisionNote")}, info
        assert info["precision"] in page.page.inner_text("#status")
        wanted = ".fp16.onnx" if has_f16 else "models/base.onnx"
        assert any(r.endswith(wanted) for r in page.requests), page.requests
    finally:
        page.close()
    if not has_f16:  # asking for fp16 on such an adapter is a clear error, not a broken page
        assert "lacks the shader-f16 feature" in load_error(browser, url, "backend=webgpu&precision=fp16")


def load_error(browser, url, query) -> str:
    """The message a page shows when its models cannot load (not Page: it waits for them to load)."""
    ctx = browser.new_context()
    try:
        tab = ctx.new_page()
        tab.goto(url + f"index.html?{query}")
        tab.wait_for_selector("#message:not([hidden])")
        assert tab.is_disabled("#generate")
        return tab.inner_text("#message")
    finally:
        ctx.close()


def test_page_fp16_mtp_equals_page_fp16_plain(browser, url, validation_prompts):
    """The fp16 graphs in the page (on WASM, where only ?precision=fp16 selects them): the fp16 files are the
    ones fetched and MTP's ids equal plain decoding's, in the same page."""
    page = Page(browser, url, "index.html?backend=wasm&precision=fp16")
    try:
        assert page.info["precision"] == "fp16" and page.info["precisionNote"] == "fp16, as requested"
        for p in (validation_prompts[0], validation_prompts[30]):
            plain = page.generate(prompt=p["prompt"], task=p["task"], mode="ar", maxNewTokens=24)
            mtp = page.generate(prompt=p["prompt"], task=p["task"], mode="mtp", k=4, maxNewTokens=24)
            assert plain["precision"] == mtp["precision"] == "fp16"
            assert mtp["ids"] == plain["ids"] and mtp["steps"] < plain["steps"], (p, plain["ids"], mtp["ids"])
        models = [r.rsplit("/", 1)[1] for r in page.requests if r.endswith((".onnx", ".data"))]
        assert models and all(m.endswith((".fp16.onnx", ".fp16.data")) for m in models), models
        assert page.errors == [], page.errors
    finally:
        page.close()


def test_page_rejects_an_unknown_precision(browser, tiny_url):
    url = tiny_url
    assert 'unknown precision "fp8"' in load_error(browser, url, "backend=wasm&precision=fp8")
