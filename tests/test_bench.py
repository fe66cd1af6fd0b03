"""`bench --json`: docs/contract.md's fields, exact outputs, and a report beside the JSON (a small run)."""
from __future__ import annotations

import json

import pytest

from builder.data.tasks import load_tokenizer
from builder.contract import LOOKUP_SPAN
from tests.conftest import INHOUSE, BASE_DIR, run


@pytest.mark.slow  # a whole bench in a subprocess: an ONNX export, two runtimes, 5 modes, 3 tasks, 2 rounds
def test_bench_writes_the_contract_json_and_a_report(tmp_path):
    out = tmp_path / "bench" / "bench.json"
    r = run("bench", *INHOUSE, "--json", str(out), "--runtimes", "torch,onnx-cpu", "--prompts", "2", "--new-tokens", "12",
            "--ks", "1,3", "--repeats", "2", "--onnx-dir", str(tmp_path / "onnx"), timeout=900)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    keys = {"runtime", "task", "mode", "k", "prompts", "new_tokens", "tokens_per_s", "tau", "accept_by_position"}
    rows = data["results"]
    assert all(keys <= set(row) for row in rows)
    combos = {(row["runtime"], row["task"], row["mode"], row["k"]) for row in rows}
    tasks = load_tokenizer(BASE_DIR).tasks  # those the shipped base offers
    assert len(combos) == 2 * len(tasks) * 5, "runtimes x tasks x (ar, mtp k=1,3, drafter k=1,3)"
    for row in rows:
        assert row["tokens_per_s"] > 0 and len(row["tokens_per_s_rounds"]) == 2
        # the same tokens over the time after the prefill: faster than over the whole generation
        assert row["decode_tokens_per_s"] > row["tokens_per_s"] and len(row["decode_tokens_per_s_rounds"]) == 2
        assert row["mismatches"] == 0, row
        # the prefill's share of each round's time: what the two speeds above leave between them
        assert 0 < row["prefill_share"] < 1 and 1 <= row["mean_new_tokens"] <= 12, row
        for share, tps, decode_tps in zip(row["prefill_share_rounds"], row["tokens_per_s_rounds"],
                                          row["decode_tokens_per_s_rounds"]):
            assert abs(share - (1 - tps / decode_tps)) < 0.01, row
        assert row["k"] <= len(row["accept_by_position"]) <= LOOKUP_SPAN * row["k"]  # a lookup step drafts up to 2k
        # mean(accepted + 1) = 1 + sum over i of P(accepted >= i): the two figures must agree (to rounding)
        assert abs(row["tau"] - 1 - sum(row["accept_by_position"])) <= 0.0005 * (row["k"] + 1), row
    mem = data["memory"]
    for key in ("base_weights_bytes", "mtp_weights_bytes", "drafter_weights_bytes", "kv_bytes_per_token_base",
                "kv_bytes_per_token_drafter", "mtp_extra_state_bytes"):
        assert mem[key] > 0, key
    # the shipped models are saved in fp16: a page downloads each weight in 2 bytes, holds it in 4
    for model in ("base", "mtp", "drafter"):
        assert 0.45 * mem[f"{model}_weights_bytes"] < mem[f"{model}_download_bytes"] < 0.55 * mem[f"{model}_weights_bytes"], model
    c = json.loads((BASE_DIR / "config.json").read_text())  # fp32 K and V of every layer
    assert mem["kv_bytes_per_token_base"] == 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4
    prof = data["profile"]["onnx-cpu"]  # where the step's time goes: every kind of graph run the modes made
    assert "torch" not in data["profile"]
    for what in ("base T=1", "base T=2", "base T=4", "head k=1", "head k=3", "drafter T=1"):
        assert prof[what]["median_ms"] > 0 and prof[what]["runs"] > 0, what
    nodes = data["graph_nodes"]  # a graph's cost on a launch-bound runtime follows its node count
    assert set(nodes) == {"base", "drafter", *(f"head_k{k}" for k in range(1, 7))}, nodes
    assert all(n > 0 for n in nodes.values()) and nodes["head_k6"] > nodes["head_k1"]
    report = (out.parent / "bench.md").read_text()
    assert "| torch | continue |" in report and "## Memory" in report
    assert "## Targets (issue [fast])" in report and "| onnx-cpu | summarize | " in report
    plain = next(r for r in rows if (r["runtime"], r["task"], r["mode"]) == ("onnx-cpu", "summarize", "ar"))
    assert f"| {1 / plain['prefill_share']:.2f}x ({plain['mean_new_tokens']:g}) |\n" in report
    assert "## Where a step's time goes (onnx-cpu" in report and "\n| 3 | " in report
    assert f"Operator nodes per graph: base {nodes['base']}; head k=1 {nodes['head_k1']}," in report
    for png in ("tokens_per_s.png", "acceptance.png", "speed_vs_k.png"):
        assert (out.parent / png).read_bytes()[:4] == b"\x89PNG"


