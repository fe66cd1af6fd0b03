"""The static site in headless Chromium (Debian's, driven by Playwright), built and served by the fixtures.

- the page's ids equal the Python torch reference (docs/contract.md's exactness rule) on WebGPU and WASM,
  plain, MTP and the independent drafter, for validation prompts of both tasks;
- the page's tokenizer gives Python's ids for tricky text;
- each weights file is fetched once per page and shared by the graphs that read it; an altered graph or
  weights file is named;
- zero-copy on WebGPU is measured (on the tiny random model): every GPU read-back in the decode loop is hooked (GPUBuffer.mapAsync)
  and is one token-id output per run, and the head's inputs are the very GPU buffers the base produced;
- the demo works on a phone-sized screen (screenshot saved to build/screenshots/).

A missing browser fails these tests: it is never a skip.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from collections import Counter

import pytest

from builder.site.browser import served
from builder.contract import DRAFT_CUT, LOOKUP_SPAN
from builder.decode.loop import compare_to_reference, decode
from builder.decode.torch_backend import decode_ar
from builder.decode.onnx_backend import OnnxBackend
from builder.site.build import SITE_MARKER, VENDOR
from builder.data.tasks import encode_prompt, encode_text
from tests.conftest import ROOT, Page

# SwiftShader WebGPU emulates a GPU on the CPU: a pass of the shipped 24-layer base takes about a second
# there, so WebGPU checks the shipped model on fewer prompts and tokens, and the mechanics that need no
# trained model (zero-copy, fallbacks, altered files) run on the tiny random model (conftest's `tiny`)
PROMPTS_PER_TASK = {"wasm": 8, "webgpu": 2}
NEW_TOKENS = {"wasm": 32, "webgpu": 8}
PLAIN_PROMPTS_PER_TASK = {"wasm": 8, "webgpu": 1}  # plain decoding, one base pass a token, the slowest mode
K = 4
SCREENSHOTS = ROOT / "build" / "screenshots"

# Installed before any page script: records every GPU buffer mapped for reading (the only way data
# leaves a WebGPU device) and lets a test read the log.
GPU_READ_HOOK = """
window.__gpuReads = [];
if (globalThis.GPUBuffer) {
  const mapAsync = GPUBuffer.prototype.mapAsync;
  GPUBuffer.prototype.mapAsync = function (mode, offset, size) {
    if (mode & GPUMapMode.READ) window.__gpuReads.push({ bytes: size ?? this.size - (offset || 0) });
    return mapAsync.apply(this, arguments);
  };
}
"""


@pytest.fixture(scope="module", params=["wasm", "webgpu"])
def page(request, browser, url):
    p = Page(browser, url, f"?backend={request.param}", init_script=GPU_READ_HOOK)
    assert p.info["backend"] == request.param, p.info
    yield p
    assert p.errors == [], f"the page logged errors: {p.errors}"
    assert p.foreign_requests() == [], "the page asked for something outside its own site"
    p.close()


@pytest.fixture(scope="module")
def prompts(validation_prompts):
    by_task = {}
    for p in validation_prompts:
        by_task.setdefault(p["task"], []).append(p)
    return [p for task in sorted(by_task) for p in by_task[task][:max(PROMPTS_PER_TASK.values())]]


def test_build_copies_only_what_the_page_needs(site):
    manifest = json.loads((site / "models" / "manifest.json").read_text())
    heads = list(manifest["head"]["by_k"].values())
    assert heads == [f"head_k{k}" for k in range(1, manifest["head"]["k"] + 1)]
    for precision, spec in manifest["precisions"].items():
        assert set(spec["graphs"]) == {"base", "drafter", *heads}, f"{precision}: not the graphs the page runs"
    files = {str(f.relative_to(site)) for f in site.rglob("*") if f.is_file()}
    modules = ["app.mjs", "runtime.mjs", "files.mjs", "sessions.mjs", "tasks.mjs", "generate.mjs", "onnx_backend.mjs", "drafter.mjs", "errors.mjs", "blocks.mjs",
               "ai.mjs", "ai-worker.mjs", "corrections.mjs", "api-demo.mjs"]  # the task APIs (docs/api.md) and api.html's
    expected = {"index.html", "api.html", *modules, "coi-sw.js", "style.css", "models/manifest.json", SITE_MARKER,
                *(f"models/{f}" for f, m in manifest["files"].items() if "packed" not in m), *VENDOR.values()}
    assert files == expected
    for page in ("index.html", "api.html"):
        html = (site / page).read_text()
        assert "http://" not in html and "https://" not in html and 'src="/' not in html, f"{page}: paths must be relative"


def test_every_task_has_example_texts_on_the_page(site):
    """Every task some model offers has example texts (web/examples.json), and the built page lists those of each
    task its model offers, each list holding its task's texts."""
    from builder.data.tasks import ALL_TASKS

    examples = json.loads((ROOT / "web" / "examples.json").read_text())["examples"]
    assert {t for t in ALL_TASKS if not any(text.strip() for text in examples.get(t, []))} == set(), "tasks without examples"
    html = (site / "index.html").read_text()
    for task in json.loads((site / "models" / "manifest.json").read_text())["tasks"]:
        listed = re.search(rf'<div class="example-list" data-task="{task}"[^>]*>(.*?)</div>', html, re.S)
        assert listed and listed.group(1).count('class="example"') == len(examples[task]), task


