"""The page against odd input, faults and long sessions (headless Chromium, as tests/test_site.py).

- bad input gets one clear message, in the API and on the page; odd text is encoded as Python encodes it;
  markup in the prompt or the output stays text;
- the context window and the end-of-sequence token stop a generation and say so;
- a missing model file is named, a lost GPU device makes the page fall back to WASM, Stop ends a decode
  at the next step, two Generate calls never overlap;
- 40 generations in a row leak neither GPU buffers, GPU tensors nor JS heap, and stay exact;
  (the faults, the long session and the CSP run on conftest's tiny random model: mechanics, not the model)
- the page fetches nothing from elsewhere, and its Content-Security-Policy refuses to.
"""
from __future__ import annotations

import shutil

import pytest

from builder.site.browser import served
from builder.decode.loop import compare_to_reference
from builder.decode.torch_backend import decode_ar
from builder.data.tasks import encode_prompt
from tests.conftest import CONTEXT, Page

# Installed before any page script: counts the WebGPU buffers alive (created, not destroyed) and keeps
# the devices, so that a test can destroy one as a driver reset would.
GPU_HOOK = """
window.__gpu = { live: 0, created: 0, devices: [] };
if (globalThis.GPUDevice) {
  const createBuffer = GPUDevice.prototype.createBuffer;
  GPUDevice.prototype.createBuffer = function (descriptor) {
    const buffer = createBuffer.call(this, descriptor);
    window.__gpu.live += 1;
    window.__gpu.created += 1;
    const destroy = buffer.destroy;
    let destroyed = false;
    buffer.destroy = function () {
      if (!destroyed) { destroyed = true; window.__gpu.live -= 1; }
      return destroy.call(this);
    };
    return buffer;
  };
  const requestDevice = GPUAdapter.prototype.requestDevice;
  GPUAdapter.prototype.requestDevice = async function () {
    const device = await requestDevice.apply(this, arguments);
    window.__gpu.devices.push(device);
    return device;
  };
}
"""


def rejection(page: Page, options: dict) -> str:
    """The message generate(options) rejects with (fails if it resolves)."""
    return page.page.evaluate(
        "async (o) => { try { await window.frozenMTP.generate(o); return 'resolved'; }"
        " catch (e) { return `${e.constructor.name}: ${e.message}`; } }", options)


@pytest.fixture(scope="module")
def wasm(browser, url):
    p = Page(browser, url, "?backend=wasm")
    yield p
    assert p.errors == [], f"the page logged errors: {p.errors}"
    assert p.foreign_requests() == []
    p.close()


@pytest.mark.parametrize("options, message", [
    ({"prompt": ""}, "PageError: the prompt is empty"),
    ({"prompt": "  \n\t "}, "PageError: the prompt is empty"),
    ({"prompt": 42}, "PageError: the prompt must be text, got number"),
    ({"prompt": "word " * (CONTEXT + 40)}, f"too long for the context window of {CONTEXT} tokens: shorten it by at least"),
    ({"prompt": "hi", "k": 0}, "PageError: k must be a whole number from 1 to 6, got 0"),
    ({"prompt": "hi", "k": 7}, "PageError: k must be a whole number from 1 to 6, got 7"),
    ({"prompt": "hi", "k": 2.5}, "PageError: k must be a whole number from 1 to 6, got 2.5"),
    ({"prompt": "hi", "draftCut": 1}, "PageError: draftCut must be a number from 0 (no cut) up to 1, got 1"),
    ({"prompt": "hi", "draftCut": "0.1"}, "got 0.1"),
    ({"prompt": "hi", "maxNewTokens": 0}, "PageError: max new tokens must be a whole number of at least 1, got 0"),
    ({"prompt": "hi", "maxNewTokens": -4}, "got -4"),
    ({"prompt": "hi", "maxNewTokens": 1.5}, "got 1.5"),
    ({"prompt": "hi", "maxNewTokens": "12"}, "got 12"),
    ({"prompt": "hi", "mode": "fast"}, 'PageError: unknown mode "fast": choose ar, mtp or drafter'),
    ({"prompt": "hi", "task": "summarise"}, 'PageError: unknown task "summarise": choose continue, proofread or summarize'),
])
def test_bad_input_is_one_clear_message(wasm, options, message):
    assert message in rejection(wasm, options)