def test_the_modelled_gpu_speedup_is_tau_times_the_dispatch_ratio():
    """browser-webgpu's counted dispatches become tau x dispatches(plain step) / dispatches(MTP step), with
    tau from the runtime that measured the most prompts x tokens; the report shows them."""
    from builder.bench.runners import modelled_speedups
    from builder.bench.report import dispatch_table

    dispatches = {"proofread": {"plain": {"k": 0, "steps": 8, "runs_per_step": 1, "dispatches_per_step": 2000},
                                "mtp k=4": {"k": 4, "steps": 2, "runs_per_step": 2, "dispatches_per_step": 2500}}}
    row = lambda rt, prompts, tau: {"runtime": rt, "task": "proofread", "mode": "mtp", "k": 4,  # noqa: E731
                                    "prompts": prompts, "new_tokens": 32, "tau": tau}
    modelled_speedups(dispatches, [row("browser-webgpu", 2, 5.0), row("onnx-cpu", 10, 4.0)])
    mtp = dispatches["proofread"]["mtp k=4"]
    assert (mtp["tau"], mtp["tau_from"], mtp["modelled_speedup"]) == (4.0, "onnx-cpu", 3.2)
    assert "| proofread | mtp k=4 | 2 | 2500 | 4.00 (onnx-cpu) | 3.20x |" in dispatch_table(dispatches)


def test_peers_run_in_our_rounds_interleaved_and_each_round_compares_like_with_like():
    """measure() with peers: every round runs our modes and the peers on the same prompts, the peers first in
    even rounds and last in odd ones; their rows are plain rows checked against the reference (a peer going
    on past the end token is cut there), and the report gives each round's MTP / peer ratio."""
    from builder.bench.report import peers_table
    from builder.bench.measure import Plan, measure
    from builder.decode.loop import Decoded

    ref = Decoded(ids=[5, 6, 7, 2], margins=[9.0] * 4)
    prompts = {"proofread": [([1, 2, 3], "a"), ([1, 4], "b")]}
    refs = {("proofread", text, 4): ref for _, text in prompts["proofread"]}
    calls, clock = [], {"s": 1.0}  # each round the machine takes 1.5x as long: drift touches every runner

    def ours(ids, text, task, mode, k, n):
        calls.append(mode if n == 4 else "warm-up")
        s = clock["s"] * (1.0 if mode == "ar" else 0.5)
        return Decoded(ids=[5, 6, 7, 2][:n], steps=2, accepted=[1, 1], lookups=[False, False], verified=[5, 5],
                       prefill_seconds=s / 4), s

    def peer(ids, n):
        calls.append("peer" if n == 4 else "warm-up")
        ms = clock["s"] * 800
        if calls.count("peer") % 2 == 0:  # every second prompt: a round's end, the machine slows
            clock["s"] *= 1.5
        return {"ids": [5, 6, 7, 2, 9][: n + 1], "prefill_ms": ms / 4, "decode_ms": ms * 3 / 4, "total_ms": ms}

    results, peers = measure("browser-wasm", ours, prompts, refs, Plan(2, 4, (4,), 2), {"transformersjs-wasm": peer}, 2)
    rounds = [c for c in calls if c != "warm-up"]
    assert rounds[:2] == ["peer", "peer"] and rounds[-2:] == ["peer", "peer"], rounds  # first in round 1, last in 2
    assert rounds.count("peer") == 4 and rounds.count("ar") == rounds.count("mtp") == rounds.count("drafter") == 4
    (row,) = peers
    assert (row["runtime"], row["interleaved_with"], row["task"], row["mode"]) == ("transformersjs-wasm", "browser-wasm",
                                                                                   "proofread", "ar")
    assert row["mismatches"] == 0 and row["mean_new_tokens"] == 5.0 and len(row["tokens_per_s_rounds"]) == 2
    assert abs(row["prefill_share"] - 0.25) < 1e-6
    mtp = next(r for r in results if r["mode"] == "mtp")
    table = peers_table({"results": results, "peer_config": {"prompts": 2, "new_tokens": 4, "repeats": 2},
                         "peers": [{"peer": "transformersjs", "threads": 2, **row}]})
    each = [a / b for a, b in zip(mtp["tokens_per_s_rounds"], row["tokens_per_s_rounds"])]
    assert f"| {each[0]:.2f} {each[1]:.2f} |" in table and "transformersjs-wasm ran in browser-wasm's rounds" in table


