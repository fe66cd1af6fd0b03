"""The web's task APIs (ai.mjs: Summarizer, Proofreader, Writer, LanguageModel) in headless Chromium.

Two sites: SmolLM2 with its shipped head (the models users get: exactness of every API on WASM, the frame
rate while a summary streams) and a tiny random model with SmolLM2's tokenizer and chat template (2 layers
x 64: the APIs' mechanics in seconds, and exactness on WebGPU, where SwiftShader emulates the GPU on the
CPU). Every API call's tokens are compared with greedy decoding by the PyTorch base on the prompt Python
builds for the same call (the task's format, or the chat template's turns). A missing browser fails these
tests: it is never a skip.
"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from builder.data.tasks import encode_chat, encode_prompt, load_tokenizer
from builder.decode.loop import compare_to_reference
from builder.decode.torch_backend import decode_ar
from builder.export.manifest import Checkpoints, ensure_export
from builder.models.adapter import add_adapter, production_models, projections, remove_adapter, save_adapter
from tests.conftest import ROOT, Page

SMOL = ROOT / "models" / "base"
ADAPTED = ("summarize", "proofread", "reply")  # the features with an adapter (the chat is the base alone)
# SmolLM2, its shipped head and the shipped adapters (each feature's production model: base + adapter)
SMOL_CKPTS = Checkpoints(SMOL, ROOT / "models" / "mtp", None,
                         tuple(ROOT / "models" / "adapters" / t for t in ADAPTED
                               if (ROOT / "models" / "adapters" / t / "adapter_config.json").is_file()))
RESULTS = ROOT / "build" / "api"  # the frame rate measured while a summary streams
TINY_CONTEXT = 256


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory) -> Checkpoints:
    """A tiny random base (2 layers x 64) with SmolLM2's tokenizer and chat template, and a random head."""
    from builder.models.head import HeadConfig, MTPHead, base_fingerprint, save_head
    from builder.models.llama import Llama, LlamaConfig, load_config, save_llama

    root = tmp_path_factory.mktemp("chat-tiny")
    smol = load_config(SMOL)
    model = Llama(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=smol["vocab_size"], max_position_embeddings=TINY_CONTEXT,
                              eos_token_id=smol["eos_token_id"], tie_word_embeddings=True))
    model.init_weights(seed=5)
    with torch.no_grad():  # as conftest's tiny: a varied greedy text, top two logits far apart
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(50 if "embed" in name else 12)
    save_llama(model, root / "base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SMOL / name, root / "base" / name)
    head = MTPHead(HeadConfig.for_base(model.config, k_train=4))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    head.config.base_fingerprint = base_fingerprint(model)
    save_head(head, root / "mtp")
    adapters = []
    for seed, task in enumerate(ADAPTED, 1):  # a random adapter per feature: the worker feeds each to the base graph
        add_adapter(model, rank=4, alpha=8, seed=seed)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, proj in projections(model):
                proj.lora_B.weight.copy_(torch.randn(proj.lora_B.weight.shape, generator=g) * 0.05)
        save_adapter(model, root / task, 4, 8, {"task": task, "base_fingerprint": head.config.base_fingerprint})
        remove_adapter(model)
        adapters.append(root / task)
    return Checkpoints(root / "base", root / "mtp", None, tuple(adapters))


def site_of(ckpts: Checkpoints, onnx_dir, out):
    from builder.site.build import build

    build(ckpts, out, onnx_dir, ("fp32",))
    return out


@pytest.fixture(scope="module")
def tiny_url(chat_tiny, tmp_path_factory):
    """Its export kept in build/api-tiny-onnx (the same seeded weights each run: reused until the code changes)."""
    from builder.site.browser import served

    site = site_of(chat_tiny, ROOT / "build" / "api-tiny-onnx", tmp_path_factory.mktemp("chat-tiny-site"))
    with served(site) as address:
        yield address


@pytest.fixture(scope="module")
def smol_url(tmp_path_factory):
    """SmolLM2 and its shipped head (the export kept in build/api-smol-onnx, redone when stale)."""
    from builder.site.browser import served

    onnx_dir = ROOT / "build" / "api-smol-onnx"
    ensure_export(SMOL_CKPTS, onnx_dir, ("fp32",))
    site = site_of(SMOL_CKPTS, onnx_dir, tmp_path_factory.mktemp("smol-site"))
    with served(site) as address:
        yield address


@pytest.fixture(scope="module")
def tiny_models(chat_tiny):
    """task -> the torch production model the page must equal (None: the base alone, for the chat)."""
    return production_models(chat_tiny.base, chat_tiny.adapters)


@pytest.fixture(scope="module")
def smol_models():
    return production_models(SMOL_CKPTS.base, SMOL_CKPTS.adapters)


class ApiPage:
    """api.html of a site (it loads ai.mjs) in a browser context of its own (its own Cache Storage), with its
    console errors and uncaught errors recorded."""

    def __init__(self, browser, url: str, query: str = "", context=None, init_script: str | None = None):
        self.context = context or browser.new_context()
        self.page = self.context.new_page()
        if init_script:
            self.page.add_init_script(init_script)
        self.errors = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and "onnxruntime" not in m.text and self.errors.append(m.text))
        self.page.goto(url + "api.html" + query)
        self.page.wait_for_function("globalThis.frozenMTPAI")

    def run(self, script: str, arg=None):
        return self.page.evaluate(script, arg)

    def click(self):
        """A real click: the transient user activation a first download needs."""
        self.page.mouse.click(2, 2)

    def decodes(self) -> list[dict]:
        return self.run("() => frozenMTPAI.decodes.splice(0)")

    def close(self):
        self.context.close()