def test_bad_input_on_the_page_is_shown_and_the_page_still_works(wasm):
    page = wasm.page
    page.fill("#prompt", "   ")
    page.click("#generate")
    page.wait_for_selector("#message:not([hidden])")
    assert page.locator("#message").inner_text() == "the prompt is empty"
    page.fill("#max-new", "0")
    page.fill("#prompt", "The list")
    page.click("#generate")
    page.wait_for_selector("#message:has-text('max new tokens')")
    page.fill("#max-new", "6")
    page.click("#generate")
    page.wait_for_selector("#stop-reason:has-text('limit')")
    assert page.locator("#message").is_hidden(), "a good run clears the last error"
    assert page.locator("#ntok").inner_text() == "6"


def window_filling_prompt(base, tokenizer, corpus) -> str:
    """Validation text that leaves 6 tokens of the window, which the base does not end sooner."""
    ctx, eos = base.config.max_position_embeddings, base.config.eos_token_id
    for start in range(0, 400, 40):
        ids = encode_prompt(tokenizer, "continue", " ".join(corpus.validation[start:start + 40]))[1: ctx - 6]
        text = tokenizer.decode(ids)
        prompt_ids = encode_prompt(tokenizer, "continue", text)
        if len(prompt_ids) == ctx - 6 and eos not in decode_ar(base, prompt_ids, 6, eos).ids:
            return text
    raise AssertionError("no validation text fills the window without the base ending it")


def test_the_context_window_and_the_end_of_sequence_stop_cleanly_and_say_so(wasm, base, tokenizer, corpus,
                                                                            validation_prompts):
    eos = base.config.eos_token_id
    long = window_filling_prompt(base, tokenizer, corpus)
    for mode in ("ar", "mtp"):
        got = wasm.generate(prompt=long, mode=mode, k=4, maxNewTokens=200)
        ref = decode_ar(base, got["promptIds"], 200, eos)
        assert got["ids"] == ref.ids and got["stopped"] == ref.stopped
        assert got["stopped"] == "context-window" and len(got["promptIds"]) + len(got["ids"]) == CONTEXT
    proofread = validation_prompts[30]["prompt"]
    got = wasm.generate(prompt=proofread, task="proofread", mode="mtp", k=4, maxNewTokens=120)
    assert got["stopped"] == "end-of-sequence" and got["ids"][-1] == eos
    page = wasm.page
    page.fill("#prompt", long)
    page.fill("#max-new", "200")
    page.click("#generate")
    page.wait_for_selector("#stop-reason:not(:empty)", timeout=60_000)
    assert page.locator("#stop-reason").inner_text() == "Stopped: the prompt and the new tokens fill the context window."


# emoji, CJK, right-to-left scripts, control characters, bidi overrides, a lone surrogate (made in JS: it
# cannot cross Playwright's UTF-8 pipe), and markup: each is encoded as Python encodes it
ODD = [
    "'Emoji 😀👍🏽🇩🇪 and 中文字符 日本語'",
    "'עברית and العربية and ltr'",
    "'tab\\there\\r\\nbell\\u0007 nul\\u0000 esc\\u001b del\\u007f'",
    "'bidi \\u202eoverride\\u202c and zero\\u200bwidth'",
    "'half a pair ' + String.fromCharCode(0xD83D) + ' here, ' + String.fromCharCode(0xDE00) + ' there'",
    "'<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\">'",
]


