"""The one model definition: KV cache semantics and real Hugging Face checkpoint compatibility."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from builder.decode.torch_backend import TorchBackend, decode_ar
from builder.errors import CheckpointError
from builder.models.llama import Llama, LlamaConfig, load_llama, save_llama
from tests.conftest import BASE_DIR

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: no token id may be taken for padding
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tied", [True, False])
def test_builder_checkpoint_loads_in_transformers_with_same_logits_and_tokens(tmp_path, tied):
    model = Llama(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    model.init_weights(seed=3)
    save_llama(model.eval(), tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    ours, _, _ = model(ids)
    diff = (ours - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-4, f"logits differ from transformers by {diff}"
    prompt = ids[0, :10].tolist()
    assert decode_ar(model, prompt, 20, None).ids == hf_greedy(hf, prompt, 20)


@pytest.mark.parametrize("kind, tied, theta", [("llama", False, 50000.0), ("qwen2", True, 1e6)])
def test_transformers_checkpoint_loads_in_builder_with_same_logits_and_tokens(tmp_path, kind, tied, theta):
    """A Llama, and a Qwen2 (attention biases on q/k/v, tied embeddings, a large rope_theta)."""
    torch.manual_seed(5)
    config, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    hf = model_class(config(**SMALL, tie_word_embeddings=tied, rope_theta=theta, rms_norm_eps=1e-6)).eval()
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: perturb them so a missed one shows
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    assert (kind == "qwen2") == any(name.endswith("bias") for name, _ in hf.named_parameters())
    hf.save_pretrained(tmp_path)
    model = load_llama(tmp_path)
    assert model.config.rope_theta == theta and model.config.tie_word_embeddings == tied
    assert model.config.attention_bias == (kind == "qwen2")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(1))
    ours, _, _ = model(ids)
    diff = (ours - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-4, f"logits differ from transformers by {diff}"
    prompt = ids[1, :7].tolist()
    assert decode_ar(model, prompt, 20, None).ids == hf_greedy(hf, prompt, 20)


def test_shipped_base_matches_transformers(base, tokenizer):
    # saved in fp16: compared in fp32, as builder loads it
    hf = transformers.LlamaForCausalLM.from_pretrained(BASE_DIR, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("The sqlite3 module provides an interface to databases.").ids])
    diff = (base(ids)[0] - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-4, f"shipped base: logits differ from transformers by {diff}"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BASE_DIR / "tokenizer.json"))
    text = "Naïve café: 東京, emoji 🙂 and   spaces\n\nend."
    assert fast.encode(text, add_special_tokens=False) == tokenizer.encode(text).ids


def test_cached_passes_equal_one_full_pass():
    model = Llama(LlamaConfig(**SMALL))
    model.init_weights(seed=1)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(2))
    full_logits, full_hidden, full_cache = model(ids)
    _, _, cache = model(ids[:, :7])                   # prefill 7
    l1, h1, cache = model(ids[:, 7:8], cache)         # one token
    l2, h2, cache = model(ids[:, 8:20], cache)        # twelve at once, as a verify pass would
    got = torch.cat((l1, l2), dim=1)
    assert (got - full_logits[:, 7:]).abs().max() < 1e-5
    assert (torch.cat((h1, h2), dim=1) - full_hidden[:, 7:]).abs().max() < 1e-5
    for (k, v), (fk, fv) in zip(cache, full_cache):
        assert k.shape == (1, 20, SMALL["num_key_value_heads"], 16), "cache must be (B, S, n_kv, head_dim)"
        assert torch.equal(k, fk) or (k - fk).abs().max() < 1e-5


def test_rollback_is_a_prefix_view_of_the_cache():
    """Discarding rejected positions = keeping the first n: a view, no copy, that acts as a cache of length n."""
    model = Llama(LlamaConfig(**SMALL))
    model.init_weights(seed=4)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(3))
    backend = TorchBackend(model)
    _, _, fed = backend.verify(backend.prefill(ids[0, :4].tolist()), ids[0, 4:12].tolist())  # 12 positions,
    kept = backend.rollback(fed, 4)  # of which the last 4 of the 8 verified get "rejected"
    assert kept.ids == ids[0, :8].tolist() and kept.hidden.shape[0] == 4
    for (k, v), (k0, v0) in zip(kept.cache, fed.cache):
        assert k.shape[1] == v.shape[1] == 8, "the cache must hold the 8 kept positions"
        assert k.data_ptr() == k0.data_ptr() and v.data_ptr() == v0.data_ptr(), "rollback must not copy"
    seven = torch.tensor([[7]])
    got, _, _ = model(seven, kept.cache)
    want, _, _ = model(torch.cat((ids[:, :8], seven), dim=1))
    assert (got[:, -1] - want[:, -1]).abs().max() < 1e-5


def test_unsupported_configuration_is_named(tmp_path):
    model = Llama(LlamaConfig(**SMALL))
    save_llama(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_llama(tmp_path)
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gpt2"):
        load_llama(tmp_path)
