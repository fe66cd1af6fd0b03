"""The bench's transformers.js peer: SmolLM2 in @huggingface/transformers, in the same headless Chromium.

transformers.js (4.3.1, bench/transformersjs/package.json: bench-only, never in the site) runs a local
ONNX export of the project's base (hf_onnx.py: fp32, exported from models/llama.py, so its greedy tokens
should equal the PyTorch reference's up to float rounding) on onnxruntime-web's WASM backend with the
same threads as our page (1, or the page's max). In fp32 it computes the same values as our fp32 page: a
peer for the runtime. Its users on WASM load 8-bit weights by default, or 4-bit ones (dtype "q8", "q4":
the peers transformersjs-q8 and transformersjs-q4, hf_onnx's quantized graphs): the peer at its fastest.

Timed in the page as peers.py's wllama: prefill_ms is the call until the first new token, decode_ms from
there to the last, tokens_per_s = (new tokens - 1) / decode seconds; the same PeerResult, "timings" None.

The harness serves web/peers/, the package's self-contained browser build (dist/transformers.js, which
bundles onnxruntime-web's JavaScript), the onnxruntime-web WebAssembly binary of the version it bundles,
and the export, from a temporary folder on 127.0.0.1 with serve.py's handler (COOP/COEP: WASM threads).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..site.browser import chromium
from .hf_onnx import MODEL_ID, export_hf_onnx
from .peers import PEERS_DIR, ROOT, Threads, decode_all, judge, peer_page, references, serving

PACKAGE_DIR = ROOT / "bench" / "transformersjs"  # its own npm project: `npm ci` there (.ci/setup)
TRANSFORMERS_DIR = PACKAGE_DIR / "node_modules" / "@huggingface" / "transformers"
WASM = "ort-wasm-simd-threaded.asyncify.wasm"  # the onnxruntime-web build transformers.js loads by default
SMOL_DIR = ROOT / "models" / "base"


def transformersjs_version() -> str:
    return json.loads((TRANSFORMERS_DIR / "package.json").read_text())["version"]


def onnxruntime_web_dir() -> Path:
    """The onnxruntime-web package whose version transformers.js bundles."""
    wanted = json.loads((TRANSFORMERS_DIR / "package.json").read_text())["dependencies"]["onnxruntime-web"]
    for d in (TRANSFORMERS_DIR / "node_modules" / "onnxruntime-web", PACKAGE_DIR / "node_modules" / "onnxruntime-web"):
        if (d / "package.json").is_file() and json.loads((d / "package.json").read_text())["version"] == wanted:
            return d
    raise FileNotFoundError(f"onnxruntime-web {wanted} (the one transformers.js bundles) is missing: cd bench/transformersjs && npm ci")


@contextmanager
def serve_transformersjs(model_root: Path | None = None) -> Iterator[str]:
    """web/peers/'s transformers.js page, the package's browser build, its WASM binary and the export
    (model_root/<MODEL_ID>/, hf_onnx's; exported or found in build/ when None) on a free port of
    127.0.0.1; yields the URL of transformersjs.html. Large files are linked, not copied."""
    build = TRANSFORMERS_DIR / "dist" / "transformers.js"
    if not build.is_file():
        raise FileNotFoundError(f"{build} is missing: cd bench/transformersjs && npm ci")
    wasm = onnxruntime_web_dir() / "dist" / WASM
    model_root = model_root or export_hf_onnx(SMOL_DIR)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        root = Path(tmp)
        for name in ("transformersjs.html", "transformersjs.mjs"):
            shutil.copyfile(PEERS_DIR / name, root / name)
        (root / "transformers").mkdir()
        (root / "models").mkdir()
        os.symlink(build, root / "transformers" / "transformers.js")
        os.symlink(wasm, root / "transformers" / WASM)
        os.symlink(Path(model_root).resolve() / MODEL_ID, root / "models" / MODEL_ID)
        with serving(root) as url:
            yield url + "transformersjs.html"


DTYPES = {"transformersjs": "fp32", "transformersjs-q8": "q8", "transformersjs-q4": "q4"}  # contract.PEERS' names


@contextmanager
def transformersjs_page(browser, threads: Threads = 1, model_root: Path | None = None, timeout_ms: float = 600_000,
                        dtype: str = "fp32"):
    """transformers.js loaded in a fresh page of `browser` (a Playwright Browser) with the export's dtype weights
    and `threads` WASM threads: peers.peer_page's (generate, info). A request off 127.0.0.1 (a hub, a CDN) fails it."""
    def offsite(page, errors):  # nothing from a hub or a CDN: every http(s) request stays on the server
        page.on("request", lambda r: r.url.startswith("http") and not r.url.startswith(origin)
                and errors.append(f"a request off 127.0.0.1: {r.url}"))

    with serve_transformersjs(model_root) as url:
        origin = url.rsplit("/", 1)[0] + "/"
        with peer_page(browser, url, "transformers.js", threads, timeout_ms, offsite, {"dtype": dtype}) as (generate, info):
            yield generate, {**info, "package_version": transformersjs_version()}


def run_transformersjs(browser, prompts: list[list[int]], n_predict: int, threads: Threads = 1,
                       model_root: Path | None = None, warmup: bool = True, timeout_ms: float = 600_000,
                       dtype: str = "fp32") -> dict:
    """transformersjs_page's generate: up to n_predict greedy tokens after each prompt (lists of token ids,
    as given: no BOS added; the end token stops it), one prompt after another. A warm-up run of the first
    prompt (4 tokens) goes first unless warmup is False. Returns {"transformersjs_info": {...}, "results": [PeerResult]}."""
    with transformersjs_page(browser, threads, model_root, timeout_ms, dtype) as (generate, info):
        return {"transformersjs_info": info, "results": decode_all(generate, prompts, n_predict, warmup)}


def bench_transformersjs(n_per_task: int = 3, new_tokens: int = 24, threads: tuple[Threads, ...] = (1, "max"),
                         model_dir: Path = SMOL_DIR) -> dict:
    """transformers.js on n_per_task validation prompts of each task (chat-formatted by the project's
    tokenizer), at each thread count, against the PyTorch reference's greedy ids (docs/contract.md's exactness rule)."""
    prompts, ids, refs = references(model_dir, n_per_task, new_tokens)
    model_root = export_hf_onnx(model_dir)
    with chromium() as browser:
        return {"new_tokens": new_tokens, "runs": [judge(run_transformersjs(browser, ids, new_tokens, t, model_root),
                                                         prompts, refs) for t in threads]}


if __name__ == "__main__":  # python -m builder.bench.transformersjs > tjs.json
    print(json.dumps(bench_transformersjs(), indent=1))
