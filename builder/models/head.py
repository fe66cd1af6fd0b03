"""The frozen MTP head: drafts k tokens from the base's hidden state and KV cache.

One draft step (EAGLE / Gemma-4 MTP style), for the draft at position p = anchor + j:

    z = fc([norm(embed(token at p)); norm(h)])          h: the base's final hidden state at the anchor
                                                          (j = 1), then the head's own output (j > 1)
    num_layers times:
        z = z + attn(norm(z))  queries from z; keys/values: the base's cache of layer `kv_layer` at
                               positions 0..anchor, plus this layer's own keys of the chain's drafts
        z = z + mlp(norm(z))
    h = norm(z);  draft = argmax(base.lm_head(h))

The head reuses the base's embedding and LM head and reads its KV cache as it is: it has no cache of
its own over the prompt and no prefill. Within one step it keeps the keys/values of its at most k
drafts (the chain), which are dropped after the step.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn

from ..atomic import replacing
from ..errors import CheckpointError
from .fingerprint import base_fingerprint
from .llama import MLP, WEIGHTS_FILES, Llama, LlamaConfig, RMSNorm, apply_rope, load_config, load_state, rope_cos_sin


@dataclass
class HeadConfig:
    hidden_size: int              # = the base's
    intermediate_size: int        # the head's MLP width
    num_attention_heads: int      # = the base's (queries read the base's keys)
    num_key_value_heads: int      # = the base's
    kv_layer: int                 # which base layer's KV cache the head attends to
    rms_norm_eps: float
    rope_theta: float
    num_layers: int = 1           # the head's decoder layers (each reads the base's layer kv_layer)
    k_train: int = 6              # draft chain length trained for (the most k it is used with)
    base_fingerprint: str = ""    # base_fingerprint() of the base the head was trained for
    draft_vocab: int = 0          # tokens the head can draft (0: the base's whole vocabulary); a reduced
                                  # draft vocabulary (FR-Spec) scores only the rows `d2t` of the LM head

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def for_base(cls, base: LlamaConfig, **overrides) -> "HeadConfig":
        cfg = cls(hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
                  num_attention_heads=base.num_attention_heads, num_key_value_heads=base.num_key_value_heads,
                  kv_layer=base.num_hidden_layers - 1, rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return cfg


@torch.no_grad()
def induction_scores(base: Llama, length: int = 48, batch: int = 4, seed: int = 0) -> list[float]:
    """Per base layer, its strongest attention head's induction score: on random tokens repeated twice,
    the attention a query in the second copy pays to the token that followed its first occurrence.
    That is how a model copies (a proofread answer is mostly a copy of the prompt); a layer whose keys
    support it is the one whose KV cache lets the head copy too."""
    cfg = base.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, length), generator=g)
    ids, T = torch.cat((x, x), dim=1), 2 * length
    queries = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, out: queries.append(out))
             for layer in base.model.layers]
    try:
        _, _, cache = base(ids.to(next(base.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    cos, sin = rope_cos_sin(torch.arange(T), cfg.head_dim, cfg.rope_theta)
    second = torch.arange(length, T)
    scores = []
    for q, (k, _) in zip(queries, cache):
        q = apply_rope(q.float().cpu().view(batch, T, cfg.num_attention_heads, cfg.head_dim), cos, sin)
        k = k.float().cpu().repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=2)
        att = torch.einsum("bthd,bshd->bhts", q, k) * cfg.head_dim ** -0.5
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(dim=-1)
        scores.append(round(float(att[:, :, second, second - length + 1].mean(dim=(0, 2)).max()), 4))
    return scores


class HeadAttention(nn.Module):
    """Queries from the head's input; keys/values from the base's cache plus the chain's own."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, base_k, base_v, base_mask, chain: list):
        """x (B, N, C): one query per anchor. base_k/v (B, S, n_kv, D); base_mask (N, S), True where
        anchor n may read base position s. chain: this chain's earlier (k, v), each (B, N, n_kv, D);
        the new (k, v) is appended to it."""
        B, N, _ = x.shape
        g = self.n_heads // self.n_kv
        q = apply_rope(self.q_proj(x).view(B, N, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, N, self.n_kv, self.head_dim), cos, sin)
        chain.append((k, self.v_proj(x).view(B, N, self.n_kv, self.head_dim)))
        q = q.view(B, N, self.n_kv, g, self.head_dim) * self.head_dim ** -0.5  # grouped: no repeated keys
        ko = torch.stack([c[0] for c in chain], dim=2)                          # (B, N, J, n_kv, D)
        vo = torch.stack([c[1] for c in chain], dim=2)
        s_base = torch.einsum("bnkgd,bskd->bnkgs", q, base_k)                   # (B, N, n_kv, g, S)
        s_base = s_base.masked_fill(~base_mask[None, :, None, None, :], float("-inf"))
        s_own = torch.einsum("bnkgd,bnjkd->bnkgj", q, ko)                       # (B, N, n_kv, g, J)
        p = torch.cat((s_base, s_own), dim=-1).softmax(dim=-1, dtype=torch.float32).to(x.dtype)
        S = base_k.shape[1]
        y = torch.einsum("bnkgs,bskd->bnkgd", p[..., :S], base_v) + torch.einsum("bnkgj,bnjkd->bnkgd", p[..., S:], vo)
        return self.o_proj(y.reshape(B, N, -1))