@pytest.mark.parametrize("expr", ODD, ids=["emoji-cjk", "rtl", "control", "bidi", "lone-surrogate", "markup"])
def test_odd_text_is_encoded_as_python_encodes_it_and_decodes(wasm, base, tokenizer, expr):
    got = wasm.page.evaluate(
        f"async () => {{ const text = {expr}; const r = await window.frozenMTP.generate("
        "{prompt: text, mode: 'mtp', k: 3, maxNewTokens: 8}); return {text: text.toWellFormed(), r}; }")
    text, r = got["text"], got["r"]
    assert r["promptIds"] == encode_prompt(tokenizer, "continue", text)
    ref = decode_ar(base, r["promptIds"], 8, base.config.eos_token_id)
    assert compare_to_reference(ref, r["ids"])[0] == "equal"
    assert wasm.page.evaluate("window.__pwned") is None


def test_markup_in_the_prompt_and_the_output_is_shown_as_text(wasm):
    """Proofreading copies the sentence, markup and all: it must appear as characters, never as elements."""
    page = wasm.page
    page.get_by_label("Proofread").check()
    markup = 'Teh <b>list</b> is <img src=x onerror="window.__pwned = 1"> sorted <script>window.__pwned = 2</script>.'
    page.fill("#prompt", markup)
    page.fill("#max-new", "48")
    page.select_option("#mode", "mtp")
    page.click("#generate")
    page.wait_for_selector("#stop-reason:not(:empty)", timeout=60_000)
    output = page.locator("#output")
    assert "<" in output.inner_text(), f"the model did not copy any markup: {output.inner_text()!r}"
    assert page.locator("#output *:not(span.tok)").count() == 0, "markup became elements"
    assert page.evaluate("window.__pwned") is None
    page.get_by_label("Continue").check()


def test_stop_ends_a_decode_at_the_next_step_and_keeps_what_was_decided(wasm, base, tokenizer):
    got = wasm.page.evaluate("""async () => {
      const controller = new AbortController();
      let steps = 0;
      const r = await window.frozenMTP.generate({ prompt: 'The list', mode: 'mtp', k: 2, maxNewTokens: 200,
        signal: controller.signal, onStep: () => { steps += 1; if (steps === 3) controller.abort(); } });
      return { r, steps };
    }""")
    r = got["r"]
    assert r["stopped"] == "stopped" and r["steps"] == 3 == got["steps"], "Stop pressed after step 3: no step 4"
    ref = decode_ar(base, r["promptIds"], 200, base.config.eos_token_id)
    assert 3 <= len(r["ids"]) <= 9 and r["ids"] == ref.ids[: len(r["ids"])], "what was decided stays exact"
    # on the page: Stop is clicked as soon as the first token shows (by an observer, as fast as a hand could)
    page = wasm.page
    page.fill("#prompt", "The list")
    page.fill("#max-new", "200")
    page.select_option("#mode", "ar")
    page.evaluate("""() => {
      const observer = new MutationObserver(() => {
        if (document.querySelector('#output span.tok')) { observer.disconnect(); document.getElementById('stop').click(); }
      });
      observer.observe(document.getElementById('output'), { childList: true });
    }""")
    page.click("#generate")
    page.wait_for_selector("#stop-reason:not(:empty)")
    assert page.locator("#stop-reason").inner_text() == "Stopped."
    assert int(page.locator("#ntok").inner_text()) <= 2, "plain decoding: the step running when Stop came, no more"
    assert page.locator("#generate").is_enabled() and page.locator("#stop").is_disabled()


def test_two_generate_calls_never_run_at_once(wasm):
    events = wasm.page.evaluate("""async () => {
      const events = [];
      const one = (name) => window.frozenMTP.generate({ prompt: 'The list', mode: 'mtp', k: 2, maxNewTokens: 12,
        onStep: () => events.push(name) }).then(() => events.push(name + ' done'));
      await Promise.all([one('a'), one('b')]);
      return events;
    }""")
    assert events.index("a done") < events.index("b"), f"the second decode started before the first ended: {events}"
    page = wasm.page
    page.fill("#prompt", "The list")
    page.fill("#max-new", "24")
    busy = page.evaluate("""() => {
      const generate = document.getElementById('generate');
      generate.click();  // a double click: the first disables both buttons before the second lands
      const disabled = [generate.disabled, document.getElementById('compare').disabled];
      generate.click();
      return disabled;
    }""")
    assert busy == [True, True]
    page.wait_for_selector("#stop-reason:not(:empty)")
    assert page.locator("#generate").is_enabled()


