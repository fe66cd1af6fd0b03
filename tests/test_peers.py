"""The benchmark's wllama peer (builder/bench/peers.py): llama.cpp in WebAssembly on the shipped SmolLM2
GGUF, in the same headless Chromium as the page."""
from __future__ import annotations

from tests.conftest import ROOT

SMOL = ROOT / "models" / "base"


def test_wllama_decodes_the_smollm2_gguf_greedily_from_token_ids(browser):
    """8 greedy tokens of one short prompt, twice in one page. The first token's reference margin is 1.19
    logits, far above what llama.cpp's 8-bit activations for its Q4_1 dot products move; later tokens may
    legitimately differ near a tie (the 8th here: margin 0.25), so only the first is set against torch."""
    from builder.bench.peers import run_wllama
    from builder.data.tasks import encode_prompt, load_tokenizer
    from builder.decode.torch_backend import decode_ar
    from builder.models.llama import load_config, load_llama

    tok = load_tokenizer(SMOL)
    ids = encode_prompt(tok, "continue", "The quick brown fox")
    reference = decode_ar(load_llama(SMOL).eval(), ids, 1, load_config(SMOL)["eos_token_id"]).ids

    run = run_wllama(browser, [ids, ids], 8, threads=1, warmup=False)
    info, (first, second) = run["wllama_info"], run["results"]
    assert info["version"] == "3.8.1" and info["threads"] == 1 and info["crossOriginIsolated"]
    assert first["prompt_tokens"] == len(ids)  # llama.cpp read back exactly the ids the page was given
    assert len(first["ids"]) == 8 and all(0 <= i < tok.get_vocab_size() for i in first["ids"])
    assert first["ids"][0] == reference[0]
    assert first["decode_ms"] > 0 and first["prefill_ms"] > 0 and first["tokens_per_s"] > 0
    assert second["ids"] == first["ids"]  # greedy: the same output every run
