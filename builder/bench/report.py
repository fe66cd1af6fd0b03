"""The benchmark's report, written next to its JSON: a markdown table and three PNG plots."""
from __future__ import annotations

from pathlib import Path

from ..contract import MODE_LABELS, PEERS


def best(results: list[dict], runtime: str, task: str, mode: str) -> dict | None:
    rows = [r for r in results if (r["runtime"], r["task"], r["mode"]) == (runtime, task, mode)]
    return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None


def spread(r: dict) -> str:
    lo, hi = min(r["tokens_per_s_rounds"]), max(r["tokens_per_s_rounds"])
    return f"{r['tokens_per_s']:.1f}" + (f" ({lo:.1f}-{hi:.1f})" if len(r["tokens_per_s_rounds"]) > 1 else "")


def summary_table(data: dict) -> str:
    """Per runtime and task: plain, MTP and drafter at their best k."""
    results = data["results"]
    lines = ["| runtime | task | plain tokens/s | MTP tokens/s (best k) | MTP / plain | tau | speedup / tau "
             "| drafter tokens/s (best k) | drafter / plain | MTP / drafter |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for runtime in dict.fromkeys(r["runtime"] for r in results):
        for task in dict.fromkeys(r["task"] for r in results):
            ar, mtp, dr = (best(results, runtime, task, m) for m in ("ar", "mtp", "drafter"))
            if not (ar and mtp and dr):
                continue
            lines.append(f"| {runtime} | {task} | {spread(ar)} | {spread(mtp)} k={mtp['k']} | {mtp['speedup_vs_ar']:.2f}x "
                         f"| {mtp['tau']:.2f} | {mtp['speedup_per_tau']:.2f} | {spread(dr)} k={dr['k']} "
                         f"| {dr['speedup_vs_ar']:.2f}x | {mtp['tokens_per_s'] / dr['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


# issue [fast]'s targets: MTP / plain per task, MTP / drafter per task, speedup / tau
TARGETS = {"plain": {"continue": 1.7, "proofread": 2.0, "summarize": 2.0},
           "drafter": {"continue": 1.2, "proofread": 1.2, "summarize": 1.5}, "per_tau": 0.75}


def targets_table(data: dict) -> str:
    """The speed targets per runtime and task, each figure two ways: over the whole generation (tokens/s as
    in the summary) and after the prefill (decode_tokens_per_s: the same prefill in every mode left out),
    each speculative mode at its best k for that measure. A figure that meets its target is marked *met*.
    The last column bounds the whole figures: plain decoding's whole time over its prefill, the speedup of a
    draft source whose decoding cost nothing, beside the tokens a prompt produced."""
    results = data["results"]
    if not results or "decode_tokens_per_s" not in results[0]:
        return ""

    def cell(value: float, target: float, unit: str = "x") -> str:
        return f"{value:.2f}{unit}" + (" *met*" if value >= target else "")

    lines = ["| runtime | task | MTP / plain: whole, after prefill (target) | MTP / drafter: whole, after prefill "
             "(target) | speedup / tau: whole, after prefill (target) | ceiling of any drafter, whole (new tokens "
             "per prompt) |", "| --- | --- | --- | --- | --- | --- |"]
    for runtime in dict.fromkeys(r["runtime"] for r in results):
        for task in TARGETS["plain"]:
            rows = {m: [r for r in results if (r["runtime"], r["task"], r["mode"]) == (runtime, task, m)]
                    for m in ("ar", "mtp", "drafter")}
            if not all(rows.values()):
                continue
            figures = []
            for key in ("tokens_per_s", "decode_tokens_per_s"):
                ar, mtp, dr = (max(rows[m], key=lambda r: r[key]) for m in ("ar", "mtp", "drafter"))
                figures.append((mtp[key] / ar[key], mtp[key] / dr[key], mtp[key] / ar[key] / mtp["tau"]))
            (p1, d1, t1), (p2, d2, t2) = figures
            ar = rows["ar"][0]
            ceiling = (f"{1 / ar['prefill_share']:.2f}x ({ar['mean_new_tokens']:g})" if ar.get("prefill_share")
                       else "-")
            lines.append(f"| {runtime} | {task} | {cell(p1, TARGETS['plain'][task])}, {cell(p2, TARGETS['plain'][task])} "
                         f"(>= {TARGETS['plain'][task]}) | {cell(d1, TARGETS['drafter'][task])}, "
                         f"{cell(d2, TARGETS['drafter'][task])} (>= {TARGETS['drafter'][task]}) | "
                         f"{cell(t1, TARGETS['per_tau'], '')}, {cell(t2, TARGETS['per_tau'], '')} (>= {TARGETS['per_tau']}) "
                         f"| {ceiling} |")
    return ("## Targets (issue [fast]): the whole generation, and after the prefill\n\n"
            "The prefill (the base reading the prompt) is one and the same pass in every mode, so speculation "
            "cannot shorten it; a summary's long passage makes it most of a short generation's time, and the "
            "last column says how much: plain decoding's whole time over its prefill, the whole speedup of a "
            "draft source whose decoding cost nothing, which no mode passes by more than the noise. \"after "
            "prefill\" is the speed at which text streams once it starts (the drafter's own prefill falls inside "
            "it). Each mode at its best k for that measure.\n\n" + "\n".join(lines) + "\n\n")


def full_table(data: dict) -> str:
    lines = ["| runtime | task | mode | k | tokens/s median (min-max) | vs plain | tau | speedup / tau "
             "| acceptance by position | mismatches | near-ties |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        acc = " ".join(f"{a:.2f}" for a in r["accept_by_position"]) or "-"
        lines.append(f"| {r['runtime']} | {r['task']} | {MODE_LABELS[r['mode']]} | {r['k'] or '-'} | {spread(r)} "
                     f"| {r['speedup_vs_ar']:.2f}x | {r['tau']:.2f} | {r['speedup_per_tau']:.2f} | {acc} "
                     f"| {r['mismatches']} | {r['near_ties']} |")
    return "\n".join(lines)


# issue [smol]'s goals: the page's MTP over the fastest peer's plain decoding in the same browser
PEER_GOALS = {"proofread": 1.5, "continue": 1.5, "summarize": 1.5, "reply": 1.5}  # issue 57: on everyday text


def peers_table(data: dict) -> str:
    """The peers (plain decoding of the same model, same prompts, this run) beside our runtimes: per task,
    our MTP at its best k against the fastest peer with the same threads, in the same place (browser
    runtimes against the browser peers, onnx-cpu against llama.cpp native)."""
    peers, results = data.get("peers") or [], data["results"]
    if not peers:
        return ""
    lines = ["| peer runtime | threads | task | plain tokens/s | after prefill | prefill share | new tokens | mismatches |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in peers:
        lines.append(f"| {r['runtime']} | {r['threads']} | {r['task']} | {spread(r)} | {r['decode_tokens_per_s']:.1f} "
                     f"| {r['prefill_share']:.0%} | {r['mean_new_tokens']} | {r['mismatches']} |")
    browser = [(rt, n) for name, runtimes in PEERS.items() if name != "llamacpp" for rt, n in runtimes.items()]
    ours = {"browser-wasm": tuple(rt for rt, n in browser if n == "max"),
            "browser-wasm-1thread": tuple(rt for rt, n in browser if n == 1),
            "onnx-cpu": ("llamacpp-native-1thread",)}
    cmp = ["| ours | task | our MTP tokens/s (k) | our plain | fastest peer, plain | MTP / peer (goal) | MTP / peer, each round "
           "| MTP / our plain |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for runtime, against in ours.items():
        for task in dict.fromkeys(r["task"] for r in peers):
            mtp, ar = best(results, runtime, task, "mtp"), best(results, runtime, task, "ar")
            rivals = [r for r in peers if r["runtime"] in against and r["task"] == task]
            if not (mtp and ar and rivals):
                continue
            top = max(rivals, key=lambda r: r["tokens_per_s"])
            ratio, goal = mtp["tokens_per_s"] / top["tokens_per_s"], PEER_GOALS.get(task, 1.2)
            each = "-"  # where the peer ran in our rounds, each round's ratio: drift touched both alike
            if top.get("interleaved_with") == runtime:
                each = " ".join(f"{a / b:.2f}" for a, b in zip(mtp["tokens_per_s_rounds"], top["tokens_per_s_rounds"]))
            cmp.append(f"| {runtime} | {task} | {mtp['tokens_per_s']:.1f} (k={mtp['k']}) | {ar['tokens_per_s']:.1f} "
                       f"| {top['runtime']} {top['tokens_per_s']:.1f} | {ratio:.2f}x ({goal}x{', met' if ratio >= goal else ''}) "
                       f"| {each} | {mtp['speedup_vs_ar']:.2f}x |")
    c = data.get("peer_config") or {}
    interleaved = {}  # our runtime -> the peers that ran in its rounds
    for r in peers:
        if r.get("interleaved_with"):
            interleaved.setdefault(r["interleaved_with"], dict.fromkeys([]))[r["runtime"]] = None
    how = "".join(f" {' and '.join(names)} ran in {runtime}'s rounds, interleaved with our modes (before them in the "
                  f"first round, after them in the second, and so on), on its prompts, tokens and rounds."
                  for runtime, names in interleaved.items())
    if how and any(not r.get("interleaved_with") for r in peers):
        how += " The other peers ran in rounds of their own."
    return (f"## The peers: the same model in other runtimes, same prompts, this run\n\n"
            f"Plain greedy decoding from the prompts' token ids ({c.get('prompts')} prompts per task x "
            f"{c.get('new_tokens')} tokens, {c.get('repeats')} round(s)); a mismatch is a first difference "
            f"from the PyTorch reference that is no near-tie.{how}\n\n" + "\n".join(lines) + "\n\n"
            + ("\n".join(cmp) + "\n\n" if len(cmp) > 2 else ""))


def memory_table(mem: dict) -> str:
    ctx = mem["context_length"]
    rows = [("weights in memory (fp32)", mem["base_weights_bytes"], mem["mtp_weights_bytes"], mem.get("drafter_weights_bytes", 0)),
            *([("weights in memory, WebGPU (base q4)", mem["base_q4_weights_bytes"], mem["mtp_weights_bytes"],
                mem.get("drafter_weights_bytes", 0))] if "base_q4_weights_bytes" in mem else []),
            *([("weights files downloaded", mem["base_download_bytes"], mem["mtp_download_bytes"],
                mem.get("drafter_download_bytes", 0))] if "base_download_bytes" in mem else []),
            ("KV cache per token", mem["kv_bytes_per_token_base"], 0, mem.get("kv_bytes_per_token_drafter", 0)),
            (f"KV cache, full context ({ctx} tokens)", mem["kv_bytes_per_token_base"] * ctx, 0,
             mem.get("kv_bytes_per_token_drafter", 0) * ctx),
            ("other state while drafting", 0, mem["mtp_extra_state_bytes"], 0)]
    lines = ["| bytes | base | MTP head (adds) | independent drafter (adds) |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {b:,} | {h:,} | {d:,} |" for name, b, h, d in rows]
    added_mtp = mem["mtp_weights_bytes"] + mem["mtp_extra_state_bytes"]
    added_dr = mem.get("drafter_weights_bytes", 0) + mem.get("kv_bytes_per_token_drafter", 0) * ctx
    lines.append(f"| **added to the base, full context** | | **{added_mtp:,}** | **{added_dr:,}** |")
    for task, b in (mem.get("adapter_bytes") or {}).items():  # a feature's adapter: inputs of the same base graph
        lines.append(f"| the {task} adapter (file fp16 / held fp32) | {b['download']:,} / {b['fp32']:,} | | |")
    return "\n".join(lines)


def base_ms(ms: dict, t: int) -> float | None:
    """The profile's median of a base run over t tokens; between two lengths it has, by straight line."""
    have = sorted(int(what.split("=")[1]) for what in ms if what.startswith("base T="))
    if t in have:
        return ms[f"base T={t}"]
    lo, hi = [x for x in have if x < t], [x for x in have if x > t]
    if not lo or not hi:
        return None
    a, b = lo[-1], hi[0]
    return ms[f"base T={a}"] + (ms[f"base T={b}"] - ms[f"base T={a}"]) * (t - a) / (b - a)


def predicted_speedups(row: dict, ms: dict, k: int, t1: float | None = None) -> tuple[float, float] | None:
    """MTP's speed over plain decoding predicted by the graph runs alone, and with a head that cost nothing: a
    plain token costs a one-token base run (t1); MTP's tokens cost the base runs this row made, each at its
    own length (a lookup step's up to 2k + 1), plus a head run for each step the head drafted.
    t1: the task's own one-token run (its plain decoding's time a token after the prefill, in the same run),
    where it differs from the profile's median over every task: after a long prompt (a summary's 100-400
    tokens) every run reads a longer cache. A run over T tokens then costs t1 plus the profile's extra for
    T - 1 more tokens (its T-token median minus its one-token median). Rows of an older bench, which did not
    record the runs: every step a verify of k + 1 and a head run, tau x t1 / (verify + head), at the medians."""
    head, median = ms.get(f"head k={k}"), ms["base T=1"]
    if "base_runs_by_length" not in row:
        verify = ms.get(f"base T={k + 1}")
        return None if verify is None or head is None else (row["tau"] * median / (verify + head), row["tau"] * median / verify)
    t1 = t1 or median
    costs = [(n, base_ms(ms, int(t))) for t, n in row["base_runs_by_length"].items()]
    if head is None or any(c is None for _, c in costs):
        return None
    base = sum(n * (t1 + c - median) for n, c in costs)
    return row["tokens"] * t1 / (base + row["draft_runs"] * head), row["tokens"] * t1 / base


def own_t1(data: dict, runtime: str, task: str) -> float | None:
    """The task's one-token base run on runtime: its plain decoding's ms a token after the prefill (None in a
    bench that did not record it)."""
    ar = next((r for r in data["results"] if (r["runtime"], r["task"], r["mode"]) == (runtime, task, "ar")), None)
    return 1000 / ar["decode_tokens_per_s"] if ar and ar.get("decode_tokens_per_s") else None


def profile_table(data: dict, runtime: str) -> str:
    """Where an MTP step's time goes on a runtime with a run profile: per k, the base's verify run and the
    head's draft run (median ms, and as multiples of a one-token base run), and per task MTP's speed over
    plain decoding after the prefill (which the two modes share) three ways: measured, predicted by the graph
    runs alone, and the bound a head that cost nothing would give (predicted_speedups)."""
    prof = data["profile"][runtime]
    ms = {what: p["median_ms"] for what, p in prof.items()}
    t1 = ms["base T=1"]
    results = [r for r in data["results"] if r["runtime"] == runtime and r["mode"] == "mtp"]
    tasks = list(dict.fromkeys(r["task"] for r in results))
    lines = ["| k | base verifying k+1 tokens, ms | head drafting k, ms | MTP step, ms | "
             + " | ".join(f"{t}: tau, MTP/plain after the prefill: measured / from the runs / with a free head"
                          for t in tasks) + " |",
             "| --- " * (4 + len(tasks)) + "|"]
    for k in sorted({r["k"] for r in results}):
        tv, th = ms.get(f"base T={k + 1}"), ms.get(f"head k={k}")
        if tv is None or th is None:
            continue
        cells = []
        for task in tasks:
            r = next(r for r in results if (r["task"], r["k"]) == (task, k))
            pred = predicted_speedups(r, ms, k, own_t1(data, runtime, task))
            cells.append(f"{r['tau']:.2f}, {r.get('decode_speedup_vs_ar', r['speedup_vs_ar']):.2f}x / "
                         + (f"{pred[0]:.2f}x / {pred[1]:.2f}x" if pred else "- / -"))
        lines.append(f"| {k} | {tv:.2f} ({tv / t1:.2f}x) | {th:.2f} ({th / t1:.2f}x) | {tv + th:.2f} | "
                     + " | ".join(cells) + " |")
    drafter = ms.get("drafter T=1")
    notes = [f"A plain step, one base run of one token: {t1:.2f} ms (median of {prof['base T=1']['runs']} runs)."]
    if drafter is not None:
        notes.append(f"The independent drafter's one-token run: {drafter:.2f} ms ({drafter / t1:.2f}x).")
    nodes = data.get("graph_nodes", {})
    if "base" in nodes:
        heads = [f"k={k} {n}" for k, n in sorted((int(g.split("_k")[1]), n) for g, n in nodes.items() if g.startswith("head_k"))]
        notes.append(f"Operator nodes per graph: base {nodes['base']}"
                     + (f"; head {', '.join(heads)}" if heads else "")
                     + (f"; drafter {nodes['drafter']}" if "drafter" in nodes else "") + ".")
    if results and "base_runs_by_length" in results[0]:
        notes.append("The two predictions take the base runs each mode made at their own lengths (prompt lookup's "
                     "steps verify up to 2k + 1 tokens and run no head; a length the profile lacks is interpolated), each run "
                     "costing the task's own one-token run (its plain decoding's time a token after the prefill: after a "
                     "long prompt every run reads a longer cache) plus the profile's extra for its further tokens.")
    elif data.get("lookup"):
        notes.append("The two predictions assume every step verifies k + 1 tokens after a head run; with prompt lookup "
                     "first a step it drafted verifies up to 2k + 1 and runs no head, so they overstate where lookup "
                     "drafted long spans.")
    return "\n".join(lines) + "\n\n" + " ".join(notes)


def plots(data: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    runtimes = list(dict.fromkeys(r["runtime"] for r in results))
    tasks = list(dict.fromkeys(r["task"] for r in results))
    files = []

    def per_task(name: str, height: float, draw) -> None:
        """One figure, a panel per task drawn by draw(ax, task), saved as out/name."""
        fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), height), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            draw(ax, task)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        files.append(name)

    def tokens_per_s(ax, task):
        width = 0.27
        for i, mode in enumerate(("ar", "mtp", "drafter")):
            vals = [(best(results, rt, task, mode) or {}).get("tokens_per_s", 0) for rt in runtimes]
            ax.bar([x + (i - 1) * width for x in range(len(runtimes))], vals, width, label=MODE_LABELS[mode])
        ax.set_xticks(range(len(runtimes)), runtimes, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{task}: tokens/s (best k)")
        ax.legend(fontsize=8)

    def acceptance(ax, task):
        for mode in ("mtp", "drafter"):
            rows = [r for r in results if r["task"] == task and r["mode"] == mode and r["runtime"] == runtimes[0]]
            if rows:
                r = max(rows, key=lambda r: r["k"])
                ax.plot(range(1, len(r["accept_by_position"]) + 1), r["accept_by_position"], marker="o", label=f"{MODE_LABELS[mode]} k={r['k']}")
        ax.set_ylim(0, 1)
        ax.set_xlabel("draft position")
        ax.set_title(f"{task}: share of steps accepting draft i")
        ax.legend(fontsize=8)

    def speed_vs_k(ax, task):
        for rt in runtimes:
            for mode, style in (("mtp", "-"), ("drafter", ":")):
                rows = sorted((r for r in results if (r["runtime"], r["task"], r["mode"]) == (rt, task, mode)),
                              key=lambda r: r["k"])
                if len(rows) > 1:
                    ax.plot([r["k"] for r in rows], [r["speedup_vs_ar"] for r in rows], style, marker="o",
                            label=f"{rt} {MODE_LABELS[mode]}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("k (drafts per step)")
        ax.set_title(f"{task}: speed over plain decoding")
        ax.legend(fontsize=7)

    per_task("tokens_per_s.png", 3.6, tokens_per_s)
    per_task("acceptance.png", 3.4, acceptance)
    per_task("speed_vs_k.png", 3.6, speed_vs_k)
    plt.close("all")
    return files


def dispatch_table(dispatches: dict) -> str:
    """The GPU regime, counted in the page on WebGPU: dispatches and runs per step, the modelled speedup."""
    if not dispatches:
        return ""
    lines = ["| task | mode | runs per step | compute dispatches per step | tau | modelled speedup: tau x plain / MTP dispatches |",
             "| --- | --- | --- | --- | --- | --- |"]
    for task, rows in dispatches.items():
        for name, r in rows.items():
            tau = f"{r['tau']:.2f} ({r['tau_from']})" if "tau" in r else ("1" if not r["k"] else "-")
            speedup = f"{r['modelled_speedup']:.2f}x" if "modelled_speedup" in r else "-"
            lines.append(f"| {task} | {name} | {r['runs_per_step']:g} | {r['dispatches_per_step']:g} | {tau} | {speedup} |")
    return ("## The GPU regime, counted (browser-webgpu: WebGPU compute dispatches per decode step, prefill left out)\n\n"
            "SwiftShader's timings say nothing about a GPU's speed, but it runs the same WebGPU calls a phone's GPU"
            " would. At this model size a GPU spends its time per dispatch (launch and synchronisation) more than"
            " per FLOP; counted at the WebGPU API over one prompt's first 8 new tokens:\n\n" + "\n".join(lines) + "\n\n")


def write_report(data: dict, json_path: Path) -> Path:
    out = json_path.parent
    images = plots(data, out)
    m = data["machine"]
    cfg = "; ".join(f"{rt}: {c['prompts']} prompts per task x {c['new_tokens']} tokens, k {','.join(map(str, c['ks']))}, "
                    f"{c['repeats']} round(s)" for rt, c in data["config"].items())
    profiles = "".join(f"""## Where a step's time goes ({rt}: median wall time of each graph run, all rounds)

{profile_table(data, rt)}

""" for rt in data.get("profile", {}))
    threads = "".join(f" {rt} ran onnxruntime-web's WASM on {n} thread{'s' if n > 1 else ''}."
                      for rt, n in data.get("wasm_threads", {}).items() if n and rt != "browser-webgpu")
    gpu = dispatch_table(data.get("webgpu_dispatches") or {})
    text = {"everyday": " The prompts: each feature's held-out everyday texts (data/everyday.py), each decoded by its "
                        "production model" + (" (the base plus " + ", ".join(f"the {t} adapter" for t in data["adapters"])
                                              + "; the peers decode the base alone)" if data.get("adapters") else "") + ".",
            "corpus": " The prompts: the corpus's validation prompts."}.get(data.get("text"), "")
    lookup = (" The speculative modes drafted with prompt lookup first (where the text's last three tokens occurred "
              "before), their own source elsewhere." if data.get("lookup") else "")
    v = data.get("first_visit")
    visit = (f"## A phone's first visit (browser-wasm, network throttled to {v['network']})\n\n"
             f"First visit: {v['first']['bytes'] / 1e6:.1f} MB in {v['first']['requests']} requests, "
             f"{v['first']['seconds_to_first_token']:.1f} s from opening the page to the first MTP token. "
             f"Second visit (same browser profile): {v['second']['bytes'] / 1e6:.2f} MB in {v['second']['requests']} "
             f"requests, {v['second']['seconds_to_first_token']:.1f} s.\n\n") if v else ""
    md = out / (json_path.stem + ".md")
    md.write_text(f"""# Benchmark: plain vs MTP vs independent drafter

Machine: {m['cpu']}, {m['cores']} cores, {m['system']}; {m['date']}. No GPU: browser-webgpu is
SwiftShader, a CPU emulation of a GPU (it proves the WebGPU path, not GPU speed).
Plan: {cfg}. tokens/s is the median round (min-max over rounds).{text}{threads}{lookup}

## Summary (each speculative mode at its best k)

{summary_table(data)}

{targets_table(data)}## Memory

{memory_table(data['memory'])}

{peers_table(data)}{profiles}{gpu}{visit}## Every configuration

{full_table(data)}

""" + "\n".join(f"![{i}]({i})" for i in images) + "\n")
    return md