def test_the_profile_predicts_from_the_base_runs_each_mode_made_at_their_lengths():
    """measure() counts each MTP row's base runs by length and the head's runs (none in a lookup step, none in a
    last step with no room to draft); the report's prediction is plain time (tokens x t1) over the time of those
    runs, a length the profile lacks interpolated between two it has, each run at the task's own one-token time plus
    the profile's extra for its further tokens; an older row without the counts falls back to tau x t1 / (verify + head)."""
    from builder.bench.report import base_ms, own_t1, predicted_speedups
    from builder.bench.measure import Plan, measure
    from builder.decode.loop import Decoded

    ref = Decoded(ids=[5, 6, 7, 8, 9, 2], margins=[9.0] * 6)
    prompts = {"proofread": [([1, 2, 3], "a")]}

    def ours(ids, text, task, mode, k, n):  # mtp: a lookup step of 2k + 1, a head step, a last step with no drafts
        if mode == "ar":
            return Decoded(ids=ref.ids, steps=6, verified=[1] * 6), 1.0
        return Decoded(ids=ref.ids, steps=3, accepted=[3, 1, 0], lookups=[True, False, False],
                       verified=[2 * k + 1, k + 1, 1]), 0.5

    results, _ = measure("onnx-cpu", ours, prompts, {("proofread", "a", 6): ref}, Plan(1, 6, (2,), 2))
    mtp = next(r for r in results if r["mode"] == "mtp")
    assert mtp["base_runs_by_length"] == {"1": 2, "3": 2, "5": 2} and mtp["draft_runs"] == 2 and mtp["tokens"] == 12
    ms = {"base T=1": 10.0, "base T=3": 14.0, "base T=7": 22.0, "head k=2": 1.0}
    assert base_ms(ms, 5) == 18.0 and base_ms(ms, 9) is None
    fast, free = predicted_speedups(mtp, ms, 2)
    assert abs(fast - 120 / (2 * (10 + 14 + 18) + 2 * 1.0)) < 1e-9 and abs(free - 120 / 84) < 1e-9
    # the task's own one-token run (its plain decoding: 6 tokens a second after the prefill) for t1, and a run over
    # T tokens costing it plus the profile's extra for T - 1 more tokens
    t1 = own_t1({"results": results}, "onnx-cpu", "proofread")
    assert abs(t1 - 1000 / 6) < 1e-6 and own_t1({"results": results}, "onnx-cpu", "reply") is None
    fast, free = predicted_speedups(mtp, ms, 2, t1=16.0)
    assert abs(fast - 12 * 16 / (2 * (16 + 20 + 24) + 2 * 1.0)) < 1e-9 and abs(free - 12 * 16 / 120) < 1e-9
    old = {"tau": 3.0}
    assert predicted_speedups(old, ms, 2) == predicted_speedups(old, ms, 2, t1=16.0) == (3.0 * 10 / 15, 3.0 * 10 / 14)