class HeadLayer(nn.Module):
    """One decoder layer of the head: attention over the base's cache and the chain, then a SwiGLU MLP."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, z, cos, sin, base_k, base_v, base_mask, chain: list):
        z = z + self.self_attn(self.input_layernorm(z), cos, sin, base_k, base_v, base_mask, chain)
        return z + self.mlp(self.post_attention_layernorm(z))


class MTPHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.config = cfg
        C = cfg.hidden_size
        self.norm_embed = RMSNorm(C, cfg.rms_norm_eps)
        self.norm_hidden = RMSNorm(C, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * C, C, bias=False)
        self.layers = nn.ModuleList(HeadLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(C, cfg.rms_norm_eps)
        if cfg.draft_vocab:  # draft index -> token id (EAGLE-3's d2t), the base's most emitted tokens
            self.register_buffer("d2t", torch.arange(cfg.draft_vocab))

    def draft_logits(self, base: Llama, hidden):
        """Scores of the draft vocabulary: the base's LM head, or its rows d2t."""
        if not self.config.draft_vocab:
            return base.lm_head(hidden)
        return torch.nn.functional.linear(hidden, base.lm_head.weight[self.d2t])

    def restrict_vocabulary(self, ids: torch.Tensor) -> None:
        """Drafts only these token ids from now on (a smaller draft vocabulary than the head's, FR-Spec: fewer
        LM-head rows scored a draft). The head's weights do not depend on the vocabulary: they are kept."""
        if self.config.draft_vocab and not bool(torch.isin(ids, self.d2t).all()):
            raise ValueError("a draft vocabulary can only shrink: these ids are not all in the head's")
        self.config.draft_vocab = len(ids)
        self.register_buffer("d2t", ids.sort().values.to(next(self.parameters()).device))

    def token_ids(self, index):
        """Token ids of draft-vocabulary indices (argmaxes of draft_logits)."""
        return self.d2t[index] if self.config.draft_vocab else index

    def new_chains(self) -> list[list]:
        """Empty per-layer chains (each layer's keys/values of the drafts so far) for a fresh step."""
        return [[] for _ in self.layers]

    def step(self, hidden, token_embed, positions, base_k, base_v, base_mask, chains):
        """One draft for every anchor: hidden, token_embed (B, N, C) at positions (N,) -> new hidden (B, N, C).
        chains: new_chains() at the first draft, then the same lists (each layer appends its keys)."""
        cos, sin = (t.to(hidden.dtype) for t in rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta))
        z = self.fc(torch.cat((self.norm_embed(token_embed), self.norm_hidden(hidden)), dim=-1))
        for layer, chain in zip(self.layers, chains):
            z = layer(z, cos, sin, base_k, base_v, base_mask, chain)
        return self.norm(z)

    def vocabulary(self, base: Llama):
        """The draft vocabulary on the base's weights: (embed: draft index -> its token's embedding,
        score: hidden -> scores over the draft vocabulary). The ONNX graphs hold only its rows (graphs.py)."""
        return (lambda index: base.model.embed_tokens(self.token_ids(index))), (lambda h: self.draft_logits(base, h))

    @torch.no_grad()
    def draft(self, base: Llama, hidden: torch.Tensor, token: int, cache, k: int) -> tuple[list[int], list[float]]:
        """k greedy drafts after the anchor, and the head's confidence in each (draft_ids): hidden (C,) is the
        base's at the anchor, the last cached position; token is the base's choice there (not yet in the cache)."""
        base_k, base_v = cache[self.config.kv_layer]  # (1, S, n_kv, D), positions 0..anchor
        token_embed = base.model.embed_tokens(torch.tensor([[token]]))
        drafts, confidence = self.draft_ids(self.vocabulary(base), hidden.view(1, 1, -1), token_embed, base_k, base_v, k)
        return drafts[0].tolist(), confidence[0].tolist()

    def draft_ids(self, vocabulary, hidden, token_embed, base_k, base_v, k: int, anchor=None):
        """The draft chain on tensors (also what the ONNX graphs run, unrolled): hidden (1, 1, C) at the
        anchor, token_embed (1, 1, C) the embedding of the base's choice there, base_k/v (1, S, n_kv, D) the
        cache of layer kv_layer -> drafts (1, k) and their confidence (1, k), float32: the probability the head
        gives each draft (its softmax's top), which the decode loop may cut the drafts by (loop.py's draft_cut).
        vocabulary: (embed, score) as `vocabulary` returns. anchor (1,): the anchor's position in base_k/v, the
        last (S - 1) by default; later positions are masked out, as if the cache had been rolled back to it."""
        embed, score = vocabulary
        S = base_k.shape[1]
        if anchor is None:
            anchor = torch.arange(S - 1, S, device=base_k.device)
        mask = (torch.arange(S, device=base_k.device) <= anchor)[None]  # (1, S)
        chains, logits = self.new_chains(), []
        for j in range(1, k + 1):
            hidden = self.step(hidden, token_embed, anchor + j, base_k, base_v, mask, chains)
            logits.append(score(hidden))  # (1, 1, V)
            if j < k:
                token_embed = embed(logits[-1].argmax(dim=-1))  # (1, 1, C): fed to the next step
        # one argmax over all the chain's logits rather than a concatenation of its token ids:
        # onnxruntime-web's WebGPU EP has no int64 Concat, and on the CPU it would download every draft
        logits = torch.cat(logits, dim=1)  # (1, k, V)
        return self.token_ids(logits.argmax(dim=-1)), torch.softmax(logits.float(), dim=-1).amax(dim=-1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def init_random(module: nn.Module, seed: int) -> None:
    """A fresh head's (or layer's) weights: every matrix N(0, 0.02) from a seeded generator; norms stay 1."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def grow(head: MTPHead, num_layers: int, seed: int = 0) -> MTPHead:
    """The head with decoder layers appended up to num_layers. Each new layer starts as the identity (its
    attention and MLP output projections zero, the rest random), so training goes on from exactly the
    head it was: a deeper second stage."""
    cfg = HeadConfig(**{**asdict(head.config), "num_layers": num_layers})
    deeper = MTPHead(cfg)
    with torch.no_grad():
        for i, layer in enumerate(deeper.layers[head.config.num_layers:]):
            init_random(layer, seed + i)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    missing, unexpected = deeper.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
    return deeper.to(next(head.parameters()).device)


def save_head(head: MTPHead, directory: str | Path, extra: dict | None = None) -> None:
    """Writes config.json and model.safetensors, both or neither (llama.py's save_llama)."""
    from safetensors.torch import save_file


    cfg = {"model_type": "frozen_mtp_head", **asdict(head.config), **(extra or {})}
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    with replacing(Path(directory), keep=True, fresh=WEIGHTS_FILES) as new:
        (new / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, new / "model.safetensors", metadata={"format": "pt"})


def read_head_config(directory: str | Path) -> HeadConfig:
    """A head checkpoint's config.json."""
    d = load_config(directory)
    if d.get("model_type") != "frozen_mtp_head":
        raise CheckpointError(f"{Path(directory) / 'config.json'} is not an MTP head (model_type {d.get('model_type')!r})")
    return HeadConfig(**{f.name: d[f.name] for f in fields(HeadConfig) if f.name in d})


def load_head(directory: str | Path, base: Llama) -> MTPHead:
    """Loads a head and checks it was trained for this very base (by fingerprint)."""
    cfg = read_head_config(directory)
    fp = base_fingerprint(base)
    if cfg.base_fingerprint != fp:
        raise CheckpointError(f"the head in {directory} was trained for another base (fingerprint "
                              f"{cfg.base_fingerprint[:12]}, this base is {fp[:12]}): train a head for it "
                              f"with `python -m builder train-head`")
    head = MTPHead(cfg)
    state = load_state(directory)
    # a one-layer head saved before heads had layers kept its layer's weights at the top level
    parts = {name for name, _ in head.layers[0].named_children()}
    state = {(f"layers.0.{k}" if k.split(".")[0] in parts else k): v for k, v in state.items()}
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(f"{Path(directory) / 'model.safetensors'} does not match its config.json: "
                              f"{str(e).splitlines()[0]}") from None
    return head.eval()