def with_context(text: str, *contexts: str | None) -> str:
    """ai.mjs's user text of a Summarizer or Writer call: each non-blank context a paragraph before the input."""
    return "\n\n".join([c for c in contexts if c and c.strip()] + [text])


def check_exact(models: dict, calls: list[tuple[str, str | None, list[int]]], decodes: list[dict]) -> int:
    """Each decode the page ran has Python's prompt ids for its call and the greedy ids of the torch production
    model of its task (models: task -> model, production_models) (docs/contract.md's rule: equal, or a first
    difference at a near-tie, counted). Returns the near-ties."""
    assert len(decodes) == len(calls), f"{len(calls)} calls, {len(decodes)} decodes"
    near_ties = 0
    for (what, task, prompt_ids), got in zip(calls, decodes):
        assert got["promptIds"] == prompt_ids, f"{what}: the page's prompt is not Python's"
        assert got["ids"], f"{what}: no tokens"
        model = models.get(task, models[None])
        with torch.no_grad():
            ref = decode_ar(model, prompt_ids, len(got["ids"]), model.config.eos_token_id)
        verdict, where = compare_to_reference(ref, got["ids"])
        assert verdict != "mismatch", f"{what}: first mismatch at token {where}: {ref.ids} vs {got['ids']}"
        near_ties += verdict == "near-tie"
    return near_ties


# the four APIs, every option that reaches the prompt: contexts, initial prompts, a second turn, append, clone
ALL_APIS = """async ({n, texts}) => {
  const out = {};
  const summarizer = await Summarizer.create({type: 'tldr', length: 'short', format: 'plain-text',
    sharedContext: texts.shared, maxNewTokens: n});
  out.summary = await summarizer.summarize(texts.summarize, {context: texts.context});
  const proofreader = await Proofreader.create({expectedInputLanguages: ['en'], maxNewTokens: n});
  out.proofread = await proofreader.proofread(texts.proofread);
  const writer = await Writer.create({maxNewTokens: n});
  out.reply = await writer.write(texts.message, {context: texts.context});
  const session = await LanguageModel.create({initialPrompts: [{role: 'system', content: texts.system},
    {role: 'user', content: 'Hi!'}, {role: 'assistant', content: 'Hello! How can I help?'}], maxNewTokens: n});
  out.first = await session.prompt(texts.question);
  await session.append([{role: 'user', content: [{type: 'text', value: texts.append}]}]);
  const clone = await session.clone();
  out.second = await clone.prompt('And one more?');
  const plain = await LanguageModel.create({maxNewTokens: n});
  out.plain = await plain.prompt(texts.question);
  return out;
}"""

TEXTS = {"shared": "A note for the team.", "context": "Written on Friday.",
         "summarize": "Hi all, the office will be closed on Monday for the public holiday. The support line stays open "
                      "from 9 to 5, and urgent tickets go to the on-call engineer as usual.",
         "proofread": "The functon returns a new dictionery with the same keys.",
         "message": "Can you send me the slides from today's meeting?",
         "system": "You are a helpful assistant. Answer briefly.",
         "question": "What is the capital of France?", "append": "Please answer in one word."}


