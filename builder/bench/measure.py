"""The bench's measurements (run.py): rounds of every (task, mode, k) and the peers, their rows, memory.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..contract import MODES
from ..decode.drafter import load_drafter
from ..decode.loop import acceptance, compare_to_reference
from ..export.manifest import Checkpoints, read_manifest
from ..models.adapter import read_adapter_config
from ..models.head import load_head
from ..models.llama import load_llama
from .hf_onnx import export_hf_onnx
from .native import run_llamacpp
from .peers import run_wllama
from .transformersjs import DTYPES, run_transformersjs

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    prompts: int        # validation prompts per task
    new_tokens: int
    ks: tuple[int, ...] | None  # None: every k the head drafts (1 .. its k_train)
    repeats: int
    modes: tuple[str, ...] = tuple(MODES)  # without "drafter" where there is no drafter


def modes(plan: Plan) -> list[tuple[str, int]]:
    return [(mode, k if MODES[mode] else 0) for mode in plan.modes for k in (plan.ks if MODES[mode] else (0,))]


def measure(runtime: str, run, prompts: dict, refs: dict, plan: Plan, peers: dict | None = None,
            eos: int | None = None, peer_refs: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Our rows of `runtime` and, where `peers` ({peer runtime: generate(prompt_ids, n) -> PeerResult}) are
    given, theirs from the same rounds (checked against peer_refs, the base's; default refs): each round runs
    every task's prompts in every mode and every peer,
    the peers before our modes in the first round, after them in the second, and so on, so that drift in
    the machine's speed touches our modes and the peers alike and each round's ratios compare like with like."""
    peers, peer_refs = peers or {}, peer_refs or refs
    items = {task: p[: plan.prompts] for task, p in prompts.items()}
    for task in items:  # warm-up: every mode and peer once, so no round pays for first-run compilation
        ids, text = items[task][0]
        for mode, k in modes(plan):
            run(ids, text, task, mode, k, 8)
        for generate in peers.values():
            generate(ids, 8)
    rounds = {}  # (task, mode, k) -> what every round measured
    peer_rounds = {}  # (peer runtime, task) -> what every round measured
    for rep in range(plan.repeats):
        for task in items:
            ours = [(None, mode, k) for mode, k in modes(plan)]
            theirs = [(name, "ar", 0) for name in peers]
            for peer, mode, k in (theirs + ours if rep % 2 == 0 else ours + theirs):
                if peer:
                    t = peer_rounds.setdefault((peer, task), new_peer_rounds(plan.repeats))
                    for ids, text in items[task]:
                        add_peer_result(t, rep, peers[peer](ids, plan.new_tokens), peer_refs[(task, text, plan.new_tokens)], eos)
                else:
                    our_round(rounds.setdefault((task, mode, k), new_rounds()), run, items[task], task, mode, k, refs, plan)
            logger.info(f"{runtime} round {rep + 1}/{plan.repeats} {task}: " + ", ".join(
                [f"{m}{k or ''} {rounds[(task, m, k)]['tps'][-1]:.0f}" for m, k in modes(plan)]
                + [f"{name} {peer_rounds[(name, task)]['tokens'][rep] / (peer_rounds[(name, task)]['ms'][rep] / 1000):.0f}"
                   for name in peers]) + " tokens/s")
    results = [our_row(runtime, task, mode, k, r, rounds[(task, "ar", 0)], plan, len(items[task]))
               for (task, mode, k), r in rounds.items()]
    peer_rows = [{"runtime": name, "interleaved_with": runtime, **peer_row(task, t, plan)}
                 for (name, task), t in peer_rounds.items()]
    return results, peer_rows


def new_rounds() -> dict:
    return {"tps": [], "decode_tps": [], "prefill_share": [], "tokens": 0, "steps": 0, "accepted": [], "mismatches": 0,
            "near_ties": 0, "verified": Counter(), "draft_runs": 0}


def our_round(r: dict, run, items: list, task: str, mode: str, k: int, refs: dict, plan: Plan) -> None:
    """One round of (task, mode, k) over the task's prompts, added to r: exactness, steps, speed."""
    tokens, seconds, prefill = 0, 0.0, 0.0
    for ids, text in items:
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