def copy_without(site, tmp_path, *names):
    out = tmp_path / "site"
    shutil.copytree(site, out)
    for name in names:
        (out / "models" / name).unlink()
    return out


def test_a_missing_model_file_is_named(browser, tiny_site, tmp_path):
    broken = copy_without(tiny_site, tmp_path, "head_k4.onnx")
    with served(broken) as url:
        context = browser.new_context()
        page = context.new_page()
        page.goto(url + "?backend=wasm")  # the page opens the head of its default k = 4 first
        error = page.evaluate("window.frozenMTP.ready.then(() => 'loaded', (e) => e.message)")
        assert error == f"{url}models/head_k4.onnx is missing from the site (HTTP 404): rebuild the site"
        assert page.locator("#message").inner_text() == error
        assert page.locator("#generate").is_disabled()
        context.close()


def test_a_missing_graph_needed_later_fails_that_generation_only(browser, tiny_site, tmp_path):
    broken = copy_without(tiny_site, tmp_path, "drafter.onnx")
    with served(broken) as url:
        p = Page(browser, url, "?backend=wasm")
        try:
            message = rejection(p, {"prompt": "The list", "mode": "drafter", "k": 4, "maxNewTokens": 8})
            assert message == f"PageError: {url}models/drafter.onnx is missing from the site (HTTP 404): rebuild the site"
            assert p.generate(prompt="The list", mode="mtp", k=4, maxNewTokens=8)["ids"], "MTP still works"
        finally:
            p.close()


def test_a_lost_gpu_device_is_reported_and_the_page_falls_back_to_wasm(browser, tiny_url, tiny_base):
    base = tiny_base
    p = Page(browser, tiny_url, "?backend=webgpu", init_script=GPU_HOOK)
    try:
        assert p.info["backend"] == "webgpu"
        message = p.page.evaluate("""async () => {
          let steps = 0;
          try {
            await window.frozenMTP.generate({ prompt: 'The list', mode: 'mtp', k: 2, maxNewTokens: 12,
              onStep: () => { steps += 1; if (steps === 1) window.__gpu.devices[0].destroy(); } });
            return 'resolved';
          } catch (e) { return `${e.constructor.name}: ${e.message}`; }
        }""")
        assert message.startswith("DeviceLostError: the GPU device was lost (destroyed: ") and "on WASM" in message
        info = p.page.evaluate("window.frozenMTP.info()")
        assert info["backend"] == "wasm" and "the GPU device was lost" in info["note"]
        assert "GPU device was lost" in p.page.locator("#adapter").inner_text()
        got = p.generate(prompt="The list", mode="mtp", k=2, maxNewTokens=12)
        assert got["backend"] == "wasm"
        assert got["ids"] == decode_ar(base, got["promptIds"], 12, base.config.eos_token_id).ids
    finally:
        p.close()


LONG_SESSION = 40