def test_each_weights_file_is_fetched_once_and_shared_by_the_graphs_that_read_it(browser, url, site):
    """MTP at two k (two head graphs reading the base's weights), the drafter and plain decoding in one page:
    every file is fetched once, and only the files of the graphs that ran."""
    manifest = json.loads((site / "models" / "manifest.json").read_text())
    graphs = manifest["precisions"]["fp32"]["graphs"]
    p = Page(browser, url, "?backend=wasm")
    try:
        at_ready = [r.rsplit("/", 1)[1] for r in p.requests if "/models/" in r]
        for mode, k in [("mtp", K), ("mtp", 2), ("drafter", K), ("ar", 1)]:
            p.generate(prompt="The list", mode=mode, k=k, maxNewTokens=8)
        fetched = Counter(r.rsplit("/", 1)[1] for r in p.requests if "/models/" in r)
    finally:
        p.close()
    ran = ["base", f"head_k{K}", "head_k2", "drafter"]
    assert set(graphs["base"]["weights"]) <= set(graphs[f"head_k{K}"]["weights"]) & set(graphs["head_k2"]["weights"]), \
        "the head graphs do not read the base's weights file"
    needed = {f for g in ran for f in [graphs[g]["file"], *graphs[g]["weights"]]} | {"manifest.json", manifest["tokenizer"]}
    assert set(fetched) == needed, f"fetched {sorted(fetched)}, the graphs that ran need {sorted(needed)}"
    assert all(n == 1 for n in fetched.values()), f"a file was fetched more than once: {fetched}"
    first = sum(manifest["files"][f]["bytes"] for f in at_ready if f in manifest["files"])
    print(f"\nwasm fp32: {first / 1e6:.1f} MB of models fetched before the first MTP generation ({sorted(at_ready)})")


def test_serve_gives_the_mime_types_the_page_needs(url):
    for path, mime in [("", "text/html"), ("app.mjs", "text/javascript"), ("models/manifest.json", "application/json"),
                       ("vendor/ort/ort-wasm-simd-threaded.asyncify.wasm", "application/wasm"),
                       ("vendor/ort/ort-wasm-simd-threaded.wasm", "application/wasm")]:
        with urllib.request.urlopen(url + path) as r:
            assert r.headers["Content-Type"].split(";")[0] == mime, path


