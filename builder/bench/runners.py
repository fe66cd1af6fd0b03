"""The bench's runtimes (run.py): how each runs one prompt, and what only the page can tell.

A runner is run(prompt_ids, text, task, mode, k, n) -> (Decoded, the whole call's seconds): the Python
runtimes (torch, onnx-cpu: the feature's production model, the export's graphs with its adapter) and the
page's window.frozenMTP.generate in a browser runtime. Beside them: the peers' pages, the page's WebGPU
dispatch counts and its trace's profile, and a phone's first visit.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from ..contract import DEFAULT_LOOKUP, MODES
from ..decode.drafter import load_drafter, torch_drafter
from ..decode.loop import Decoded, decode
from ..decode.onnx_backend import OnnxBackend
from ..decode.torch_backend import TorchBackend
from ..export.manifest import Checkpoints, ensure_export
from ..models.head import load_head
from ..models.llama import Llama
from .hf_onnx import export_hf_onnx
from .measure import Plan, modes
from .peers import wllama_page
from .transformersjs import DTYPES, transformersjs_page


# what each browser runtime asks of the page: browser-wasm runs as many WASM threads as the page picks
# for this machine (one per core, at most 4), browser-wasm-1thread one
PAGE_QUERY = {"browser-wasm": "?backend=wasm", "browser-wasm-1thread": "?backend=wasm&threads=1",
              "browser-webgpu": "?backend=webgpu"}

# the peers (see above) and their runtimes are contract.PEERS, each with the threads it gets: as many as the
# page's browser-wasm picks ("max": one per core, at most 4) and one, as browser-wasm-1thread.
# The browser runtimes whose rounds the browser peers with the same threads run in (measure())
PEER_THREADS = {"browser-wasm": "max", "browser-wasm-1thread": 1}

def open_peer(name: str, browser, threads, base_dir: Path):
    """A browser peer's page, loaded: a context manager giving (generate, info) (peers.peer_page)."""
    if name == "wllama":
        return wllama_page(browser, threads)

    return transformersjs_page(browser, threads, export_hf_onnx(base_dir), dtype=DTYPES[name])

def python_runner(runtime: str, ckpts: Checkpoints, onnx_dir: Path, models: dict[str | None, Llama]):
    """The runner of a Python runtime and, for onnx-cpu, a function giving where a step's time went
    ({"base T=5": {"median_ms", "runs"}, "head k=4": ..}; None for torch). models: production_models(ckpts)."""
    eos = models[None].config.eos_token_id
    made = {}  # (mode, k, adapter) -> the ONNX backend running it (the head's graph depends on k)
    if runtime == "torch":
        head = load_head(ckpts.head, models[None])
        drafter = load_drafter(ckpts.drafter, models[None]) if ckpts.drafter else None
        backends = {"ar": lambda m: TorchBackend(m), "mtp": lambda m: TorchBackend(m, head=head),
                    "drafter": lambda m: TorchBackend(m, drafter=torch_drafter(drafter))}
    else:
        ensure_export(ckpts, onnx_dir, ("fp32",))

    def backend_for(task, mode, k):
        if runtime == "torch":  # a fresh drafter state per decode, as the page has
            return backends[mode](models.get(task, models[None]))
        adapter = task if task in models else None
        if (mode, k, adapter) not in made:
            made[mode, k, adapter] = OnnxBackend(onnx_dir, MODES[mode], k, adapter=adapter)
        return made[mode, k, adapter]

    def run(prompt_ids, text, task, mode, k, n):
        backend = backend_for(task, mode, k)
        t0 = time.perf_counter()
        out = decode(backend, prompt_ids, n, eos, k, lookup=DEFAULT_LOOKUP)
        return out, time.perf_counter() - t0

    if runtime == "torch":
        return run, None

    def profile() -> dict:
        """The median wall time of each kind of graph run over the whole measurement, all modes pooled."""
        seconds = {}
        for b in made.values():
            for what, s in b.run_seconds.items():
                seconds.setdefault(what, []).extend(s)
        return {what: {"median_ms": round(statistics.median(s) * 1000, 4), "runs": len(s)}
                for what, s in sorted(seconds.items(), key=lambda i: (i[0].split()[0], int(i[0].split("=")[1])))}

    return run, profile

def page_generate(page, text: str, task: str, mode: str, k: int, n: int, trace: bool = False) -> dict:
    """The page's frozenMTP.generate (docs/contract.md) on one prompt; k and lookup are ignored in mode "ar"."""
    return page.evaluate("(o) => window.frozenMTP.generate(o)", {
        "prompt": text, "task": task, "mode": mode, "k": max(k, 1), "lookup": DEFAULT_LOOKUP, "maxNewTokens": n,
        "trace": trace})