def test_forty_generations_leak_nothing_and_stay_exact(browser, tiny_url, tiny_base):
    """MTP (k=4: the head graph the page opens at load) and plain mixed, every fifth stopped after its second
    step, on WebGPU: the GPU tensors the page holds return to none after every generation; the live WebGPU
    buffers and the JS heap stop growing once every prompt and mode has been seen (onnxruntime-web's buffer
    cache and V8's code warm up). A graph opened later adds its session's buffers once, so the plan keeps
    to the graphs the page opens at load. On the tiny random model: the shipped base would take minutes of
    SwiftShader for what this checks."""
    base = tiny_base
    p = Page(browser, tiny_url, "?backend=webgpu", init_script=GPU_HOOK)
    cdp = p.context.new_cdp_session(p.page)

    def heap() -> int:
        cdp.send("HeapProfiler.collectGarbage")
        return cdp.send("Runtime.getHeapUsage")["usedSize"]

    def counts():
        return {"buffers": p.page.evaluate("window.__gpu.live"),
                "tensors": p.page.evaluate("window.frozenMTP.info()")["liveGpuTensors"], "heap": heap()}

    prompts = ["The list", "Dictionaries map", "A function is", "Teh list are sorted."]
    plan = [("mtp", 4), ("ar", 0), ("mtp", 4)]
    refs = {}
    levels = []
    try:
        for i in range(LONG_SESSION):
            mode, k = plan[i % len(plan)]
            prompt = prompts[i % len(prompts)]
            task = "proofread" if prompt.startswith("Teh") else "continue"
            stop = i % 5 == 4
            r = p.page.evaluate("""async ([o, stop]) => {
              const controller = new AbortController();
              let steps = 0;
              return window.frozenMTP.generate({ ...o, signal: controller.signal,
                onStep: () => { steps += 1; if (stop && steps === 2) controller.abort(); } });
            }""", [{"prompt": prompt, "task": task, "mode": mode, "k": k or 1, "maxNewTokens": 8}, stop])
            key = (prompt, task)
            if key not in refs:
                refs[key] = decode_ar(base, r["promptIds"], 8, base.config.eos_token_id).ids
            if stop and r["stopped"] == "stopped":
                assert r["ids"] == refs[key][: len(r["ids"])], f"generation {i} ({mode}, stopped)"
            else:
                assert r["ids"] == refs[key], f"generation {i} ({mode})"
            if i in (0, 9, 19, 29, LONG_SESSION - 1):
                levels.append(counts())
    finally:
        p.close()
    print("\nafter generations 1, 10, 20, 30, 40:", levels)
    first, tenth, last = levels[0], levels[1], levels[-1]
    assert first["buffers"] > 0, "the WebGPU buffer hook saw nothing"
    assert all(x["tensors"] == 0 for x in levels), "the page holds GPU tensors between generations"
    # onnxruntime-web keeps freed buffers in a cache by size: it fills while new prompt lengths come (the
    # first 10 generations see every prompt and mode), then a leak of even one buffer a run would show
    assert [x["buffers"] for x in levels[1:]] == [tenth["buffers"]] * 4, "WebGPU buffers leak"
    # the JS heap: V8's code and inline caches warm up over the first generations, then stay flat
    assert last["heap"] <= first["heap"] + 1024 * 1024 and last["heap"] <= tenth["heap"] * 1.05, "the JS heap grows"


def test_the_page_fetches_nothing_from_elsewhere_and_its_csp_refuses_to(browser, tiny_url):
    p = Page(browser, tiny_url, "?backend=wasm")
    try:
        for mode in ("ar", "mtp", "drafter"):
            p.generate(prompt="The list", mode=mode, k=5, maxNewTokens=8)
        assert p.requests and p.foreign_requests() == [], f"requests outside the site: {p.foreign_requests()}"
        csp = p.page.locator("meta[http-equiv=Content-Security-Policy]").get_attribute("content")
        assert "default-src 'self'" in csp and "connect-src 'self'" in csp and "script-src 'self' 'wasm-unsafe-eval'" in csp
        blocked = p.page.evaluate("""async () => {
          const violations = [];
          document.addEventListener('securitypolicyviolation', (e) => violations.push(e.violatedDirective));
          let fetched = 'fetched';
          try { await fetch('http://127.0.0.2:9/x'); } catch (e) { fetched = 'refused'; }
          const script = document.createElement('script');
          script.src = 'http://127.0.0.2:9/x.js';
          document.head.append(script);
          await new Promise((resolve) => { setTimeout(resolve, 300); });
          return { fetched, violations };
        }""")
        assert blocked["fetched"] == "refused" and {"connect-src", "script-src-elem"} <= set(blocked["violations"]), blocked
    finally:
        p.errors.clear()  # the refused requests above log CSP errors on purpose
        p.close()
