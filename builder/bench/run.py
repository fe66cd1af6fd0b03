"""`bench`: plain vs MTP vs the independent drafter, side by side, in one run.

Runtimes: `torch` (the PyTorch modules), `onnx-cpu` (the exported graphs with onnxruntime, one thread),
`browser-wasm`, `browser-wasm-1thread` and `browser-webgpu` (the built site in headless Chromium, through
window.frozenMTP; browser-wasm with the WASM threads the page picks, browser-wasm-1thread with one).
For every runtime: a warm-up, then `repeats` rounds; each round runs every (task, mode, k) over the same
prompts, interleaved, so that drift in the machine's speed touches every mode alike. The prompts ("text"):
"everyday" (a chat base's default), each feature's held-out everyday texts (data/everyday.py: sentences with
typos, notification stacks, messages; continue goes on with the messages), decoded by the feature's
production model, the base plus its adapter where `ckpts.adapters` has one (the page applies the same);
"corpus" (a base without chat tasks), the corpus's validation prompts (reply: held-back real messages).
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
on the very GGUF file, plain greedy decoding from the same prompts' token ids in the same run (the base alone:
a peer has no adapters, and a user who merged one into its weights would decode at the same speed; their
outputs are checked against the base's): wllama and
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

The runtimes' runners are in runners.py, the rounds, rows and memory in measure.py; this module puts them
together: `bench()`.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..contract import DEFAULT_LOOKUP, MODES, PEERS, RUNTIMES
from ..data.corpus import load_corpus, validation_prompts
from ..data.everyday import held_out_texts
from ..data.messages import held_back
from ..data.tasks import ALL_TASKS, encode_prompt, load_tokenizer
from ..decode.torch_backend import decode_ar
from ..export.manifest import Checkpoints
from ..models.adapter import production_models, read_adapter_config
from ..models.head import read_head_config
from ..site.browser import chromium, chromium_path, served
from ..site.build import build
from .measure import Plan, graph_nodes, machine, measure, measure_peer, memory
from .runners import (PAGE_QUERY, PEER_THREADS, browser_runner, count_dispatches, first_visit, modelled_speedups,
                      open_peer, page_profile, python_runner)

logger = logging.getLogger(__name__)


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
    text: str | None = None  # "everyday" or "corpus" (module doc); None: everyday for a base with a reply task

def bench(cfg: BenchConfig, ckpts: Checkpoints, onnx_dir: Path, site_dir: Path) -> dict:
    browsers = [r for r in cfg.runtimes if r.startswith("browser-")]
    if browsers:
        chromium_path()  # a missing browser fails now, not after the Python runtimes' measurements
    tok, models = load_tokenizer(ckpts.base), production_models(ckpts.base, ckpts.adapters)
    base = models[None]
    every_k = tuple(range(1, read_head_config(ckpts.head).k_train + 1))
    tasks = tuple(t for t in ALL_TASKS if t in tok.tasks)
    sources = tuple(m for m in MODES if m != "drafter" or ckpts.drafter)
    cfg = replace(cfg, plans={rt: replace(p, ks=p.ks or every_k, modes=sources) for rt, p in cfg.plans.items()},
                  text=cfg.text or ("everyday" if "reply" in tasks else "corpus"))
    n = max(p.prompts for p in cfg.plans.values())
    prompts = {t: [(encode_prompt(tok, t, text), text) for text in texts] for t, texts in bench_texts(cfg.text, tasks, n).items()}
    refs, peer_refs = {}, {}  # (task, text, new tokens) -> the production model's greedy output; the base's
    used = [*cfg.runtimes, *(["peers"] if cfg.peers else [])]
    for plan in {cfg.plans[r].new_tokens: cfg.plans[r] for r in used}.values():
        for t in tasks:
            for ids, text in prompts[t][: max(cfg.plans[r].prompts for r in used)]:
                key, model = (t, text, plan.new_tokens), models.get(t, base)
                refs[key] = decode_ar(model, ids, plan.new_tokens, base.config.eos_token_id)
                if cfg.peers:
                    peer_refs[key] = refs[key] if model is base else decode_ar(base, ids, plan.new_tokens, base.config.eos_token_id)
    results, profiles, threads, dispatches, visit, peers = [], {}, {}, {}, None, []

    def peer(name: str, browser=None):  # a peer's runtimes not measured in a browser runtime's rounds, in rounds of their own
        for runtime, n in PEERS[name].items():
            if any(r["runtime"] == runtime for r in peers):
                continue
            got = measure_peer(name, n, prompts, peer_refs, cfg.plans["peers"], browser, ckpts.base, base.config.eos_token_id)
            peers.extend({"runtime": runtime, "peer": name, "threads": got["threads"], **row} for row in got["rows"])
            logger.info(f"{runtime} ({got['threads']} threads): " + ", ".join(
                f"{row['task']} {row['tokens_per_s']:.1f}" for row in got["rows"]) + " tokens/s")

    for runtime in cfg.runtimes:
        if not runtime.startswith("browser-"):
            run, profile = python_runner(runtime, ckpts, onnx_dir, models)
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
                                           {rt: g for rt, (_, g, _) in opened.items()}, base.config.eos_token_id, peer_refs)
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
            "text": cfg.text, "adapters": {task: str(d) for d in ckpts.adapters for task in [read_adapter_config(d)["task"]]},
            "wasm_threads": threads, "webgpu_dispatches": dispatches, "first_visit": visit,
            "peers": peers, "peer_config": asdict(cfg.plans["peers"]) if peers else None}

def bench_texts(text: str, tasks: tuple[str, ...], n: int) -> dict[str, list[str]]:
    """n prompt texts per task: the features' held-out everyday texts, or the corpus's validation prompts."""
    if text == "everyday":
        return {t: held_out_texts(t, n) for t in tasks}
    if text != "corpus":
        raise ValueError(f"text {text!r}: everyday or corpus")
    got = validation_prompts(load_corpus(), n, tasks=tasks)
    if "reply" in tasks:  # real short messages (data/messages.py), not documentation sentences the base repeats back
        got = [p for p in got if p["task"] != "reply"] + [{"task": "reply", "prompt": m} for m in held_back(n)]
    return {t: [p["prompt"] for p in got if p["task"] == t] for t in tasks}
