"""The benchmark's native peer (builder/bench/native.py): llama.cpp on the CPU, node-llama-cpp's prebuilt
binary, on the shipped SmolLM2 GGUF. It fails, not skips, when bench/native/ is not installed (.ci/setup)."""
from __future__ import annotations

from tests.conftest import ROOT

SMOL = ROOT / "models" / "smollm2"


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