def browser_runner(page):
    def run(prompt_ids, text, task, mode, k, n):
        r = page_generate(page, text, task, mode, k, n)
        if r["promptIds"] != prompt_ids:
            raise RuntimeError(f"the page encodes {text!r} differently from Python")
        return Decoded(ids=r["ids"], steps=r["steps"], accepted=r["accepted"], lookups=r["lookups"],
                       verified=r["verified"], prefill_seconds=r["prefillMs"] / 1000), r["ms"] / 1000

    return run

def count_dispatches(page, prompts: dict, ks) -> dict:
    """On WebGPU, per task: compute dispatches and session runs per decode step (prefill left out) of plain
    decoding and of MTP at each k, from the page's trace of one prompt's first 8 new tokens."""
    out = {}
    for task, items in prompts.items():
        _, text = items[0]
        out[task] = {}
        for mode, k in [("ar", 0)] + [("mtp", k) for k in ks]:
            r = page_generate(page, text, task, mode, k, 8, trace=True)
            runs = r["trace"][1:]  # the first run is the prefill
            # a step: one base run, and in mode mtp one head run where prompt lookup did not draft (and the last
            # step may skip drafting): the mean over this decode's steps
            out[task]["plain" if mode == "ar" else f"mtp k={k}"] = {
                "k": k, "steps": r["steps"], "runs_per_step": round(len(runs) / r["steps"], 2),
                "dispatches_per_step": round(sum(t["dispatches"] for t in runs) / r["steps"], 1)}
    return out

def page_profile(page, prompts: dict, plan: Plan) -> dict:
    """Where a step's time goes in the page (browser-wasm): the median wall time of each kind of graph run
    ("base T=5", "head k=4", "drafter T=1", as onnx-cpu's profile), from the page's trace of every mode over
    the plan's prompts and tokens, once."""
    seconds = {}
    for task, items in prompts.items():
        for _, text in items[: plan.prompts]:
            for mode, k in modes(plan):
                r = page_generate(page, text, task, mode, k, plan.new_tokens, trace=True)
                for run in r["trace"]:
                    graph = run["graph"]
                    what = (f"head k={k}" if graph.startswith("head")
                            else f"{graph} T={run['inputs']['input_ids']['dims'][1]}")
                    seconds.setdefault(what, []).append(run["ms"] / 1000)
    return {what: {"median_ms": round(statistics.median(s) * 1000, 4), "runs": len(s)}
            for what, s in sorted(seconds.items(), key=lambda i: (i[0].split()[0], int(i[0].split("=")[1])))}

def first_visit(browser, url: str, mbps: float = 9.0, latency_ms: float = 40.0) -> dict:
    """A phone's first visit and its second (same browser profile), on a throttled network (CDP's network
    emulation): bytes fetched, and seconds from opening the page (WASM) to the first token of an MTP
    generation."""
    context = browser.new_context()
    visits = []
    try:
        for _ in range(2):
            page = context.new_page()
            cdp = context.new_cdp_session(page)
            cdp.send("Network.enable")
            cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": latency_ms,
                                                           "downloadThroughput": mbps * 1e6 / 8,
                                                           "uploadThroughput": mbps * 1e6 / 8})
            sizes = []
            page.on("requestfinished", lambda r: sizes.append(max(0, r.sizes()["responseBodySize"])))
            t0 = time.perf_counter()
            page.goto(url + "?backend=wasm")
            page.evaluate("window.frozenMTP.generate({prompt: 'The list', mode: 'mtp', maxNewTokens: 1})")
            visits.append({"bytes": sum(sizes), "requests": len(sizes),
                           "seconds_to_first_token": round(time.perf_counter() - t0, 2)})
            page.close()
    finally:
        context.close()
    return {"network": f"{mbps:g} Mbps, {latency_ms:g} ms", "first": visits[0], "second": visits[1]}

def modelled_speedups(dispatches: dict, results: list[dict]) -> None:
    """tau x dispatches(plain step) / dispatches(MTP step): the speedup on a GPU that spends its time per
    dispatch. tau is this run's, from the runtime that measured the most prompts x tokens."""
    for task, rows in dispatches.items():
        for row in rows.values():
            if not row["k"]:
                continue
            taus = [r for r in results if (r["task"], r["mode"], r["k"]) == (task, "mtp", row["k"])]
            if not taus:
                continue
            best = max(taus, key=lambda r: r["prompts"] * r["new_tokens"])
            row.update(tau=best["tau"], tau_from=best["runtime"], modelled_speedup=round(
                best["tau"] * rows["plain"]["dispatches_per_step"] / row["dispatches_per_step"], 2))
