"""The bench's native peer: llama.cpp on the CPU, on the very GGUF file our base is imported from.

Beside wllama (llama.cpp in WebAssembly, builder/bench/peers.py), this is the same llama.cpp native, next to
our onnx-cpu figures. It runs through node-llama-cpp's prebuilt linux-x64 binary (@node-llama-cpp/linux-x64):
llama-cpp-python has no wheel here, and node-llama-cpp ships llama.cpp built, so nothing is compiled. It is a
bench-only dependency in its own npm project, bench/native/ (not web/: the site's packages stay small), whose
install leaves out node-llama-cpp's optional CUDA, Vulkan and other platforms' binaries; the script never
downloads or builds anything (getLlama with build "never").

bench/native/llamacpp.mjs decodes greedily from the prompt's token ids as given (no chat template, no BOS
added), one prompt after another, with the given thread count, and times as peers.py does: prefill_ms until
the first new token, decode_ms from there to the last, tokens_per_s = (new tokens - 1) / decode seconds;
llama.cpp's own timings (llama_perf_context) come along under "timings". Decoding stops after n_predict tokens
or after the end-of-sequence token, which `ids` keeps, as the PyTorch reference does.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from .peers import ROOT, Threads, base_gguf, judge, references

NATIVE_DIR = ROOT / "bench" / "native"
SCRIPT = NATIVE_DIR / "llamacpp.mjs"
INSTALL = "cd bench/native && npm install --ignore-scripts --omit=optional --no-save --no-audit --no-fund"
PACKAGES = ("node-llama-cpp", "@node-llama-cpp/linux-x64")


def max_threads() -> int:
    """What "max" means here, as for the page (web/src/runtime.mjs): one thread per core, at most 4."""
    return min(4, os.cpu_count() or 1)


def run_llamacpp(prompts: list[list[int]], n_predict: int, threads: Threads = 1, gguf: Path | None = None,
                 warmup: bool = True, timeout_s: float = 600) -> dict:
    """llama.cpp (node-llama-cpp's prebuilt CPU binary) in a fresh node process: loads the GGUF with `threads`
    threads and decodes n_predict tokens greedily after each prompt (lists of token ids, as given). A warm-up
    run of the first prompt (4 tokens) goes first unless warmup is False.
    Returns {"llamacpp_info": {...}, "results": [peers.PeerResult with prompt_tokens]}."""
    missing = [p for p in PACKAGES if not (NATIVE_DIR / "node_modules" / p / "package.json").is_file()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} not installed in {NATIVE_DIR}: {INSTALL}")
    node = shutil.which("node")
    if node is None:
        raise FileNotFoundError("node is not on PATH (apt-get install nodejs npm)")
    n_threads = max_threads() if threads == "max" else int(threads)
    cmd = [node, str(SCRIPT), "--model", str(gguf or base_gguf()), "--n-predict", str(n_predict),
           "--threads", str(n_threads)] + ([] if warmup else ["--no-warmup"])
    r = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True, cwd=NATIVE_DIR,
                       timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"llamacpp.mjs failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def bench_llamacpp(n_per_task: int = 3, new_tokens: int = 24, threads: tuple[Threads, ...] = (1, "max"),
                   model_dir: Path = ROOT / "models" / "base") -> dict:
    """llama.cpp native on n_per_task validation prompts of each task (chat-formatted by the project's
    tokenizer), at each thread count, against the PyTorch reference's greedy ids (docs/contract.md's exactness
    rule): bench_wllama's prompts, new tokens and verdicts."""
    prompts, ids, refs = references(model_dir, n_per_task, new_tokens)
    return {"new_tokens": new_tokens, "runs": [judge(run_llamacpp(ids, new_tokens, t), prompts, refs) for t in threads]}


if __name__ == "__main__":  # python -m builder.bench.native > llamacpp.json
    print(json.dumps(bench_llamacpp(), indent=1))
