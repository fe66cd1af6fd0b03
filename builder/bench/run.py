"""`bench`: plain vs MTP vs the independent drafter, side by side, in one run.

Runtimes: `torch` (the PyTorch modules), `onnx-cpu` (the exported graphs with onnxruntime, one thread),
`browser-wasm`, `browser-wasm-1thread` and `browser-webgpu` (the built site in headless Chromium, through
window.frozenMTP; browser-wasm with the WASM threads the page picks, browser-wasm-1thread with one).
For every runtime: a warm-up, then `repeats` rounds; each round runs every (task, mode, k) over the same
validation prompts (reply: held-back real messages, data/messages.py), interleaved, so that drift in the
machine's speed touches every mode alike.
tokens/s = new tokens / decode seconds over all prompts of a round; the table gives the median round
and the spread (min-max) over rounds. "decode_tokens_per_s" leaves out the prefill (the base reading the
prompt: the same pass in every mode, and most of a summary's time at these lengths): new tokens / seconds
after it, which is the speed at which text streams once it starts; the drafter's own prefill falls inside
it, as it should. "prefill_share" is the prefill's share of the whole time (median over rounds), and
"mean_new_tokens" the tokens a prompt produced (fewer than asked where the base ends its output): plain
decoding's 1 / prefill_share is the most any draft source could reach over the whole generation, were its
decoding free. Every output is checked against the torch reference with
CONTRACT.md's exactness rule and the mismatches counted. For onnx-cpu the JSON also has "profile": the
median wall time of each kind of graph run ("base T=5": the base fed 5 tokens, "head k=4": the head
drafting 4, "drafter T=1"), pooled over every round, from which the report shows where a step's time goes;
the browser-wasm runtimes get the same profile from the page's own trace of each run (one more pass).

Peers (`peers`, a base imported from a GGUF): the same model in the runtimes a user would pick instead,
on the very GGUF file, plain greedy decoding from the same prompts' token ids in the same run: wllama and
transformers.js in the same headless Chromium (WASM with the page's threads, and one), llama.cpp native
beside onnx-cpu (peers.py, transformersjs.py, native.py). Their rows are in "peers", timed as ours:
tokens/s over the whole call, decode_tokens_per_s after the first token (their prefill), checked against
the same reference. A browser peer with the WASM threads of a browser runtime being measured is loaded in
its own page beside ours and runs inside that runtime's rounds ("interleaved_with"), so that each round's
MTP / peer ratio compares runs made minutes, not a quarter of an hour, apart; the others run after, in
rounds of their own.

SwiftShader (the CI's WebGPU) emulates a GPU on the CPU at about 1 s a base run, so browser-webgpu runs
fewer prompts, tokens and k by default: it shows the page works on WebGPU, not GPU speed. What it does
count is the GPU regime: "webgpu_dispatches" holds, per task, the WebGPU compute dispatches and session
runs per decode step of plain decoding and MTP (counted at the WebGPU API in the page), and the modelled
speedup tau x dispatches(plain step) / dispatches(MTP step) of a GPU that spends its time per dispatch.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..contract import DEFAULT_LOOKUP, MODES, PEERS, RUNTIMES
from ..data.corpus import load_corpus, validation_prompts
from ..data.messages import held_back
from ..data.tasks import ALL_TASKS, encode_prompt, load_tokenizer
from ..decode.drafter import load_drafter, torch_drafter
from ..decode.loop import Decoded, acceptance, compare_to_reference, decode
from ..decode.onnx_backend import OnnxBackend
from ..decode.torch_backend import TorchBackend, decode_ar
from ..export.manifest import Checkpoints, ensure_export, read_manifest
from ..models.head import load_head, read_head_config
from ..models.llama import load_llama
from ..site.browser import chromium, chromium_path, served
from ..site.build import build
from .hf_onnx import export_hf_onnx
from .native import run_llamacpp
from .peers import run_wllama, wllama_page
from .transformersjs import run_transformersjs, transformersjs_page

logger = logging.getLogger(__name__)

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

    return transformersjs_page(browser, threads, export_hf_onnx(base_dir))


@dataclass
class Plan:
    prompts: int        # validation prompts per task
    new_tokens: int
    ks: tuple[int, ...] | None  # None: every k the head drafts (1 .. its k_train)
    repeats: int


@dataclass
class BenchConfig:
    runtimes: tuple[str, ...] = RUNTIMES
    plans: dict[str, Plan] = field(default_factory=lambda: {
        "torch": Plan(10, 48, None, 3),
        "onnx-cpu": Plan(10, 48, None, 3),
        "browser-wasm": Plan(10, 48, None, 3),
        "browser-wasm-1thread": Plan(10, 48, None, 3),
        "browser-webgpu": Plan(2, 16, (4,), 1),
        "peers": Plan(10, 48, None, 3),  # every peer runtime: plain decoding only
    })
    peers: tuple[str, ...] = ()


def modes(ks) -> list[tuple[str, int]]:
    return [(mode, k if source else 0) for mode, source in MODES.items() for k in (ks if source else (0,))]


# --- runners: (prompt_ids, text, task, mode, k, n) -> (Decoded: ids, steps, accepted, lookups, verified and
# prefill seconds; the whole call's seconds) ---

def python_runner(runtime: str, ckpts: Checkpoints, onnx_dir: Path):
    """The runner of a Python runtime and, for onnx-cpu, a function giving where a step's time went
    ({"base T=5": {"median_ms", "runs"}, "head k=4": ..}; None for torch)."""
    base = load_llama(ckpts.base)
    eos = base.config.eos_token_id
    made = {}  # (mode, k) -> the ONNX backend running it (the head's graph depends on k)
    if runtime == "torch":
        head, drafter = load_head(ckpts.head, base), load_drafter(ckpts.drafter, base)
        backends = {"ar": lambda k: TorchBackend(base), "mtp": lambda k: TorchBackend(base, head=head),
                    "drafter": lambda k: TorchBackend(base, drafter=torch_drafter(drafter))}
    else:
        ensure_export(ckpts, onnx_dir, ("fp32",))
        def onnx_backend(mode, k):
            if (mode, k) not in made:
                made[mode, k] = OnnxBackend(onnx_dir, MODES[mode], k)
            return made[mode, k]

        backends = {mode: (lambda k, mode=mode: onnx_backend(mode, k)) for mode in MODES}

    def run(prompt_ids, text, task, mode, k, n):
        backend = backends[mode](k)  # torch: a fresh drafter state per decode, as the page has
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
            for mode, k in modes(plan.ks):
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


# --- measuring ---------------------------------------------------------------------------------------

def measure(runtime: str, run, prompts: dict, refs: dict, plan: Plan, peers: dict | None = None,
            eos: int | None = None) -> tuple[list[dict], list[dict]]:
    """Our rows of `runtime` and, where `peers` ({peer runtime: generate(prompt_ids, n) -> PeerResult}) are
    given, theirs from the same rounds: each round runs every task's prompts in every mode and every peer,
    the peers before our modes in the first round, after them in the second, and so on, so that drift in
    the machine's speed touches our modes and the peers alike and each round's ratios compare like with like."""
    peers = peers or {}
    items = {task: p[: plan.prompts] for task, p in prompts.items()}
    for task in items:  # warm-up: every mode and peer once, so no round pays for first-run compilation
        ids, text = items[task][0]
        for mode, k in modes(plan.ks):
            run(ids, text, task, mode, k, 8)
        for generate in peers.values():
            generate(ids, 8)
    rounds = {}  # (task, mode, k) -> what every round measured
    peer_rounds = {}  # (peer runtime, task) -> what every round measured
    for rep in range(plan.repeats):
        for task in items:
            ours = [(None, mode, k) for mode, k in modes(plan.ks)]
            theirs = [(name, "ar", 0) for name in peers]
            for peer, mode, k in (theirs + ours if rep % 2 == 0 else ours + theirs):
                if peer:
                    t = peer_rounds.setdefault((peer, task), new_peer_rounds(plan.repeats))
                    for ids, text in items[task]:
                        add_peer_result(t, rep, peers[peer](ids, plan.new_tokens), refs[(task, text, plan.new_tokens)], eos)
                    continue
                r = rounds.setdefault((task, mode, k), {"tps": [], "decode_tps": [], "prefill_share": [], "tokens": 0,
                                                        "steps": 0, "accepted": [], "mismatches": 0, "near_ties": 0,
                                                        "verified": Counter(), "draft_runs": 0})
                tokens, seconds, prefill = 0, 0.0, 0.0
                for ids, text in items[task]:
                    out, s = run(ids, text, task, mode, k, plan.new_tokens)
                    verdict, _ = compare_to_reference(refs[(task, text, plan.new_tokens)], out.ids)
                    r["mismatches"] += verdict == "mismatch"
                    r["near_ties"] += verdict == "near-tie"
                    r["steps"] += out.steps
                    r["accepted"] += out.accepted
                    r["verified"].update(out.verified)  # the base passes by length, and the draft source's runs
                    r["draft_runs"] += sum(v > 1 and not looked for v, looked in zip(out.verified, out.lookups))
                    tokens, seconds, prefill = tokens + len(out.ids), seconds + s, prefill + out.prefill_seconds
                r["tokens"] += tokens
                r["tps"].append(tokens / seconds)
                r["decode_tps"].append(tokens / (seconds - prefill))
                r["prefill_share"].append(prefill / seconds)
            logger.info(f"{runtime} round {rep + 1}/{plan.repeats} {task}: " + ", ".join(
                [f"{m}{k or ''} {rounds[(task, m, k)]['tps'][-1]:.0f}" for m, k in modes(plan.ks)]
                + [f"{name} {peer_rounds[(name, task)]['tokens'][rep] / (peer_rounds[(name, task)]['ms'][rep] / 1000):.0f}"
                   for name in peers]) + " tokens/s")
    results = []
    for (task, mode, k), r in rounds.items():
        ar = statistics.median(rounds[(task, "ar", 0)]["tps"])
        tps = statistics.median(r["tps"])
        ar_decode, decode_tps = statistics.median(rounds[(task, "ar", 0)]["decode_tps"]), statistics.median(r["decode_tps"])
        tau, by_position = acceptance(r["accepted"], k)
        results.append({"runtime": runtime, "task": task, "mode": mode, "k": k, "prompts": plan.prompts,
                        "new_tokens": plan.new_tokens, "tokens_per_s": round(tps, 2),
                        "tokens_per_s_rounds": [round(x, 2) for x in r["tps"]],
                        "tau": round(tau, 3), "accept_by_position": [round(a, 3) for a in by_position],
                        "speedup_vs_ar": round(tps / ar, 3), "speedup_per_tau": round(tps / ar / tau, 3),
                        "decode_tokens_per_s": round(decode_tps, 2),
                        "decode_tokens_per_s_rounds": [round(x, 2) for x in r["decode_tps"]],
                        "decode_speedup_vs_ar": round(decode_tps / ar_decode, 3),
                        "decode_speedup_per_tau": round(decode_tps / ar_decode / tau, 3),
                        "mean_new_tokens": round(r["tokens"] / (plan.repeats * len(items[task])), 1),
                        "prefill_share": round(statistics.median(r["prefill_share"]), 4),
                        "prefill_share_rounds": [round(x, 4) for x in r["prefill_share"]],
                        "tokens": r["tokens"], "base_runs_by_length": {str(t): n for t, n in sorted(r["verified"].items())},
                        "draft_runs": r["draft_runs"],
                        "mismatches": r["mismatches"], "near_ties": r["near_ties"]})
    peer_rows = [{"runtime": name, "interleaved_with": runtime, **peer_row(task, t, plan)}
                 for (name, task), t in peer_rounds.items()]
    return results, peer_rows


# --- a peer's rounds: the tokens it wrote and the time it took, per round; its rows as measure()'s plain rows ---

def new_peer_rounds(repeats: int) -> dict:
    return {"tokens": [0] * repeats, "ms": [0.0] * repeats, "decode_ms": [0.0] * repeats, "mismatches": 0, "near_ties": 0}


def add_peer_result(t: dict, rep: int, r: dict, ref, eos: int) -> None:
    out = r["ids"][: r["ids"].index(eos) + 1] if eos in r["ids"] else r["ids"]  # a peer may go on past the end
    verdict, _ = compare_to_reference(ref, out)
    t["tokens"][rep] += len(r["ids"])  # every token it wrote in the time it took
    t["ms"][rep] += r["total_ms"]
    t["decode_ms"][rep] += r["decode_ms"]
    t["mismatches"] += verdict == "mismatch"
    t["near_ties"] += verdict == "near-tie"


def peer_row(task: str, t: dict, plan: Plan) -> dict:
    tps = [n / (ms / 1000) for n, ms in zip(t["tokens"], t["ms"])]
    decode = [n / (ms / 1000) for n, ms in zip(t["tokens"], t["decode_ms"])]
    return {"task": task, "mode": "ar", "k": 0, "prompts": plan.prompts, "new_tokens": plan.new_tokens,
            "tokens_per_s": round(statistics.median(tps), 2), "tokens_per_s_rounds": [round(x, 2) for x in tps],
            "decode_tokens_per_s": round(statistics.median(decode), 2),
            "decode_tokens_per_s_rounds": [round(x, 2) for x in decode],
            "prefill_share": round(statistics.median(1 - d / m for d, m in zip(t["decode_ms"], t["ms"])), 4),
            "mean_new_tokens": round(sum(t["tokens"]) / (plan.repeats * plan.prompts), 1),
            "mismatches": t["mismatches"], "near_ties": t["near_ties"]}


def measure_peer(peer: str, threads, prompts: dict, refs: dict, plan: Plan, browser, base_dir: Path, eos: int) -> dict:
    """One peer runtime in rounds of its own: plain greedy decoding of the plan's prompts, every round in
    one load of the model (the first prompt's warm-up before); per task, the rows measure() gives plain
    decoding. (A browser peer with the threads of a browser runtime being measured runs in its rounds.)"""
    items = [(task, ids, text) for task, p in prompts.items() for ids, text in p[: plan.prompts]]
    ids = [i for _, i, _ in items] * plan.repeats
    if peer == "llamacpp":
        run = run_llamacpp(ids, plan.new_tokens, threads)
    elif peer == "wllama":
        run = run_wllama(browser, ids, plan.new_tokens, threads)
    else:
        run = run_transformersjs(browser, ids, plan.new_tokens, threads, export_hf_onnx(base_dir))
    info = next(v for key, v in run.items() if key.endswith("_info"))
    rounds = {}
    for n, ((task, _, text), r) in enumerate(zip(items * plan.repeats, run["results"])):
        t = rounds.setdefault(task, new_peer_rounds(plan.repeats))
        add_peer_result(t, n // len(items), r, refs[(task, text, plan.new_tokens)], eos)
    return {"info": info, "threads": info.get("threads", threads),
            "rows": [peer_row(task, t, plan) for task, t in rounds.items()]}


def memory(ckpts: Checkpoints, onnx_dir: Path | None = None) -> dict:
    """Bytes each model takes while decoding (weights in fp32, as every runtime but fp16 WebGPU holds them;
    KV cache) and, with an export, the bytes of the weights files a page downloads for it."""
    base = load_llama(ckpts.base)
    head, drafter = load_head(ckpts.head, base), load_drafter(ckpts.drafter, base)
    weights = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731 (tied counted once)
    kv = lambda c: 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # noqa: E731 fp32 K and V
    hc = head.config
    # a draft vocabulary: its graphs hold those rows of the base's embedding (and LM head, if not tied), fp32
    rows = hc.draft_vocab * base.config.hidden_size * 4 * (1 if base.config.tie_word_embeddings else 2)
    return {"base_weights_bytes": weights(base), "mtp_weights_bytes": weights(head) + rows,
            "drafter_weights_bytes": weights(drafter),
            "kv_bytes_per_token_base": kv(base.config), "kv_bytes_per_token_drafter": kv(drafter.config),
            # the head keeps no cache of the sequence: only its own chain's keys and values during one step
            "mtp_extra_state_bytes": 2 * hc.k_train * hc.num_key_value_heads * hc.head_dim * 4,
            "context_length": base.config.max_position_embeddings,
            **(download_bytes(onnx_dir) if onnx_dir and (onnx_dir / "manifest.json").is_file() else {})}


def download_bytes(onnx_dir: Path) -> dict:
    """The weights files the fp32 graphs read, per model (the head's and the drafter's beyond the base's
    file, which their graphs read too), in bytes: what a page downloads for each."""
    m = read_manifest(onnx_dir)
    graphs, files = m["precisions"]["fp32"]["graphs"], m["files"]
    # a weights file with a packed form (export/packed.py): the page downloads that form
    size = lambda names: sum(files[files[f]["packed"]["file"] if "packed" in files[f] else f]["bytes"] for f in names)  # noqa: E731
    base = set(graphs["base"]["weights"])
    head = {f for name, g in graphs.items() if name.startswith("head_") for f in g["weights"]} - base
    drafter = set(graphs["drafter"]["weights"]) - base if "drafter" in graphs else set()
    q4 = m["precisions"].get("q4")  # a GGUF base's graph on its blocks (export/nbits.py): the weights WebGPU holds
    return {"base_download_bytes": size(base), "mtp_download_bytes": size(head), "drafter_download_bytes": size(drafter),
            **({"base_q4_weights_bytes": sum(files[f]["bytes"] for f in q4["graphs"]["base"]["weights"])} if q4 else {})}


def graph_nodes(onnx_dir: Path) -> dict:
    """Operator nodes of each fp32 graph of the export (the base's, the head's per k, the drafter's): on a
    runtime bound by kernel launches, a graph's cost follows its node count. The Casts of weights stored
    as float16 (export.half_stored) are not counted: onnxruntime folds them when it loads the graph."""
    import onnx

    def count(path: Path) -> int:
        graph = onnx.load(str(path), load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        return sum(not (n.op_type == "Cast" and n.input[0] in weights) for n in graph.node)

    graphs = json.loads((onnx_dir / "manifest.json").read_text())["precisions"]["fp32"]["graphs"]
    return {name: count(onnx_dir / g["file"]) for name, g in graphs.items()}


def bench(cfg: BenchConfig, ckpts: Checkpoints, onnx_dir: Path, site_dir: Path) -> dict:
    browsers = [r for r in cfg.runtimes if r.startswith("browser-")]
    if browsers:
        chromium_path()  # a missing browser fails now, not after the Python runtimes' measurements
    tok, base = load_tokenizer(ckpts.base), load_llama(ckpts.base)
    every_k = tuple(range(1, read_head_config(ckpts.head).k_train + 1))
    cfg = replace(cfg, plans={rt: replace(p, ks=p.ks or every_k) for rt, p in cfg.plans.items()})
    tasks = tuple(t for t in ALL_TASKS if t in tok.tasks)
    n = max(p.prompts for p in cfg.plans.values())
    corpus_prompts = validation_prompts(load_corpus(), n, tasks=tasks)
    if "reply" in tasks:  # real short messages (data/messages.py), not documentation sentences the base repeats back
        corpus_prompts = [p for p in corpus_prompts if p["task"] != "reply"] + [{"task": "reply", "prompt": m} for m in held_back(n)]
    prompts = {t: [(encode_prompt(tok, t, p["prompt"]), p["prompt"]) for p in corpus_prompts if p["task"] == t]
               for t in tasks}
    refs = {}
    used = [*cfg.runtimes, *(["peers"] if cfg.peers else [])]
    for plan in {cfg.plans[r].new_tokens: cfg.plans[r] for r in used}.values():
        for t in tasks:
            for ids, text in prompts[t][: max(cfg.plans[r].prompts for r in used)]:
                refs[(t, text, plan.new_tokens)] = decode_ar(base, ids, plan.new_tokens, base.config.eos_token_id)
    results, profiles, threads, dispatches, visit, peers = [], {}, {}, {}, None, []

    def peer(name: str, browser=None):  # a peer's runtimes not measured in a browser runtime's rounds, in rounds of their own
        for runtime, n in PEERS[name].items():
            if any(r["runtime"] == runtime for r in peers):
                continue
            got = measure_peer(name, n, prompts, refs, cfg.plans["peers"], browser, ckpts.base, base.config.eos_token_id)
            peers.extend({"runtime": runtime, "peer": name, "threads": got["threads"], **row} for row in got["rows"])
            logger.info(f"{runtime} ({got['threads']} threads): " + ", ".join(
                f"{row['task']} {row['tokens_per_s']:.1f}" for row in got["rows"]) + " tokens/s")

    for runtime in cfg.runtimes:
        if not runtime.startswith("browser-"):
            run, profile = python_runner(runtime, ckpts, onnx_dir)
            results += measure(runtime, run, prompts, refs, cfg.plans[runtime])[0]
            if profile:
                profiles[runtime] = profile()
    if "llamacpp" in cfg.peers:
        peer("llamacpp")
    browser_peers = [p for p in cfg.peers if p != "llamacpp"]
    if browser_peers and not browsers:
        with chromium() as browser:
            for name in browser_peers:
                peer(name, browser)
    if browsers:
        build(ckpts, site_dir, onnx_dir, ("fp32",))
        with served(site_dir) as url, chromium() as browser:
            for runtime in browsers:
                context = browser.new_context()
                page = context.new_page()
                page.goto(url + PAGE_QUERY[runtime])
                info = page.evaluate("window.frozenMTP.ready")
                logger.info(f"{runtime}: {info['note']} {info.get('adapter') or ''} {info.get('threadsNote') or ''}")
                threads[runtime] = info.get("threads")
                with ExitStack() as stack:  # the browser peers with this runtime's threads, loaded beside the page
                    opened = {}  # peer runtime -> (peer, generate, info)
                    for name in browser_peers:
                        for peer_runtime, n in PEERS[name].items():
                            if n == PEER_THREADS.get(runtime):
                                generate, peer_info = stack.enter_context(open_peer(name, browser, n, ckpts.base))
                                opened[peer_runtime] = (name, generate, peer_info)
                    ours, theirs = measure(runtime, browser_runner(page), prompts, refs, cfg.plans[runtime],
                                           {rt: g for rt, (_, g, _) in opened.items()}, base.config.eos_token_id)
                results += ours
                for row in theirs:
                    name, _, peer_info = opened[row["runtime"]]
                    peers.append({"runtime": row.pop("runtime"), "peer": name,
                                  "threads": peer_info.get("threads", PEER_THREADS[runtime]), **row})
                if runtime == "browser-webgpu":
                    dispatches = count_dispatches(page, prompts, cfg.plans[runtime].ks)
                else:
                    profiles[runtime] = page_profile(page, prompts, cfg.plans[runtime])
                context.close()
            if "browser-wasm" in browsers:
                visit = first_visit(browser, url)
                logger.info(f"first visit ({visit['network']}): {visit['first']}; second: {visit['second']}")
            for name in browser_peers:
                peer(name, browser)
    if dispatches:
        modelled_speedups(dispatches, results)
    nodes = graph_nodes(onnx_dir) if (onnx_dir / "manifest.json").is_file() else {}
    return {"results": results, "memory": memory(ckpts, onnx_dir), "profile": profiles, "graph_nodes": nodes,
            "config": {r: asdict(cfg.plans[r]) for r in cfg.runtimes}, "lookup": DEFAULT_LOOKUP, "machine": machine(),
            "wasm_threads": threads, "webgpu_dispatches": dispatches, "first_visit": visit,
            "peers": peers, "peer_config": asdict(cfg.plans["peers"]) if peers else None}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform(), "date": time.strftime("%Y-%m-%d")}