def all_api_calls(tok, out: dict) -> list[tuple[str, str | None, list[int]]]:
    """The prompts Python builds for ALL_APIS's calls, in order, given the page's answers (a conversation
    carries them)."""
    t = TEXTS
    opening = [{"role": "system", "content": t["system"]}, {"role": "user", "content": "Hi!"},
               {"role": "assistant", "content": "Hello! How can I help?"}]
    first = opening + [{"role": "user", "content": t["question"]}]
    second = first + [{"role": "assistant", "content": out["first"]}, {"role": "user", "content": t["append"]},
                      {"role": "user", "content": "And one more?"}]
    return [("Summarizer.summarize", "summarize", encode_prompt(tok, "summarize", with_context(t["summarize"], t["shared"], t["context"]))),
            ("Proofreader.proofread", "proofread", encode_prompt(tok, "proofread", t["proofread"])),
            ("Writer.write", "reply", encode_prompt(tok, "reply", with_context(t["message"], t["context"]))),
            ("LanguageModel.prompt", None, encode_chat(tok, first)),
            ("LanguageModel.prompt after append, on a clone", None, encode_chat(tok, second)),
            ("LanguageModel.prompt, no initial prompts", None, encode_chat(tok, [{"role": "user", "content": t["question"]}]))]


# ---------------------------------------------------------------- without a browser