def test_serve_lists_no_folder_sends_nosniff_and_names_no_server(tmp_path):
    (tmp_path / "models" / "weights").mkdir(parents=True)
    (tmp_path / "index.html").write_text("<!doctype html>")
    (tmp_path / "models" / "manifest.json").write_text("{}")
    with served(tmp_path) as url:
        for folder in ("models/", "models/weights/"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(url + folder)
            assert e.value.code == 404, f"{folder}: {e.value.code}"
            assert "manifest.json" not in e.value.read().decode(), f"{folder} was listed"
        for path in ("", "models/manifest.json"):
            with urllib.request.urlopen(url + path) as r:
                assert r.headers["X-Content-Type-Options"] == "nosniff", path
                assert r.headers["Server"] is None, f"{path}: Server: {r.headers['Server']}"


def test_serve_gzips_the_runtime_and_graphs_not_the_weights(url, site):
    """As static hosts do: a browser that accepts gzip gets the WebAssembly runtime and the graphs
    compressed (the same bytes once decoded), the weights as they are; a revalidation gets 304."""
    import gzip

    manifest = json.loads((site / "models" / "manifest.json").read_text())
    weights = next(f for f in manifest["files"] if f.endswith(".data"))
    for path, encoded in [("vendor/ort/ort-wasm-simd-threaded.asyncify.wasm", True), ("models/base.onnx", True),
                          (f"models/{weights}", False)]:
        request = urllib.request.Request(url + path, headers={"Accept-Encoding": "gzip, deflate, br"})
        with urllib.request.urlopen(request) as r:
            body, encoding = r.read(), r.headers.get("Content-Encoding")
            modified = r.headers["Last-Modified"]
        want = (site / path).read_bytes()
        if encoded:
            assert encoding == "gzip" and len(body) < 0.5 * len(want), f"{path}: {encoding}, {len(body)} of {len(want)} bytes"
            assert gzip.decompress(body) == want, path
        else:
            assert encoding is None and body == want, path
        again = urllib.request.Request(url + path, headers={"Accept-Encoding": "gzip", "If-Modified-Since": modified})
        with pytest.raises(urllib.error.HTTPError, match="304"):
            urllib.request.urlopen(again)
    with urllib.request.urlopen(url + "models/base.onnx") as r:  # no Accept-Encoding: as it is
        assert r.headers.get("Content-Encoding") is None and r.read() == (site / "models" / "base.onnx").read_bytes()


def test_served_page_is_cross_origin_isolated_and_runs_wasm_on_a_thread_per_core(browser, tiny_url, tiny_base, tokenizer):
    """`serve` sends COOP/COEP, so onnxruntime-web may run WASM on several threads (one per core, at most 4);
    ?threads=1 asks for one. Both give the reference's ids."""
    with urllib.request.urlopen(tiny_url) as r:
        assert r.headers["Cross-Origin-Opener-Policy"] == "same-origin"
        assert r.headers["Cross-Origin-Embedder-Policy"] == "require-corp"
    ids = encode_prompt(tokenizer, "continue", "The list")
    ref = decode_ar(tiny_base, ids, 12, tiny_base.config.eos_token_id)
    for query, threads in [("?backend=wasm", min(4, os.cpu_count())), ("?backend=wasm&threads=1", 1)]:
        p = Page(browser, tiny_url, query)
        try:
            assert p.page.evaluate("crossOriginIsolated")
            assert p.info["threads"] == threads, p.info
            assert f"{threads} WASM thread" in p.page.locator("#adapter").inner_text()
            out = p.generate(prompt="The list", mode="mtp", k=3, maxNewTokens=12)
            assert out["ids"] == ref.ids, query
            assert not p.errors, p.errors
        finally:
            p.close()


def test_a_long_prompt_is_read_in_chunks_with_the_references_ids(browser, tiny_url, tiny_base, tokenizer):
    """A prompt of two chunks (PREFILL_CHUNK = 256 tokens, onnx_backend.mjs): the page's prefill runs the base
    on the first 256 tokens, then on the rest after their cache, and every mode gives the reference's ids (the
    drafter reads the prompt in the same chunks). One run over the whole prompt would hold heads x T x T
    attention scores: 2.4 GB for SmolLM2 at T = 8,190."""
    text = " ".join((ROOT / "docs" / "testing.md").read_text().split())
    while len(encode_prompt(tokenizer, "continue", text)) > 480:
        text = text[: int(len(text) * 0.97)]
    ids = encode_prompt(tokenizer, "continue", text)
    assert len(ids) > 300, len(ids)
    ref = decode_ar(tiny_base, ids, 12, tiny_base.config.eos_token_id)
    p = Page(browser, tiny_url, "?backend=wasm")
    try:
        for mode in ("ar", "mtp", "drafter"):
            out = p.generate(prompt=text, mode=mode, k=3, maxNewTokens=12, trace=True)
            assert out["promptIds"] == ids and out["ids"] == ref.ids, mode
            base = [r["inputs"] for r in out["trace"] if r["graph"] == "base"]
            assert [b["input_ids"]["dims"][1] for b in base[:2]] == [256, len(ids) - 1 - 256], mode
            assert [b["past_key_0"]["dims"][1] for b in base[:2]] == [0, 256], mode
            if mode == "drafter":
                drafter = [r["inputs"]["input_ids"]["dims"][1] for r in out["trace"] if r["graph"] == "drafter"]
                assert drafter[:2] == [256, len(ids) - 256], drafter
        assert not p.errors, p.errors
    finally:
        p.close()


def test_on_a_host_without_isolation_headers_a_service_worker_adds_them(browser, tiny_site):
    """A static host that cannot send COOP/COEP (here Python's plain http.server): the page registers
    coi-sw.js, reloads once, and runs isolated, with WASM threads."""
    import http.server
    import threading
    from functools import partial

    class Plain(http.server.SimpleHTTPRequestHandler):
        extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                          ".wasm": "application/wasm"}

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Plain, directory=str(tiny_site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with urllib.request.urlopen(url) as r:
            assert "Cross-Origin-Embedder-Policy" not in r.headers
        context = browser.new_context()
        page = context.new_page()
        try:
            loads = []
            page.on("load", lambda _: loads.append(page.url))
            page.goto(url + "?backend=wasm")
            for _ in range(100):  # the page reloads itself once the service worker controls it
                if len(loads) >= 2:
                    break
                page.wait_for_timeout(100)
            assert len(loads) == 2, f"loads: {loads}"
            assert page.evaluate("crossOriginIsolated"), "the service worker did not isolate the page"
            assert page.evaluate("navigator.serviceWorker.controller.scriptURL").endswith("/coi-sw.js")
            info = page.evaluate("window.frozenMTP.ready")
            assert info["threads"] == min(4, os.cpu_count()), info
            out = page.evaluate("window.frozenMTP.generate({prompt: 'The list', mode: 'mtp', k: 2, maxNewTokens: 6})")
            assert len(out["ids"]) == 6
        finally:
            context.close()
        p = Page(browser, url, "?backend=wasm&isolate=no")  # a fresh context: no service worker yet
        try:
            assert not p.page.evaluate("crossOriginIsolated") and p.info["threads"] == 1
            assert "not cross-origin isolated" in p.page.locator("#adapter").inner_text()
        finally:
            p.close()
    finally:
        server.shutdown()
        server.server_close()


def test_webgpu_dispatches_are_counted_per_run(browser, tiny_url):
    """The GPU regime, counted: every WebGPU run's compute dispatches are in its trace entry, the bench's
    dispatches per step. A base run costs the same dispatches whatever the tokens it verifies, and a head
    run drafting k costs more the larger k (the head's decoder layers and the LM head per draft)."""
    p = Page(browser, tiny_url, "?backend=webgpu")
    try:
        per_graph = {}
        for k in (1, 3):
            out = p.generate(prompt="The list", mode="mtp", k=k, maxNewTokens=8, trace=True)
            for run in out["trace"]:
                n = run["inputs"]["input_ids"]["dims"][1] if run["graph"] == "base" else k
                per_graph.setdefault((run["graph"], n), set()).add(run["dispatches"])
    finally:
        p.close()
    assert all(d > 0 for ds in per_graph.values() for d in ds), per_graph
    verify = [ds for (g, n), ds in per_graph.items() if g == "base"]
    assert len(set.union(*verify)) == 1, f"base runs of different lengths dispatch differently: {per_graph}"
    head1, head3 = per_graph[("head_k1", 1)], per_graph[("head_k3", 3)]
    assert len(head1) == len(head3) == 1 and max(head3) > max(head1), per_graph
    print(f"\nwebgpu dispatches per run: { {f'{g} x{n}': sorted(ds) for (g, n), ds in per_graph.items()} }")


DAMAGE_CACHED_RUNTIME = """async () => {
  const cache = await caches.open('frozen-mtp-models');
  const [key] = (await cache.keys()).filter((r) => r.url.includes('ort-wasm-simd-threaded.wasm?sha256='));
  const bytes = new Uint8Array(await (await cache.match(key)).arrayBuffer());
  await cache.put(key, new Response(bytes.slice(0, bytes.length - 4096)));  // truncated in storage
  return key.url;
}"""


def test_a_second_visit_fetches_no_model_bytes(browser, tiny_url, tiny_site):
    """The model files and onnxruntime's WebAssembly runtime stay in Cache Storage after their download:
    opening the page again (same browser profile) fetches the manifest only, and still decodes. A runtime
    damaged in Cache Storage fails its sha256 (the manifest's `runtimes`) and is downloaded again."""
    manifest = json.loads((tiny_site / "models" / "manifest.json").read_text())
    context = browser.new_context()
    try:
        fetched = []
        context.on("requestfinished", lambda r: ("/models/" in r.url or r.url.endswith(".wasm"))
                   and fetched.append(r.url.rsplit("/", 1)[1]))
        visits = []
        for visit in range(3):
            if visit == 2:
                page = context.new_page()
                page.goto(tiny_url + "favicon-none")  # the site's origin, without loading the models
                assert manifest["runtimes"]["vendor/ort/ort-wasm-simd-threaded.wasm"]["sha256"] in page.evaluate(DAMAGE_CACHED_RUNTIME)
                page.close()
            fetched.clear()
            page = context.new_page()
            page.goto(tiny_url + "?backend=wasm")
            page.evaluate("window.frozenMTP.ready")
            out = page.evaluate("window.frozenMTP.generate({prompt: 'The list', mode: 'mtp', k: 2, maxNewTokens: 6})")
            assert len(out["ids"]) == 6
            page.close()
            visits.append(sorted(fetched))
        runtime = "ort-wasm-simd-threaded.wasm"  # the WASM build's runtime: the page runs on WASM
        assert set(visits[0]) > {"manifest.json", manifest["tokenizer"], runtime}, visits[0]
        assert all(f in manifest["files"] for f in visits[0] if f not in ("manifest.json", runtime))
        assert visits[1] == ["manifest.json"], f"the second visit fetched {visits[1]}"
        assert visits[2] == ["manifest.json", runtime], f"after the runtime was damaged in the cache: {visits[2]}"
    finally:
        context.close()


def test_an_altered_webassembly_runtime_is_named(browser, tiny_site, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(tiny_site, site)
    wasm = site / "vendor" / "ort" / "ort-wasm-simd-threaded.wasm"
    data = bytearray(wasm.read_bytes())
    data[len(data) // 2] ^= 0xFF
    wasm.write_bytes(bytes(data))
    with served(site) as url:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(url + "?backend=wasm")
            error = page.evaluate("window.frozenMTP.ready.then(() => 'loaded', (e) => e.message)")
        finally:
            context.close()
    assert "ort-wasm-simd-threaded.wasm is altered or truncated" in error, error


def test_page_ids_equal_the_python_reference(page, prompts, base, tokenizer, onnx_dir, reference):
    """Every mode's ids equal the reference's (on WebGPU the shortest prompts, and plain decoding on one prompt a
    task: it is the simplest path and the slowest on SwiftShader); the drafter with prompt lookup first (the default), which
    drafts some steps, the head alone. And the page's head drafts what the same head graph drafts
    in onnxruntime from Python (exactness alone would hold with a head that drafts nothing right): the
    drafts it got accepted add up to Python's within 10 % (a draft may flip where the head's own top two
    logits are nearly tied and the page's kernels round differently, or a draft's confidence sits at the
    page's draft cut, which Python applies too)."""
    backend = page.info["backend"]
    n_new = NEW_TOKENS[backend]
    counts = {"equal": 0, "near-tie": 0, "mismatch": 0}
    failures = []
    heads, accepted, looked_up = OnnxBackend(onnx_dir, "head", K), {"page": 0, "python": 0}, 0
    # WebGPU takes each task's shortest prompts: SwiftShader's prefill costs about 0.15 s a token (a 406-token
    # summarize prompt took a minute a mode), and the decode steps are what this checks
    by_task = {task: [q for q in prompts if q["task"] == task] for task in dict.fromkeys(p["task"] for p in prompts)}
    if backend == "webgpu":
        by_task = {t: sorted(qs, key=lambda q: len(encode_prompt(tokenizer, t, q["prompt"]))) for t, qs in by_task.items()}
    prompts = [(p, i < PLAIN_PROMPTS_PER_TASK[backend]) for qs in by_task.values()
               for i, p in enumerate(qs[:PROMPTS_PER_TASK[backend]])]
    for p, plain in prompts:
        prompt_ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = reference.decoded(prompt_ids, n_new)
        for mode in ("ar", "mtp", "drafter")[0 if plain else 1:]:
            got = page.generate(prompt=p["prompt"], task=p["task"], mode=mode, k=K, maxNewTokens=n_new,
                                **({"lookup": False} if mode == "mtp" else {}))
            assert len(got["lookups"]) == len(got["accepted"]) and got["lookup"] == (mode == "drafter")
            looked_up += sum(got["lookups"])
            assert got["promptIds"] == prompt_ids, f"{p['task']} {p['prompt']!r}: the page encodes the prompt differently"
            assert got["backend"] == backend
            assert got["draftCut"] == (DRAFT_CUT[backend] if mode == "mtp" else 0), "the manifest's cut, the head's only"
            if mode == "mtp":
                accepted["page"] += sum(got["accepted"])
                accepted["python"] += sum(decode(heads, prompt_ids, n_new, base.config.eos_token_id, K,
                                                 draft_cut=got["draftCut"]).accepted)
            verdict, at = compare_to_reference(ref, got["ids"])
            counts[verdict] += 1
            if verdict == "mismatch":
                failures.append(f"{backend} {mode} {p['task']} {p['prompt']!r}: first mismatch at token {at} "
                                f"(reference {ref.ids}, page {got['ids']})")
            elif verdict == "equal":
                assert got["text"] == tokenizer.decode(ref.ids, skip_special_tokens=True)
                assert got["steps"] == (len(ref.ids) if mode == "ar" else len(got["accepted"]))
                if mode != "ar":  # a step decides accepted + 1 tokens; the last may stop early (EOS, limit)
                    assert sum(got["accepted"][:-1]) + got["steps"] - 1 < len(ref.ids) <= sum(got["accepted"]) + got["steps"]
    print(f"\n{backend}: {len(prompts)} prompts x (mtp k={K}, drafter k={K}), ar on "
          f"{sum(plain for _, plain in prompts)} of them, {n_new} tokens: {counts}; "
          f"MTP drafts accepted: {accepted}; drafter steps drafted by prompt lookup: {looked_up}")
    assert not failures, "\n".join(failures)
    assert looked_up > 0, "prompt lookup drafted no step of the drafter's"
    assert accepted["python"] > len(prompts), f"the head graph drafts little right even in Python: {accepted}"
    assert abs(accepted["page"] - accepted["python"]) <= 0.1 * accepted["python"], accepted


TRICKY = ["Café naïve résumé", "日本語のテキストと中文", "emoji 🙂👍🏽 and 🇩🇪 flags", "runs   of    spaces",
          "lines\n\n\nand\ttabs\r\n", "  leading and trailing  ", "typed <|fix|> and <|endoftext|> stay text",
          "x" * 300, "mixed: ½ ² → ∞, ǅ, ﬁ"]


def test_the_page_loads_the_onnxruntime_build_of_its_backend(page):
    """One onnxruntime-web build per page: on WASM the WASM build (its 14.2 MB runtime), on WebGPU the
    WebGPU build (its 26.8 MB asyncify runtime, which also runs the WASM EP); never both."""
    builds = {"wasm": {"ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm"},
              "webgpu": {"ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs",
                         "ort-wasm-simd-threaded.asyncify.wasm"}}
    fetched = {r.rsplit("/", 1)[1] for r in page.requests if "/vendor/ort/" in r}
    assert fetched == builds[page.info["backend"]], fetched


def test_page_tokenizer_gives_pythons_ids(browser, url, tokenizer):
    p = Page(browser, url, "?backend=wasm")
    try:
        for text in TRICKY:
            got = p.page.evaluate("(t) => window.frozenMTP.encodeText(t)", text)
            assert got == encode_text(tokenizer, text), f"token ids differ for {text!r}"
    finally:
        p.close()


def test_webgpu_decode_reads_back_only_token_ids_and_feeds_the_head_the_bases_gpu_tensors(browser, tiny_url, prompts,
                                                                                        tiny_site):
    url = tiny_url
    manifest = json.loads((tiny_site / "models" / "manifest.json").read_text())
    head_kv = manifest["head"]["kv_inputs"]  # head input -> the base output it reads
    cache = dict(zip(manifest["kv"]["past_inputs"], manifest["kv"]["present_outputs"]))
    p = Page(browser, url, "?backend=webgpu", init_script=GPU_READ_HOOK)
    try:
        prompt = next(x for x in prompts if x["task"] == "proofread")
        p.page.evaluate("window.__gpuReads = []")
        got = p.generate(prompt=prompt["prompt"], task="proofread", mode="mtp", k=K, maxNewTokens=10, trace=True,
                         lookup=False)  # the head drafts every step
        reads = p.page.evaluate("window.__gpuReads")
        p.page.evaluate("window.__gpuReads = []")
        cut = p.generate(prompt=prompt["prompt"], task="proofread", mode="mtp", k=K, maxNewTokens=10, trace=True,
                         lookup=False, draftCut=0.5)
        cut_reads = p.page.evaluate("window.__gpuReads")
        live = p.page.evaluate("window.frozenMTP.info()")["liveGpuTensors"]
    finally:
        p.close()
    # with a draft cut the page reads the head's confidences back too, one small read a head run, and disposes them
    heads = sum(r["graph"].startswith("head") for r in cut["trace"])
    assert got["draftCut"] == 0 and cut["draftCut"] == 0.5 and cut["ids"] == got["ids"] and heads > 0
    assert len(cut_reads) == len(cut["trace"]) + heads, f"{len(cut_reads)} read-backs, {len(cut['trace'])} runs"
    assert live == 0, f"{live} GPU tensors left after the decodes"
    trace = got["trace"]
    assert [r["graph"] for r in trace[:3]] == ["base", f"head_k{K}", "base"], "prefill, then head drafts, base verifies"
    # 1. GPU read-backs: exactly one per run, each no bigger than that run's int64 token-id output
    id_outputs = [[t for t in r["outputs"].values() if t["location"] == "cpu"] for r in trace]
    assert all(len(outs) == 1 and outs[0]["dtype"] == "int64" for outs in id_outputs), "only token ids on the CPU"
    assert len(reads) == len(trace), f"{len(reads)} GPU read-backs for {len(trace)} runs: {reads}"
    id_bytes = [8 * outs[0]["dims"][1] for outs in id_outputs]
    for read, limit in zip(reads, id_bytes):
        assert read["bytes"] <= -(-limit // 16) * 16, f"a {read['bytes']}-byte read-back, token ids are {limit} bytes"
    # 2. every float tensor stays on the GPU, and the head reads the base's own buffers
    for i, run in enumerate(trace):
        floats = [t for t in run["inputs"].values() if t["dtype"] == "float32" and t["dims"][1] > 0]
        assert all(t["location"] == "gpu-buffer" for t in floats), f"run {i} got a float input from the CPU"
        if run["graph"].startswith("head"):
            base_out = trace[i - 1]["outputs"]
            assert trace[i - 1]["graph"] == "base"
            assert run["inputs"]["hidden"]["buffer"] == base_out["hidden"]["buffer"]
            for name, output in head_kv.items():
                assert run["inputs"][name]["buffer"] == base_out[output]["buffer"], f"run {i}: {name} is a copy"
        if run["graph"] == "base" and i > 0:  # the next base run reads the cache the last one wrote
            last = next(trace[j] for j in range(i - 1, -1, -1) if trace[j]["graph"] == "base")
            for past, present in cache.items():
                assert run["inputs"][past]["buffer"] == last["outputs"][present]["buffer"], f"run {i}: {past} is a copy"
    print(f"\nwebgpu: {len(trace)} runs, {len(reads)} read-backs, {sum(r['bytes'] for r in reads)} bytes in all")


def test_phone_sized_page_generates_and_shows_figures(browser, url):
    p = Page(browser, url, "?backend=wasm", viewport={"width": 360, "height": 740})
    page = p.page
    try:
        page.get_by_label("Proofread").check()
        assert page.locator(".example-list:visible").count() == 1, "only the chosen task's examples show"
        page.locator(".example-list:visible .example").first.click()
        page.get_by_role("button", name="Generate").click()
        page.wait_for_selector("#stop-reason:not(:empty)", timeout=60_000)  # a selector: the page's CSP forbids eval
        assert page.locator("#output").inner_text().strip(), "no text appeared"
        assert page.locator("#output .tok.drafted").count() > 0, "no accepted draft is highlighted"
        assert float(page.locator("#tps").inner_text()) > 0
        assert float(page.locator("#tau").inner_text()) > 1
        assert 4 <= page.locator("#bars .bar").count() <= 4 * LOOKUP_SPAN, "k = 4 positions, more where lookup accepted more"
        copied, steps = map(int, re.fullmatch(r"(\d+) of (\d+)", page.locator("#lookups").inner_text()).groups())
        assert copied <= steps == int(page.locator("#steps").inner_text())
        assert page.locator("#lookup").is_checked(), "prompt lookup is on by default, as in the CLI"
        assert page.evaluate("document.documentElement.scrollWidth") <= 360, "the page scrolls sideways on a phone"
        # the modes as the manifest names them (contract.py's MODE_LABELS and MODE_ROLES), the default first
        assert page.locator("#mode option").all_inner_texts() == [
            "MTP (head drafts, base verifies)", "Plain (base alone)", "Drafter (independent, the baseline)"]
        page.get_by_role("button", name="Compare plain, MTP, drafter").click()
        page.wait_for_selector("#comparison-verdict.same, #comparison-verdict.differ", timeout=180_000)
        verdict = page.locator("#comparison-verdict").inner_text()
        assert verdict.startswith("Identical text") and "Median of 3 interleaved rounds" in verdict, verdict
        assert re.search(r"Once the prompt was read \(\d+ ms, the same in every mode\), MTP streamed at \d+\.\d\dx", verdict), verdict
        assert page.locator("#comparison-rows tr").count() == 3
        mtp_row = page.locator("#comparison-rows tr", has_text="MTP k=")
        assert f"MTP ran at {mtp_row.locator('td').nth(3).inner_text()} the plain speed" in verdict, "the table and the verdict disagree"
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "phone.png"), full_page=True)
        assert p.errors == []
        assert p.foreign_requests() == [], "a request left the site"
    finally:
        p.close()


def test_without_webgpu_the_page_falls_back_to_wasm_and_says_so(browser, tiny_url):
    url = tiny_url
    no_gpu = "Object.defineProperty(Navigator.prototype, 'gpu', { get: () => undefined });"
    p = Page(browser, url, "", init_script=no_gpu)
    try:
        assert p.info["backend"] == "wasm"
        assert "no WebGPU" in p.page.locator("#adapter").inner_text()
    finally:
        p.close()


@pytest.mark.parametrize("which", ["graph", "weights"])
def test_an_altered_model_file_is_a_clear_error_naming_it(browser, tiny_site, tmp_path, which):
    """The head graph the page opens at load, or the head's own weights file (the base's is checked first)."""
    site = tiny_site
    altered = tmp_path / "site"
    shutil.copytree(site, altered)
    graph = json.loads((site / "models" / "manifest.json").read_text())["precisions"]["fp32"]["graphs"][f"head_k{K}"]
    name = graph["file"] if which == "graph" else next(w for w in graph["weights"] if not w.startswith("base"))
    data = bytearray((altered / "models" / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (altered / "models" / name).write_bytes(bytes(data))
    with served(altered) as url:
        context = browser.new_context()
        page = context.new_page()
        page.goto(url + "?backend=wasm")
        error = page.evaluate("window.frozenMTP.ready.then(() => 'loaded', (e) => e.message)")
        assert f"models/{name} is altered" in error, error
        assert page.locator("#message").inner_text() == error, "the page shows the error"
        assert page.get_by_role("button", name="Generate").is_disabled()
        context.close()


def test_a_missing_runtime_bundle_is_a_clear_error(browser, tiny_site, tmp_path):
    """The page imports onnxruntime-web when it knows its backend: a site without that build's bundle says
    which file it could not load, rather than failing to start."""
    broken = tmp_path / "site"
    shutil.copytree(tiny_site, broken)
    (broken / "vendor" / "ort" / "ort.wasm.min.mjs").unlink()
    with served(broken) as url:
        context = browser.new_context()
        page = context.new_page()
        page.goto(url + "?backend=wasm")
        error = page.evaluate("window.frozenMTP.ready.then(() => 'loaded', (e) => e.message)")
        assert "could not load onnxruntime-web from" in error and "vendor/ort/ort.wasm.min.mjs" in error, error
        assert page.locator("#message").inner_text() == error, "the page shows the error"
        assert page.get_by_role("button", name="Generate").is_disabled()
        context.close()
