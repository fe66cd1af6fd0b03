"""The one model definition: a Llama-family decoder, read and written as a Hugging Face checkpoint.

Used for training, reference decoding and export alike. Parameter names equal those of
`transformers`' LlamaForCausalLM, so a state dict maps one to one onto `model.safetensors`.

KV cache layout: per layer a pair (key, value), each (B, S, n_kv_heads, head_dim): the sequence axis
comes right after the batch axis, so the first n positions of a cache are themselves a valid cache of
length n (rollback is a prefix view, with no copy).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..atomic import locked, replacing
from ..errors import CheckpointError
from . import gguf
from .config import load_config

logger = logging.getLogger(__name__)

WEIGHTS_FILES = ("config.json", "model.safetensors")  # what a save writes (the checkpoint's other files stay)
KV = tuple[torch.Tensor, torch.Tensor]  # (key, value), each (B, S, n_kv_heads, head_dim)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # what an adapter adapts


# what config.json must give (the rest has Hugging Face's defaults), and the check of each field's type
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
TYPES = {"int": lambda v: type(v) is int and v > 0, "float": lambda v: type(v) in (int, float) and v > 0,
         "bool": lambda v: type(v) is bool, "int | None": lambda v: v is None or type(v) is int or
         (type(v) is list and all(type(i) is int for i in v))}  # eos_token_id: one id or a list
TYPE_NAMES = {"int": "a whole number above 0", "float": "a number above 0", "bool": "true or false",
              "int | None": "a token id or null"}


@dataclass
class LlamaConfig:
    vocab_size: int = 4096              # tokens in the vocabulary
    hidden_size: int = 256              # width of the residual stream
    intermediate_size: int = 704        # width of the SwiGLU MLP
    num_hidden_layers: int = 6          # decoder layers
    num_attention_heads: int = 8        # query heads
    num_key_value_heads: int = 4        # key/value heads (grouped-query attention when fewer than query heads)
    max_position_embeddings: int = 256  # context window, in tokens
    rms_norm_eps: float = 1e-5          # epsilon of every RMSNorm
    rope_theta: float = 10000.0         # base of the rotary position embedding
    tie_word_embeddings: bool = True    # the LM head shares the embedding matrix
    attention_bias: bool = False        # biases on q/k/v projections (Qwen2-style checkpoints)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self) -> dict:
        d = asdict(self)
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 head_dim=self.head_dim, mlp_bias=False, attention_dropout=0.0,
                 initializer_range=0.02, rope_scaling=None, torch_dtype="float32", use_cache=True,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})  # transformers >= 5
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        model_type = d.get("model_type")
        if model_type not in ("llama", "qwen2"):
            raise CheckpointError(f"unsupported model_type {model_type!r}: only Llama-family checkpoints are supported")
        absent = [k for k in REQUIRED if k not in d]
        if absent:
            raise CheckpointError(f"config.json lacks {', '.join(absent)}")
        for f in fields(cls):
            if f.name in d and not TYPES[f.type](d[f.name]):
                raise CheckpointError(f"config.json: {f.name} is {d[f.name]!r}, not {TYPE_NAMES[f.type]}")
        unsupported = []
        rope = d.get("rope_parameters") or {}  # transformers >= 5 writes rope_theta here
        if rope.get("rope_type", "default") != "default":
            unsupported.append(f"rope_parameters={rope!r}")
        if "rope_theta" in rope:
            d = {**d, "rope_theta": rope["rope_theta"]}
        if d.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={d['hidden_act']!r}")
        if d.get("rope_scaling"):
            unsupported.append(f"rope_scaling={d['rope_scaling']!r}")
        if d.get("mlp_bias"):
            unsupported.append("mlp_bias=true")
        if d.get("head_dim") not in (None, d["hidden_size"] // d["num_attention_heads"]):
            unsupported.append(f"head_dim={d['head_dim']} (not hidden_size / num_attention_heads)")
        if unsupported:
            raise CheckpointError("unsupported configuration: " + ", ".join(unsupported))
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        kwargs["attention_bias"] = bool(d.get("attention_bias", model_type == "qwen2"))
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        return cls(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # in fp32 whatever x's dtype (as transformers does): fp16 squares overflow
        x32 = x.to(torch.float32)
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos and sin for the given positions (T,), each (T, head_dim), in Hugging Face's half-split layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x: (B, T, H, D); cos, sin: (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def attend(q, k, v, past_len: int, key_bias=None):
    """Causal attention of T new queries at positions past_len.. over S = past_len + T keys.

    q: (B, T, Hq, D); k, v: (B, S, Hkv, D) -> (B, T, Hq, D). Grouped-query: each key/value head serves
    Hq / Hkv query heads. key_bias (B, S): added to every query's score of a key (-1e9: a left padding
    that no real query sees; never exported).
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    # query head h reads key/value head h // g: the g query heads of a key head and their T positions
    # are the rows of one matrix, so the keys are never repeated (no copy of the cache per step)
    q = q.view(B, T, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * T, D)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S, D)
    q_pos = torch.arange(T, device=q.device)[:, None] + past_len
    future = torch.arange(S, device=q.device)[None, :] > q_pos  # (T, S): keys a query must not see
    # The causal mask is added (0 or -inf: the same scores, bit for bit, as masked_fill) as one (T, S)
    # tensor: onnxruntime runs a broadcast Add several times faster than the Where of masked_fill, which
    # was a sixth of a long prompt's prefill.
    mask = torch.zeros(T, S, dtype=q.dtype, device=q.device).masked_fill(future, float("-inf"))
    if key_bias is not None:
        mask = mask + key_bias[:, None, None, None, :].to(q.dtype)
    # Written out rather than F.scaled_dot_product_attention: its export guards the softmax with IsNaN,
    # which onnxruntime-web runs on the CPU, downloading every layer's attention weights each step.
    att = ((q @ k.transpose(-2, -1)) * D ** -0.5).view(B, Hkv, g, T, S) + mask
    att = att.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    y = att.view(B, Hkv, g * T, S) @ v  # (B, Hkv, g * T, D)
    return y.view(B, Hkv, g, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


def causal_sdpa(q, k, v):
    """attend() for a sequence with no past, through F.scaled_dot_product_attention (never exported)."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)  # (B, T, Hq, D)


class Projection(nn.Linear):
    """A frozen-able projection x W^T (+ b), plus, once an adapter is attached (`add_adapter`), its low-rank
    update scale * (x A^T) B^T: A (r, in) and B (out, r) named `lora_A.weight` / `lora_B.weight` as PEFT names
    them, so an adapter's tensors map one to one onto a PEFT `adapter_model.safetensors`."""
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A: nn.Linear | None = None  # (rank, in)
        self.lora_B: nn.Linear | None = None  # (out, rank)
        self.lora_scale = 0.0                 # alpha / rank

    def forward(self, x):
        y = super().forward(x)
        if self.lora_A is not None:
            y = y + self.lora_B(self.lora_A(x)) * self.lora_scale
        return y


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Projection(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Projection(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = Projection(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = Projection(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, past: KV | None, key_bias=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past_len = 0
        if past is not None:
            past_len = past[0].shape[1]
            k = torch.cat((past[0], k), dim=1)  # (B, S, n_kv, D)
            v = torch.cat((past[1], v), dim=1)
        if self.training and past is None and key_bias is None:  # training only: PyTorch's fused kernel, a quarter faster on CPU
            y = causal_sdpa(q, k, v)
        else:  # decoding and export
            y = attend(q, k, v, past_len, key_bias)  # (B, T, Hq, D)
        return self.o_proj(y.reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = Projection(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Projection(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, past: KV | None, key_bias=None):
        a, present = self.self_attn(self.input_layernorm(x), cos, sin, past, key_bias)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int):
        """GPT-2 style initialisation (the residual output projections scaled by depth)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.config.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, input_ids: torch.Tensor, past: list[KV] | None = None, key_bias=None, logits_at=None,
                at=None):
        """input_ids (B, T) at positions past_len..past_len+T-1 (key_bias (B, past_len + T): see attend).

        Returns logits (B, T, V), hidden (B, T, C) - the final normed hidden states the LM head reads -
        and the present cache: per layer (key, value), each (B, past_len + T, n_kv_heads, head_dim).
        logits_at: a (B, T) mask; the logits then only where it is True, (P, V) (training: a big vocabulary).
        at: (U,) indices of fed positions; logits (B, U, V) and hidden (B, U, C) only there (decoding: a
        prefill needs the choice after its last token alone, and the LM head is a fifth of a pass).
        """
        past_len = past[0][0].shape[1] if past else 0
        T = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = (t.to(x.dtype) for t in rope_cos_sin(torch.arange(past_len, past_len + T, device=input_ids.device),
                                                         self.config.head_dim, self.config.rope_theta))
        present = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, past[i] if past else None, key_bias)
            present.append(kv)
        hidden = self.model.norm(x)  # (B, T, C): of every row, so the graphs keep the last norm fused (fuse.py)
        if at is not None:
            hidden = hidden.index_select(1, at)  # (B, U, C)
        return self.lm_head(hidden if logits_at is None else hidden[logits_at]), hidden, present

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# --- Hugging Face checkpoint I/O ------------------------------------------------------------------

def load_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """Reads model.safetensors, with a clear error when it is missing or corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / "model.safetensors"
    if not path.is_file() and (Path(directory) / "model.safetensors.index.json").is_file():
        raise CheckpointError(f"{directory} holds a sharded checkpoint (model.safetensors.index.json): builder reads "
                              f"one model.safetensors; save it unsharded (save_pretrained(..., max_shard_size='100GB'))")
    if (Path(directory) / "gguf.json").is_file():  # an imported base: its cache, made again when missing or damaged
        if not (path.is_file() and gguf.cache_intact(Path(directory))):  # an intact cache needs no lock (read-only folders)
            with locked(path):  # two commands starting at once import it once
                if path.is_file() and not gguf.cache_intact(Path(directory)):
                    logger.info("%s is not the cache the import wrote (truncated, altered or unchecked): importing again", path)
                if not (path.is_file() and gguf.cache_intact(Path(directory))):
                    gguf.materialize(Path(directory))
    if not path.is_file():
        raise CheckpointError(f"missing {path}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt or not a safetensors file: {e}") from None


def load_llama(directory: str | Path) -> Llama:
    """Loads a Hugging Face Llama-family checkpoint (config.json + model.safetensors) in fp32."""
    try:
        cfg = LlamaConfig.from_hf(load_config(directory))
    except CheckpointError as e:
        raise CheckpointError(str(e).replace("config.json", str(Path(directory) / "config.json"), 1)) from None
    model = Llama(cfg)
    state = {k: v.to(torch.float32) for k, v in load_state(directory).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise CheckpointError(f"{Path(directory) / 'model.safetensors'} does not match config.json: "
                              f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    for k in expected:
        if state[k].shape != model.state_dict()[k].shape:
            raise CheckpointError(f"{k} has shape {tuple(state[k].shape)}, config.json implies "
                                  f"{tuple(model.state_dict()[k].shape)}")
    model.load_state_dict(state, strict=False)
    return model.eval()


def save_llama(model: Llama, directory: str | Path, extra: dict | None = None) -> None:
    """Writes config.json and model.safetensors as transformers' save_pretrained would; extra: more keys for
    config.json (transformers keeps unknown keys), e.g. the fingerprint of the base a drafter was distilled from.
    Both or neither: the folder is replaced whole (its other files kept), never left half old, half new."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".lora_" not in k}  # the base alone
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    with replacing(Path(directory), keep=True, fresh=WEIGHTS_FILES) as new:
        (new / "config.json").write_text(json.dumps({**model.config.to_hf(), **(extra or {})}, indent=2) + "\n")
        save_file(state, new / "model.safetensors", metadata={"format": "pt"})