def test_the_chat_turns_give_the_ids_of_the_rendered_template():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok = load_tokenizer(SMOL)
    template = json.loads((SMOL / "tokenizer_config.json").read_text())["chat_template"]
    render = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render
    for messages in ([{"role": "user", "content": "Hi there, how are you?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
                      {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another, café-style 🍐?"}]):
        tok.tokenizer.encode_special_tokens = False
        try:
            want = tok.tokenizer.encode(render(messages=messages, add_generation_prompt=True), add_special_tokens=False).ids
        finally:
            tok.tokenizer.encode_special_tokens = True
        assert encode_chat(tok, messages) == want, messages
    # a one-message conversation is the `continue` task's prompt (free chat)
    assert encode_chat(tok, [{"role": "user", "content": "Hello"}]) == encode_prompt(tok, "continue", "Hello")


CORRECTIONS = """
import { corrections } from '%s';
const cases = JSON.parse(process.argv[2]);
console.log(JSON.stringify(cases.map(([a, b]) => corrections(a, b))));
"""


def test_corrections_are_sorted_word_spans_that_rebuild_the_corrected_text(tmp_path):
    import random

    rng = random.Random(0)
    cases = [("The functon returns a new dictionery with the same keys.",
              "The function returns a new dictionary with the same keys."),
             ("i cant beleive its friday", "I can't believe it's Friday."), ("same", "same"), ("teh cat", "the cat"),
             ("Ünïcode façade naïve", "Unicode facade naive"), ("a 🍐 pear", "a 🍎 pear")]
    for _ in range(40):  # random edits of random words
        words = ["".join(rng.choice("abcde") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
        edited = [w if rng.random() < 0.6 else "".join(rng.choice("abcdef ,") for _ in range(rng.randint(0, 6)))
                  for w in words]
        cases.append((" ".join(words), " ".join(edited)))
    script = tmp_path / "corrections.mjs"
    script.write_text(CORRECTIONS % (ROOT / "web" / "src" / "corrections.mjs").as_uri())
    run = subprocess.run(["node", str(script), json.dumps(cases)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for (a, b), found in zip(cases, json.loads(run.stdout)):
        units = a.encode("utf-16-le")  # the indices are JavaScript's: UTF-16 code units
        piece = lambda i, j: units[2 * i:2 * j].decode("utf-16-le")  # noqa: E731 (never half a pair: decode checks)
        rebuilt, at = "", 0
        for c in found:
            assert at <= c["startIndex"] <= c["endIndex"] <= len(units) // 2, (a, b, found)  # sorted, disjoint, inside
            rebuilt += piece(at, c["startIndex"]) + c["correction"]
            at = c["endIndex"]
        assert rebuilt + piece(at, len(units) // 2) == b, (a, b, found)
    assert [(c["startIndex"], c["endIndex"], c["correction"]) for c in json.loads(run.stdout)[0]] == \
        [(4, 11, "function"), (26, 36, "dictionary")]


# ---------------------------------------------------------------- the tiny model: mechanics, and WebGPU

@pytest.fixture(scope="module")
def tiny_page(browser, tiny_url):
    """api.html on WASM with the models created (one page for the mechanics' tests)."""
    p = ApiPage(browser, tiny_url, "?backend=wasm")
    p.click()
    p.run("() => Summarizer.create()")
    yield p
    assert p.errors == [], f"the page logged errors: {p.errors}"
    p.close()


def test_ai_mjs_installs_the_four_apis_and_says_which_is_in_use(tiny_page):
    shape = tiny_page.run("""() => Object.fromEntries(['Summarizer', 'Proofreader', 'Writer', 'LanguageModel'].map((name) => {
      const api = globalThis[name];
      const methods = [];
      for (let p = api.prototype; p !== EventTarget.prototype; p = Object.getPrototypeOf(p)) methods.push(...Object.getOwnPropertyNames(p));
      return [name, {statics: ['availability', 'create'].filter((f) => typeof api[f] === 'function'), methods,
                     ...frozenMTPAI.apis[name]}];
    }))""")
    for name, api in shape.items():
        assert api["statics"] == ["availability", "create"], (name, api)
        assert api["implementation"] == "frozen-mtp", (name, api)  # Debian's headless Chromium: none that works
    assert {"summarize", "summarizeStreaming", "measureInputUsage", "destroy"} <= set(shape["Summarizer"]["methods"])
    assert {"write", "writeStreaming", "measureInputUsage", "destroy"} <= set(shape["Writer"]["methods"])
    assert {"proofread", "destroy"} <= set(shape["Proofreader"]["methods"])
    assert {"prompt", "promptStreaming", "append", "clone", "measureContextUsage", "contextUsage", "contextWindow",
            "destroy"} <= set(shape["LanguageModel"]["methods"])
    # Debian's Chromium defines LanguageModel and Summarizer itself, without a model service: they were replaced
    assert "unavailable" in shape["LanguageModel"]["why"] or "fails" in shape["LanguageModel"]["why"], shape


def test_availability_follows_cache_storage_and_create_reports_the_download(browser, tiny_url):
    page = ApiPage(browser, tiny_url, "?backend=wasm")
    try:
        assert page.run("() => Summarizer.availability()") == "downloadable"
        assert page.run("() => Summarizer.availability({type: 'key-points'})") == "unavailable"
        assert page.run("() => Writer.availability({outputLanguage: 'fr'})") == "unavailable"
        errors = page.run("""async () => {
          const name = (p) => p.then(() => 'resolved', (e) => `${e.constructor.name} ${e.name}`);
          // Playwright's evaluate counts as a user gesture: wait until its transient activation has expired (5 s)
          await new Promise((resolve) => { setTimeout(resolve, 5500); });
          return {active: navigator.userActivation.isActive, gesture: await name(Proofreader.create()),
                  options: await name(Summarizer.create({type: 'headline'})),
                  aborted: await name(Writer.create({signal: AbortSignal.abort()}))};
        }""")
        assert errors == {"active": False, "gesture": "DOMException NotAllowedError", "options": "DOMException NotSupportedError",
                          "aborted": "DOMException AbortError"}, errors
        page.click()
        events = page.run("""async () => {
          const events = [];
          const states = [];
          const created = Summarizer.create({monitor(m) {
            m.addEventListener('downloadprogress', (e) => events.push([e.loaded, e.total, e.constructor.name]));
          }});
          await new Promise((r) => setTimeout(r, 50));
          states.push(await Writer.availability());
          await created;
          states.push(await Writer.availability());
          return {events, states};
        }""")
        loaded = [e[0] for e in events["events"]]
        assert loaded[0] == 0 and loaded[-1] == 1 and len(loaded) > 3, loaded
        assert all(a < b for a, b in zip(loaded, loaded[1:])), "progress is not monotonic"
        assert all(e[1] == 1 and e[2] == "ProgressEvent" and float(e[0] * 65536).is_integer() for e in events["events"]), events
        assert events["states"] == ["downloading", "available"], events
        # a second page of the same profile: the files are in Cache Storage, before any create()
        again = ApiPage(browser, tiny_url, "?backend=wasm", context=page.context)
        assert again.run("() => LanguageModel.availability()") == "available"
        assert again.run("() => Proofreader.create().then(() => 'created')") == "created"  # no gesture needed now
        assert page.errors == [] and again.errors == []
    finally:
        page.close()


@pytest.mark.parametrize("backend", ["wasm", "webgpu"])
def test_every_api_call_writes_the_torch_reference_tokens_on_the_tiny_model(browser, tiny_url, chat_tiny, tiny_models, backend):
    page = ApiPage(browser, tiny_url, f"?backend={backend}")
    try:
        page.click()
        out = page.run(ALL_APIS, {"n": 12 if backend == "wasm" else 6, "texts": TEXTS})
        decodes = page.decodes()
        assert {d["backend"] for d in decodes} == {backend}
        tok = load_tokenizer(chat_tiny.base)
        near_ties = check_exact(tiny_models, all_api_calls(tok, out), decodes)
        print(f"tiny model, {backend}: {len(decodes)} API calls exact, {near_ties} near-ties, "
              f"{sum(len(d['ids']) for d in decodes)} tokens")
        assert out["summary"] == decodes[0]["text"] and out["reply"] == decodes[2]["text"]
        assert out["proofread"]["correctedInput"] == decodes[1]["text"].strip()
        rebuilt, at = "", 0  # the corrections turn the input into the corrected input
        for c in out["proofread"]["corrections"]:
            rebuilt += TEXTS["proofread"][at:c["startIndex"]] + c["correction"]
            at = c["endIndex"]
        assert rebuilt + TEXTS["proofread"][at:] == out["proofread"]["correctedInput"], out["proofread"]
        assert page.errors == []
    finally:
        page.close()


def test_streams_yield_whole_characters_as_steps_are_accepted(tiny_page):
    got = tiny_page.run("""async () => {
      const writer = await Writer.create({maxNewTokens: 40});
      const chunks = [];
      for await (const chunk of writer.writeStreaming('Tell me about émojis 🍐 and 日本語, please.')) chunks.push(chunk);
      const decode = frozenMTPAI.decodes.at(-1);
      const lm = await LanguageModel.create({maxNewTokens: 12});
      const chat = [];
      for await (const chunk of lm.promptStreaming('Hello there!')) chat.push(chunk);
      return {chunks, decode, chat, chatText: frozenMTPAI.decodes.at(-1).text, history: lm.history.at(-1).content};
    }""")
    assert "".join(got["chat"]) == got["chatText"] == got["history"] and len(got["chat"]) > 1, got
    chunks, decode = got["chunks"], got["decode"]
    assert "".join(chunks) == decode["text"], "the chunks do not add up to the text"
    assert 1 < len(chunks) <= decode["steps"], f"{len(chunks)} chunks from {decode['steps']} steps"
    for c in chunks:  # whole characters: no half of a surrogate pair, no undecided UTF-8 bytes at a chunk's end
        assert c == c.encode("utf-16", "surrogatepass").decode("utf-16", "strict") and not c.endswith("\ufffd"), chunks
        c.encode("utf-8")  # a lone surrogate would raise here
    tiny_page.decodes()


def test_abort_stops_a_stream_mid_way_and_frees_the_run(tiny_page):
    got = tiny_page.run("""async () => {
      const summarizer = await Summarizer.create({maxNewTokens: 200});
      const controller = new AbortController();
      const reader = summarizer.summarizeStreaming('A long text to summarize. '.repeat(4), {signal: controller.signal}).getReader();
      const first = await reader.read();
      controller.abort();
      const after = await reader.read().then(() => 'read', (e) => e.name);
      const t0 = performance.now();
      const next = await summarizer.summarize('Another text.', {context: ''});  // the same model, usable again
      const decodes = frozenMTPAI.decodes.splice(0);
      // an aborted prompt adds nothing to the conversation
      const lm = await LanguageModel.create({maxNewTokens: 150});
      const usage = lm.contextUsage;
      const stop = new AbortController();
      const chat = lm.promptStreaming('Tell me a long story.', {signal: stop.signal}).getReader();
      await chat.read();
      stop.abort();
      const chatAfter = await chat.read().then(() => 'read', (e) => e.name);
      await lm.measureContextUsage('x');  // queued behind the aborted prompt: runs once its decode ended
      return {first: first.value, after, next, ms: performance.now() - t0, decodes, chatAfter,
              history: lm.history.length, usage: [usage, lm.contextUsage], chatDecode: frozenMTPAI.decodes.splice(0)[0]};
    }""")
    assert got["first"] and got["after"] == got["chatAfter"] == "AbortError", got
    assert got["chatDecode"]["stopped"] == "stopped" and got["history"] == 0 and got["usage"][0] == got["usage"][1], got
    stopped, nxt = got["decodes"]
    assert stopped["stopped"] == "stopped" and len(stopped["ids"]) < 200, stopped  # ended after the running step
    assert nxt["start"] >= stopped["end"] and got["next"] == nxt["text"]


def test_concurrent_calls_are_queued_never_interleaved(tiny_page):
    got = tiny_page.run("""async () => {
      const [a, b] = await Promise.all([Summarizer.create({maxNewTokens: 10}), Writer.create({maxNewTokens: 10})]);
      const together = await Promise.all([a.summarize('First text.'), b.write('Second text.'), a.summarize('Third text.')]);
      const decodes = frozenMTPAI.decodes.splice(0);
      const alone = [await a.summarize('First text.'), await b.write('Second text.'), await a.summarize('Third text.')];
      frozenMTPAI.decodes.splice(0);
      return {together, alone, decodes};
    }""")
    assert got["together"] == got["alone"]
    spans = sorted((d["start"], d["end"]) for d in got["decodes"])
    assert len(spans) == 3 and all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans


def test_destroy_and_misuse_reject_with_the_specs_dom_exceptions(tiny_page):
    got = tiny_page.run("""async () => {
      const name = (p) => Promise.resolve().then(p).then(() => 'resolved', (e) => `${e instanceof DOMException ? 'DOMException' : e.constructor.name} ${e.name}`);
      const s = await Summarizer.create({maxNewTokens: 100});
      const running = name(() => s.summarize('Some text to summarize, at length.'));
      await new Promise((r) => setTimeout(r, 30));
      s.destroy();
      const lm = await LanguageModel.create();
      const controller = new AbortController();
      const w = await Writer.create({signal: controller.signal});
      controller.abort();  // after create: the same as destroy()
      return {
        inFlight: await running,
        afterDestroy: await name(() => s.summarize('More.')),
        measureAfterDestroy: await name(() => s.measureInputUsage('More.')),
        afterSignal: await name(() => w.write('Hello.')),
        tooLong: await name(() => lm.prompt('word '.repeat(400))),
        tooLongSummary: await name(() => Summarizer.create().then((x) => x.summarize('word '.repeat(400)))),
        image: await name(() => lm.prompt([{role: 'user', content: [{type: 'image', value: new Blob()}]}])),
        system: await name(() => lm.prompt([{role: 'system', content: 'Late.'}])),
        sampling: await name(() => LanguageModel.create({topK: 3, temperature: 0.7})),
        constraint: await name(() => lm.prompt('Hi', {responseConstraint: {type: 'object'}})),
        tone: await name(() => Writer.create({tone: 'formal'})),
        types: await name(() => Proofreader.create({includeCorrectionTypes: true})),
        empty: await Summarizer.create().then((x) => x.summarize('   ')),
      };
    }""")
    tiny_page.decodes()
    assert got == {"inFlight": "DOMException AbortError", "afterDestroy": "DOMException AbortError",
                   "measureAfterDestroy": "DOMException AbortError", "afterSignal": "DOMException AbortError",
                   "tooLong": "DOMException QuotaExceededError", "tooLongSummary": "DOMException QuotaExceededError",
                   "image": "DOMException NotSupportedError", "system": "TypeError TypeError",
                   "sampling": "DOMException NotSupportedError", "constraint": "DOMException NotSupportedError",
                   "tone": "DOMException NotSupportedError", "types": "DOMException NotSupportedError", "empty": ""}, got


def test_a_language_model_counts_its_context(tiny_page, chat_tiny):
    got = tiny_page.run("""async () => {
      const lm = await LanguageModel.create({initialPrompts: [{role: 'system', content: 'Be brief.'}], maxNewTokens: 6});
      const start = lm.contextUsage;
      const measured = await lm.measureContextUsage('How are you today?');
      await lm.append('How are you today?');
      const appended = lm.contextUsage;
      const clone = await lm.clone();
      await lm.prompt('And tomorrow?');
      const quota = await lm.prompt('word '.repeat(300)).catch((e) => ({name: e.name, requested: e.requested, quota: e.quota}));
      const s = await Summarizer.create({sharedContext: 'Shared.'});
      const w = await Writer.create();
      return {window: lm.contextWindow, start, measured, appended, after: lm.contextUsage, cloneUsage: clone.contextUsage,
              history: lm.history, quota, params: await LanguageModel.params(),
              summarizer: [s.inputQuota, await s.measureInputUsage('Some text.', {context: 'Today.'})],
              writer: [w.inputQuota, await w.measureInputUsage('Some text.')]};
    }""")
    tiny_page.decodes()
    tok = load_tokenizer(chat_tiny.base)
    conversation = [{"role": "system", "content": "Be brief."}]
    # a conversation's usage: the ids the next prompt reads before the new message (with the answer's opening)
    assert got["window"] == TINY_CONTEXT and got["start"] == len(encode_chat(tok, conversation))
    conversation.append({"role": "user", "content": "How are you today?"})
    assert got["appended"] == len(encode_chat(tok, conversation)) == got["start"] + got["measured"]
    assert got["cloneUsage"] == got["appended"], "a clone starts where its original was"
    assert got["after"] == len(encode_chat(tok, got["history"])) > got["appended"]
    assert got["quota"]["name"] == "QuotaExceededError" and got["quota"]["requested"] > got["quota"]["quota"] == TINY_CONTEXT - 1
    assert got["params"] == {"defaultTopK": 1, "maxTopK": 1, "defaultTemperature": 0, "maxTemperature": 0}
    # a Summarizer's or Writer's input usage: its whole prompt, the task's format and the contexts included
    assert got["summarizer"] == [TINY_CONTEXT - 1, len(encode_prompt(tok, "summarize", "Shared.\n\nToday.\n\nSome text."))]
    assert got["writer"] == [TINY_CONTEXT - 1, len(encode_prompt(tok, "reply", "Some text."))]


# a browser's own Writer that works, defined before any script of the page
WORKING_NATIVE = "globalThis.Writer = class { static async availability() { return 'available'; } };"


@pytest.mark.parametrize("query,kept", [("", True), ("?ai=replace", False)])
def test_a_browsers_own_working_api_is_kept_unless_the_page_asks(browser, tiny_url, query, kept):
    page = ApiPage(browser, tiny_url, query, init_script=WORKING_NATIVE)
    try:
        got = page.run("() => ({writer: frozenMTPAI.apis.Writer, ours: typeof Writer.prototype.writeStreaming})")
        assert (got["writer"]["implementation"] == "native") == kept and (got["ours"] == "function") != kept, got
        assert page.errors == []
    finally:
        page.close()


def test_the_api_page_uses_the_four_apis(browser, tiny_url):
    """api.html, the demo's page of the task APIs: each button's answer appears, and it says what is in use."""
    import time

    page = ApiPage(browser, tiny_url, "?backend=wasm")
    try:
        for button, output in (("#summarize", "#summary"), ("#proofread", "#proofread-output"), ("#reply", "#reply-output"),
                               ("#send", "#chat .assistant")):
            page.page.click(button)  # a real click: the first one downloads the models
            for _ in range(600):  # the page's CSP forbids wait_for_function's eval
                if page.run("([o, b]) => document.querySelector(o)?.textContent.length > 0 && !document.querySelector(b).disabled",
                            [output, button]):
                    break
                time.sleep(0.2)
            assert page.page.text_content(output), f"{button}: no answer in {output}"
        assert page.page.is_hidden("#api-message"), page.page.text_content("#api-message")
        assert "LanguageModel: this site's models" in page.page.text_content("#api-in-use")
        assert "tokens of context used" in page.page.text_content("#context-usage")
        assert page.errors == []
    finally:
        page.close()


@pytest.mark.parametrize("backend", ["wasm", "webgpu"])
def test_the_demo_page_decodes_each_feature_with_its_adapter_and_switches_back(browser, tiny_url, chat_tiny, tiny_models,
                                                                               backend):
    """index.html: every task, then the first again, each exact against its torch production model; the base's
    session is the same throughout (a feature's adapter is inputs of it) and each adapter is downloaded once."""
    page = Page(browser, tiny_url + "index.html", f"?backend={backend}")
    try:
        tok = load_tokenizer(chat_tiny.base)
        order = [*ADAPTED, "continue", ADAPTED[0]]
        text = "Can you pick up some milk on you're way home tonight?"
        calls, decodes = [], []
        for task in order:
            decodes.append(page.generate(prompt=text, task=task, mode="mtp", maxNewTokens=6 if backend == "webgpu" else 10))
            calls.append((f"{task} on the demo page", task if task in ADAPTED else None, encode_prompt(tok, task, text)))
        near_ties = check_exact(tiny_models, calls, decodes)
        fetched = [u.rsplit("/", 1)[-1] for u in page.requests if "adapter." in u]
        assert sorted(fetched) == sorted(f"adapter.{t}.safetensors" for t in ADAPTED), fetched
        assert decodes[0]["ids"] == decodes[-1]["ids"], "switching back to a feature changed its answer"
        print(f"tiny model, demo page on {backend}: {len(decodes)} features exact, {near_ties} near-ties")
        assert page.errors == []
    finally:
        page.close()


# ---------------------------------------------------------------- SmolLM2 and its shipped head

@pytest.mark.slow
def test_every_api_call_on_smollm2_writes_the_torch_reference_tokens_on_wasm(browser, smol_url, smol_models):
    page = ApiPage(browser, smol_url, "?backend=wasm")
    try:
        page.click()
        out = page.run(ALL_APIS, {"n": 8, "texts": TEXTS})
        decodes = page.decodes()
        near_ties = check_exact(smol_models, all_api_calls(load_tokenizer(SMOL), out), decodes)
        accepted = sum(sum(d["accepted"]) for d in decodes)
        print(f"SmolLM2, wasm: {len(decodes)} API calls exact, {near_ties} near-ties, "
              f"{sum(len(d['ids']) for d in decodes)} tokens, {accepted} drafts accepted in {sum(d['steps'] for d in decodes)} steps")
        assert accepted > 0, "MTP accepted no draft: the head is not in use"
        assert page.errors == []
    finally:
        page.close()


FRAMES_WHILE_STREAMING = """async (text) => {
  const summarizer = await Summarizer.create({type: 'tldr', length: 'short', maxNewTokens: 24});
  await summarizer.summarize('Warm up.');  // sessions open, kernels compiled: the stream below is decoding only
  let frames = 0;
  let streaming = true;
  const tick = () => { frames += 1; if (streaming) requestAnimationFrame(tick); };
  const chunks = [];
  const t0 = performance.now();
  requestAnimationFrame(tick);
  for await (const chunk of summarizer.summarizeStreaming(text)) chunks.push(chunk);
  streaming = false;
  const ms = performance.now() - t0;
  return {fps: frames / (ms / 1000), ms, frames, chunks: chunks.length, decode: frozenMTPAI.decodes.at(-1)};
}"""


@pytest.mark.slow
def test_the_page_keeps_50_frames_per_second_while_a_summary_streams(browser, smol_url):
    page = ApiPage(browser, smol_url, "?backend=wasm")
    try:
        page.click()
        got = page.run(FRAMES_WHILE_STREAMING, TEXTS["summarize"])
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "frames.json").write_text(json.dumps({k: got[k] for k in ("fps", "ms", "frames", "chunks")}) + "\n")
        print(f"SmolLM2 on WASM in a worker: {got['fps']:.1f} frames/s on the main thread over {got['ms']:.0f} ms "
              f"while {len(got['decode']['ids'])} tokens streamed in {got['chunks']} chunks")
        assert got["chunks"] > 1 and got["ms"] > 500, got
        assert got["fps"] >= 50, f"{got['fps']:.1f} frames/s while a summary streamed"
        assert page.errors == []
    finally:
        page.close()


@pytest.mark.slow
def test_an_api_call_on_smollm2_writes_the_torch_reference_tokens_on_webgpu(browser, smol_url, smol_models):
    """SwiftShader emulates the GPU on the CPU (a pass of SmolLM2 takes seconds): one call, few tokens, q4."""
    page = ApiPage(browser, smol_url, "?backend=webgpu")
    try:
        page.click()
        text = "Teh cat sat."
        out = page.run("""async (text) => (await Proofreader.create({maxNewTokens: 3})).proofread(text)""", text)
        decodes = page.decodes()
        assert decodes[0]["backend"] == "webgpu" and decodes[0]["precision"] == "q4", decodes
        near_ties = check_exact(smol_models, [("Proofreader.proofread", "proofread", encode_prompt(load_tokenizer(SMOL), "proofread", text))],
                                decodes)
        print(f"SmolLM2, webgpu q4: 1 API call exact, {near_ties} near-ties, {len(decodes[0]['ids'])} tokens: {out}")
        assert page.errors == []
    finally:
        page.close()
