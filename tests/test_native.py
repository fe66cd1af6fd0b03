"""The benchmark's native peer (builder/bench/native.py): llama.cpp on the CPU, node-llama-cpp's prebuilt
binary, on the shipped SmolLM2 GGUF. It fails, not skips, when bench/native/ is not installed (.ci/setup)."""
from __future__ import annotations

import pytest

from tests.conftest import ROOT

SMOL = ROOT / "models" / "base"


def test_llamacpp_decodes_the_smollm2_gguf_greedily_from_token_ids():
    """8 greedy tokens of one short prompt, twice in one process, one thread. As for wllama
    (test_peers.py), only the first token is set against torch: its reference margin is 1.19 logits, far
    above what llama.cpp's 8-bit activations move; later tokens may legitimately differ near a tie."""
    from builder.bench.native import run_llamacpp
    from builder.data.tasks import encode_prompt, load_tokenizer
    from builder.decode.torch_backend import decode_ar
    from builder.models.llama import load_config, load_llama

    tok = load_tokenizer(SMOL)
    eos = load_config(SMOL)["eos_token_id"]
    ids = encode_prompt(tok, "continue", "The quick brown fox")
    reference = decode_ar(load_llama(SMOL).eval(), ids, 1, eos).ids

    run = run_llamacpp([ids, ids], 8, threads=1, warmup=False)
    info, (first, second) = run["llamacpp_info"], run["results"]
    assert info["node_llama_cpp"] == "3.22.1" and info["build"] == "prebuilt" and info["gpu"] is False
    assert info["threads"] == 1 and info["eos"] == eos
    assert first["prompt_tokens"] == len(ids) == first["timings"]["prompt_n"]  # the ids, prefilled as given
    assert len(first["ids"]) == 8 and all(0 <= i < tok.get_vocab_size() for i in first["ids"])
    assert first["ids"][0] == reference[0]
    assert first["decode_ms"] > 0 and first["prefill_ms"] > 0 and first["tokens_per_s"] > 0
    assert first["timings"]["predicted_n"] == 7  # the prefill gave the first token, 7 one-token decodes the rest
    assert second["ids"] == first["ids"]  # greedy: the same output every run


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_bench_measures_a_peer_as_it_measures_plain_decoding():
    """bench's peer rows (run.measure_peer): every round of every task in one load, timed over the whole call
    and after the first token, checked against the same reference as our runtimes; the report sets our MTP
    against the fastest peer of the same place."""
    from builder.bench.report import peers_table
    from builder.bench.measure import Plan, measure_peer
    from builder.data.tasks import encode_prompt, load_tokenizer
    from builder.decode.torch_backend import decode_ar
    from builder.models.llama import load_llama

    tok, base = load_tokenizer(SMOL), load_llama(SMOL).eval()
    eos = base.config.eos_token_id
    prompts = {"continue": [(encode_prompt(tok, "continue", "The quick brown fox"), "The quick brown fox")],
               "proofread": [(encode_prompt(tok, "proofread", "Teh cat sat."), "Teh cat sat.")]}
    refs = {(t, text, 6): decode_ar(base, ids, 6, eos) for t, items in prompts.items() for ids, text in items}
    got = measure_peer("llamacpp", 1, prompts, refs, Plan(1, 6, None, 2), None, SMOL, eos)
    assert got["threads"] == 1 and [r["task"] for r in got["rows"]] == ["continue", "proofread"]
    for r in got["rows"]:
        assert len(r["tokens_per_s_rounds"]) == 2 and 0 < r["tokens_per_s"] < r["decode_tokens_per_s"]
        assert 0 < r["prefill_share"] < 1 and 1 <= r["mean_new_tokens"] <= 6
        # llama.cpp rounds activations to 8 bits, and its kernels depend on the CPU: whether it parts from our
        # reference varies by machine, but at one thread it is deterministic, so both rounds give one verdict
        assert r["mismatches"] + r["near_ties"] in (0, 2), f"rounds disagree: {r}"
    peers = [{"runtime": "llamacpp-native-1thread", "peer": "llamacpp", "threads": 1, **r} for r in got["rows"]]
    ours = [{"runtime": "onnx-cpu", "task": r["task"], "mode": mode, "k": k, "tokens_per_s": r["tokens_per_s"] * x,
             "tokens_per_s_rounds": [r["tokens_per_s"] * x], "speedup_vs_ar": x / 0.5} for r in got["rows"]
            for mode, k, x in (("ar", 0, 0.5), ("mtp", 4, 1.6))]
    table = peers_table({"peers": peers, "results": ours, "peer_config": {"prompts": 1, "new_tokens": 6, "repeats": 2}})
    assert table.count("| llamacpp-native-1thread | 1 |") == 2
    assert "| onnx-cpu | proofread |" in table and table.count("1.60x (1.5x, met)") == 2  # every feature's goal: 1.5x