def our_row(runtime: str, task: str, mode: str, k: int, r: dict, plain: dict, plan: Plan, prompts: int) -> dict:
    """The JSON row of (task, mode, k) from its rounds r, its speeds against plain decoding's rounds."""
    ar, tps = statistics.median(plain["tps"]), statistics.median(r["tps"])
    ar_decode, decode_tps = statistics.median(plain["decode_tps"]), statistics.median(r["decode_tps"])
    tau, by_position = acceptance(r["accepted"], k)
    return {"runtime": runtime, "task": task, "mode": mode, "k": k, "prompts": plan.prompts,
            "new_tokens": plan.new_tokens, "tokens_per_s": round(tps, 2),
            "tokens_per_s_rounds": [round(x, 2) for x in r["tps"]],
            "tau": round(tau, 3), "accept_by_position": [round(a, 3) for a in by_position],
            "speedup_vs_ar": round(tps / ar, 3), "speedup_per_tau": round(tps / ar / tau, 3),
            "decode_tokens_per_s": round(decode_tps, 2),
            "decode_tokens_per_s_rounds": [round(x, 2) for x in r["decode_tps"]],
            "decode_speedup_vs_ar": round(decode_tps / ar_decode, 3),
            "decode_speedup_per_tau": round(decode_tps / ar_decode / tau, 3),
            "mean_new_tokens": round(r["tokens"] / (plan.repeats * prompts), 1),
            "prefill_share": round(statistics.median(r["prefill_share"]), 4),
            "prefill_share_rounds": [round(x, 4) for x in r["prefill_share"]],
            "tokens": r["tokens"], "base_runs_by_length": {str(t): n for t, n in sorted(r["verified"].items())},
            "draft_runs": r["draft_runs"], "mismatches": r["mismatches"], "near_ties": r["near_ties"]}


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
    one load of the model (the first prompt's warm-up before), checked against refs (the base's); per task,
    the rows measure() gives plain decoding. (A browser peer with the threads of a browser runtime being
    measured runs in its rounds.)"""
    items = [(task, ids, text) for task, p in prompts.items() for ids, text in p[: plan.prompts]]
    ids = [i for _, i, _ in items] * plan.repeats
    if peer == "llamacpp":
        run = run_llamacpp(ids, plan.new_tokens, threads)
    elif peer == "wllama":
        run = run_wllama(browser, ids, plan.new_tokens, threads)
    else:
        run = run_transformersjs(browser, ids, plan.new_tokens, threads, export_hf_onnx(base_dir), dtype=DTYPES[peer])
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
    head = load_head(ckpts.head, base)
    drafter = load_drafter(ckpts.drafter, base) if ckpts.drafter else None
    weights = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731 (tied counted once)
    kv = lambda c: 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # noqa: E731 fp32 K and V
    hc = head.config
    # a draft vocabulary: its graphs hold those rows of the base's embedding (and LM head, if not tied), fp32
    rows = hc.draft_vocab * base.config.hidden_size * 4 * (1 if base.config.tie_word_embeddings else 2)
    return {"base_weights_bytes": weights(base), "mtp_weights_bytes": weights(head) + rows,
            **({"drafter_weights_bytes": weights(drafter), "kv_bytes_per_token_drafter": kv(drafter.config)} if drafter else {}),
            "kv_bytes_per_token_base": kv(base.config),
            # the head keeps no cache of the sequence: only its own chain's keys and values during one step
            "mtp_extra_state_bytes": 2 * hc.k_train * hc.num_key_value_heads * hc.head_dim * 4,
            "context_length": base.config.max_position_embeddings,
            # a feature's adapter: its file (fp16, what a page downloads) and its fp32 values while it decodes
            "adapter_bytes": {read_adapter_config(d)["task"]: {"download": (Path(d) / "adapter_model.safetensors").stat().st_size,
                                                               "fp32": 4 * adapter_params(d)} for d in ckpts.adapters},
            **(download_bytes(onnx_dir) if onnx_dir and (onnx_dir / "manifest.json").is_file() else {})}


def adapter_params(directory: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(directory) / "adapter_model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


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


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform(), "date": time.strftime("%Y-%m-%d")}
