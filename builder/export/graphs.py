"""The ONNX graphs of the base, the MTP head and the independent drafter, and the weights files they read.

Graphs, all exported from the one model definition (models/llama.py, models/head.py) through small
wrappers that only rename and flatten:

    base.onnx     input_ids (1, T), outputs_at (U,) int64: the fed positions (0..T-1) to decide after,
                  past_key_i / past_value_i (1, S, n_kv, head_dim) for every layer i
                  -> choices (1, U) int64     the greedy token after each of those positions (argmax in the graph)
                     margins (1, U) float     top-1 minus top-2 logit there (the exactness rule's; a page leaves it on the GPU)
                     hidden (1, U, C)         the final normed hidden states there
                     embeds (1, U, C)         the embedding of each choice (with a head that reads it)
                     present_key_i / present_value_i (1, S + T, n_kv, head_dim)
                  with adapters (manifest "adapters"): every projection's A^T and B^T of the feature's adapter
                  (zeros: the base alone), after the cache
                  T, U and S are dynamic; S = 0 is the prefill (one graph serves prefill, decode and verify).
                  A verify decides after every fed token (outputs_at 0..T-1); a prefill, and each run of the
                  drafter, only after the last (T - 1): the LM head over 49,152 tokens is a fifth of a
                  pass's arithmetic, which a prefill of T tokens would otherwise do T times for nothing.
    head_k{k}.onnx  k = 1..K: the head's chain of exactly k drafts (drafting k costs k steps)
                  hidden (1, T, C) and anchor (1,) int64: the base's hidden output as it is, and the
                  index of the anchor in it; token (1, 1) int64: the token after the anchor - or, for
                  a head with a draft vocabulary, embeds (1, T, C): the base's output as it is (the
                  embedding of its choice at the anchor is the head's first input);
                  past_key / past_value (1, S, n_kv, head_dim): the base's cache of layer kv_layer,
                  positions 0..anchor -> drafts (1, k) int64, each conditioned on the one before, and
                  confidence (1, k) float32 (in fp16 graphs too): the probability the head gives each
                  draft, its softmax's top, by which the decode loop may cut them (loop.py's draft_cut).
    drafter.onnx  the independent drafter, with the base graph's inputs and outputs (but embeds).

Each graph is exported in every precision asked for: fp32, and fp16 (`*.fp16.onnx`: the same modules
cast to half, every float input and output float16 but the head's confidence; RMSNorm and softmax compute in
fp32 inside).

In the fp32 graphs each residual RMSNorm and each rotary embedding is one of onnxruntime's fused
operators (com.microsoft domain, kernels on CPU, WASM and WebGPU; `fuse`): 35 % fewer nodes in the base.

Every weight is stored once. A graph file holds only the graph; its weights are ONNX external data in one
file per model and precision (`base.data`, `head.data`, `drafter.data`, `*.fp16.data`), found by
content: the six head graphs share the head's; a head over the whole vocabulary reads the embedding
and LM head from the base's file, a head with a draft vocabulary holds that vocabulary's rows of them
in its own (a page would otherwise load the whole embedding once more per head session). A checkpoint saved in fp16 (the shipped ones are) has its fp32 graphs read the fp16
files too, behind Casts (`half_stored`): one file per model, half the download, the same fp32 values.
Logits are never an output: the decode loop reads only token ids and the head's confidences.

The manifest that describes them is manifest.py's; the rewrites that fuse them, fuse.py's.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn

from ..contract import PRECISIONS
from ..decode.torch_backend import greedy
from ..models.adapter import add_adapter, is_adapter_key, remove_adapter
from ..models.head import MTPHead
from ..models.llama import Llama
from .fuse import INLINE_BYTES, fuse, half_stored, untranspose, without_provenance

OPSET = 18


class BaseGraph(nn.Module):
    """The base with flat per-layer KV inputs/outputs and the greedy choice and margin computed inside;
    with embeds, also the embedding of each choice (what the head's first draft step reads).

    With an adapter attached, every projection also computes its low-rank update (models/llama.Projection)
    on tensors fed as inputs: one session serves every feature, and zeros feed the base alone (its output
    plus exactly 0). Each input is an adapter tensor transposed (A^T (in, r), B^T (r, out): the graph
    multiplies by them as they are, no Transpose per run), B^T already scaled by alpha / rank (the graph's
    own scale is 1: one Mul fewer per projection; manifest.adapter_manifest says how)."""

    def __init__(self, base: Llama, embeds: bool = True):
        super().__init__()
        self.base, self.embeds = base, embeds
        self.lora = [name for name, _ in self.base.named_parameters() if is_adapter_key(name)]

    def forward(self, input_ids, outputs_at, past: list[torch.Tensor], lora: list[torch.Tensor] = ()):
        args, weights = (input_ids, list(zip(past[0::2], past[1::2]))), {n: t.t() for n, t in zip(self.lora, lora)}
        logits, hidden, present = torch.func.functional_call(self.base, weights, args, {"at": outputs_at})
        choices, margins = greedy(logits[0])  # (U,), (U,): after each position of outputs_at
        extra = [self.base.model.embed_tokens(choices)[None]] if self.embeds else []
        return choices[None], margins[None], hidden, *extra, [t for kv in present for t in kv]


class HeadGraph(nn.Module):
    """The head's chain of k drafts in one graph, reading the base's outputs as they are.

    A head over the whole vocabulary reads the base's embedding and LM head (from the base's file) and
    takes the token after the anchor as an id (`token`). A head with a draft vocabulary holds only that
    vocabulary's rows of them and takes the base's choice at the anchor already embedded (`embeds`, the
    base graph's output): a page never loads the whole embedding a second time, and such a head drafts
    only after a token the base chose (loop.py)."""

    def __init__(self, head: MTPHead, base: Llama, k: int):
        super().__init__()
        self.head, self.k = head, k
        if not head.config.draft_vocab:
            self.base = base
            self.vocabulary = head.vocabulary(base)
            return
        self.register_buffer("draft_rows", base.lm_head.weight[head.d2t].detach().clone())
        if base.lm_head.weight is base.model.embed_tokens.weight:
            self.draft_embed = self.draft_rows  # tied: one tensor
        else:
            self.register_buffer("draft_embed", base.model.embed_tokens.weight[head.d2t].detach().clone())
        self.vocabulary = (lambda index: nn.functional.embedding(index, self.draft_embed),
                           lambda h: nn.functional.linear(h, self.draft_rows))

    def forward(self, hidden, token_or_embeds, anchor, past_key, past_value):
        h = hidden.index_select(1, anchor)  # (1, 1, C): the base's hidden state at the anchor
        if self.head.config.draft_vocab:  # (1, T, C) the embeddings of the base's choices: the anchor's
            e = token_or_embeds.index_select(1, anchor)
        else:  # (1, 1) the token after the anchor
            e = self.base.model.embed_tokens(token_or_embeds)
        return self.head.draft_ids(self.vocabulary, h, e, past_key, past_value, self.k)  # drafts, confidence


# --- the I/O contract of each graph ------------------------------------------------------------------

def io(name: str, dtype: str, shape: list, location: str | None = None) -> dict:
    d = {"name": name, "dtype": dtype, "shape": shape}
    if location:
        d["location"] = location
    return d


def float_type(module: nn.Module) -> str:
    """The ONNX name of a module's float type: its graphs' float inputs and outputs have this type."""
    return str(next(module.parameters()).dtype).removeprefix("torch.").replace("half", "float16")


def base_io(base: Llama, embeds: bool = True) -> dict:
    """The base graph's inputs and outputs; an attached adapter's tensors are inputs after the cache, named
    as PEFT names them less its prefix (models/adapter.py), in the base's float type."""
    cfg, fl = base.config, float_type(base)
    kv = [cfg.num_key_value_heads, cfg.head_dim]
    layers = range(cfg.num_hidden_layers)
    past = [io(f"past_{kind}_{i}", fl, [1, "S", *kv]) for i in layers for kind in ("key", "value")]
    present = [io(f"present_{kind}_{i}", fl, [1, "S + T", *kv], "gpu") for i in layers for kind in ("key", "value")]
    lora = [io(name.removesuffix(".weight") + ".T", fl, list(p.shape)[::-1])
            for name, p in base.named_parameters() if is_adapter_key(name)]
    return {"inputs": [io("input_ids", "int64", [1, "T"]), io("outputs_at", "int64", ["U"])] + past + lora,
            "outputs": [io("choices", "int64", [1, "U"], "cpu"), io("margins", fl, [1, "U"], "gpu"),
                        io("hidden", fl, [1, "U", cfg.hidden_size], "gpu")]
                       + ([io("embeds", fl, [1, "U", cfg.hidden_size], "gpu")] if embeds else []) + present}


def head_io(head: MTPHead, k: int) -> dict:
    cfg, fl = head.config, float_type(head)
    kv = [cfg.num_key_value_heads, cfg.head_dim]
    token = io("embeds", fl, [1, "T", cfg.hidden_size]) if cfg.draft_vocab else io("token", "int64", [1, 1])
    return {"inputs": [io("hidden", fl, [1, "T", cfg.hidden_size]), token, io("anchor", "int64", [1]),
                       io("past_key", fl, [1, "S", *kv]),
                       io("past_value", fl, [1, "S", *kv])],
            "outputs": [io("drafts", "int64", [1, k], "cpu"), io("confidence", "float32", [1, k], "gpu")]}


def names(spec: list[dict]) -> list[str]:
    return [s["name"] for s in spec]


def kv_layout(spec: dict, cfg) -> dict:
    """The KV cache of a base-shaped graph (the base's or the drafter's): names in order, shape."""
    return {"layers": cfg.num_hidden_layers, "shape": [1, "S", cfg.num_key_value_heads, cfg.head_dim],
            "sequence_axis": 1,
            "past_inputs": [n for n in names(spec["inputs"]) if n.startswith("past_")],
            "present_outputs": [n for n in names(spec["outputs"]) if n.startswith("present_")]}


# --- exporting ---------------------------------------------------------------------------------------

def to_onnx(module: nn.Module, args: tuple, spec: dict, dynamic_shapes) -> onnx.ModelProto:
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module.eval(), args, None, input_names=names(spec["inputs"]),
                                    output_names=names(spec["outputs"]), dynamic_shapes=dynamic_shapes,
                                    opset_version=OPSET, dynamo=True, verbose=False, optimize=True)
    return half_stored(fuse(untranspose(without_provenance(program.model_proto), module)))


def export_base(base: Llama, embeds: bool = True) -> tuple[onnx.ModelProto, dict]:
    cfg = base.config
    T = torch.export.Dim("T", min=1, max=cfg.max_position_embeddings)
    U = torch.export.Dim("U", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("S", min=0, max=cfg.max_position_embeddings)
    # example sizes >= 2 on every dynamic axis, or the exporter specialises the axis
    ids, at = torch.zeros(1, 3, dtype=torch.long), torch.tensor([1, 2])
    dtype = next(base.parameters()).dtype
    past = [torch.zeros(1, 5, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]
    graph = BaseGraph(base, embeds)
    lora = [torch.zeros_like(p).t() for name, p in base.named_parameters() if name in graph.lora]
    spec = base_io(base, embeds)
    return to_onnx(graph, (ids, at, past, lora), spec, ({1: T}, {0: U}, [{1: S}] * len(past), [None] * len(lora))), spec


def export_head(head: MTPHead, base: Llama, k: int) -> tuple[onnx.ModelProto, dict]:
    cfg = base.config
    T = torch.export.Dim("T", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("S", min=1, max=cfg.max_position_embeddings)
    dtype = next(head.parameters()).dtype
    hidden = torch.zeros(1, 3, cfg.hidden_size, dtype=dtype)
    kv = torch.zeros(1, 5, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    token, token_axes = (hidden.clone(), {1: T}) if head.config.draft_vocab else (torch.tensor([[1]]), None)
    args = (hidden, token, torch.tensor([2]), kv, kv.clone())
    spec = head_io(head, k)
    return to_onnx(HeadGraph(head, base, k), args, spec, ({1: T}, token_axes, None, {1: S}, {1: S})), spec


class WeightStore:
    """Writes the initializers of many graphs as ONNX external data, each distinct tensor once: a tensor
    goes to the weights file of the first model that has it, and any later graph holding the same
    tensor (same type and bytes, in any shape) points at that copy."""

    def __init__(self, out: Path):
        self.out = out
        self.where: dict[bytes, tuple[str, int, int]] = {}  # tensor digest -> (file, offset, length)
        self.sizes: dict[str, int] = {}                    # weights file -> bytes written so far

    def externalize(self, model: onnx.ModelProto, owner: str, suffix: str) -> list[str]:
        """Moves model's large initializers into weights files, new ones into `owner`'s file of this
        precision (`{owner}{suffix}.data`; float16 tensors into `{owner}.fp16.data` in every precision, where
        the fp16 graphs find them); returns the files the model reads, in order."""
        used = []
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:  # already stored (the q4 graph's fp16 norms)
                location = next(e.value for e in t.external_data if e.key == "location")
                used += [location] if location not in used else []
                continue
            data = onnx.numpy_helper.to_array(t)
            if data.nbytes <= INLINE_BYTES:
                continue
            file = f"{owner}{'.fp16' if data.dtype == np.float16 else suffix}.data"
            raw = np.ascontiguousarray(data).tobytes()
            key = hashlib.sha256(f"{t.data_type}".encode() + raw).digest()  # the same bytes in any shape: one copy
            if key not in self.where:
                offset = -(-self.sizes.get(file, 0) // 64) * 64  # 64-byte aligned
                with open(self.out / file, "r+b" if file in self.sizes else "wb") as f:
                    f.seek(offset)
                    f.write(raw)
                self.where[key] = (file, offset, len(raw))
                self.sizes[file] = offset + len(raw)
            location, offset, length = self.where[key]
            t.CopyFrom(onnx.numpy_helper.from_array(data, t.name))  # the bytes in raw_data, as set_external_data wants
            onnx.external_data_helper.set_external_data(t, location, offset, length)
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            used += [location] if location not in used else []
        return used


# The graphs are exported in worker processes, two at once on a 2-core machine: torch.export and onnxscript's
# rewriter run in one Python thread, so one process leaves the other cores idle. The workers are forked, as
# PyTorch's DataLoader forks its own (one torch thread each): they find the models in memory, nothing is
# pickled, and no script is imported again. They run no onnxruntime session (fuse.py uses its Python optimizer).
EXPORT_WORKERS = 4  # at most: each worker may come to hold its own copy of the models (an fp16 cast, pages written)
_models: tuple = ()
_adapter: int | None = None  # the rank of the base graph's adapter inputs, or none
_cast: dict[str, tuple] = {}  # precision -> the models in it: cast once per process, not once per graph


def _one_thread():
    torch.set_num_threads(1)


def _export_job(job: tuple[str, str, int]) -> tuple[bytes, dict]:
    """One graph (its name, its precision, and k for a head), exported from the models this process holds."""
    name, precision, k = job
    if precision not in _cast:
        _cast[precision] = tuple(copy.deepcopy(m).half() if precision == "fp16" and m is not None else m for m in _models)
    base, head, drafter = _cast[precision]
    if name == "base":
        if _adapter:  # the adapter's inputs: attached to this process's base while its graph exports, scale 1
            add_adapter(base, _adapter, _adapter)
            for _, p in base.named_parameters():
                p.data = p.data.to(next(base.parameters()).dtype)
        try:
            model, spec = export_base(base, embeds=head is not None and bool(head.config.draft_vocab))
        finally:
            remove_adapter(base)
    elif name == "drafter":
        model, spec = export_base(drafter, embeds=False)  # with the base graph's inputs and outputs but embeds
    else:
        model, spec = export_head(head, base, k)
    return model.SerializeToString(), spec


def export_graphs(base: Llama, head: MTPHead | None, drafter: Llama | None, out: Path,
                  precisions: tuple[str, ...], adapter: int | None = None) -> dict:
    """Writes every graph, in each precision, with their weights files into out/; adapter: the rank of the
    adapters the base graph takes as inputs (BaseGraph), or None for none.
    Returns precision -> {"dtype", "graphs": name -> {file, weights, inputs, outputs}}."""
    ks = range(1, head.config.k_train + 1) if head is not None else ()
    jobs = [(name, precision, k) for precision in precisions
            for name, k in [("base", 0), *((f"head_k{k}", k) for k in ks), *([("drafter", 0)] if drafter else [])]]
    workers = min(EXPORT_WORKERS, os.cpu_count() or 1, len(jobs))
    store, result = WeightStore(out), {p: {"dtype": PRECISIONS[p], "graphs": {}} for p in precisions}
    global _models, _adapter
    _models, _adapter = (base, head, drafter), adapter
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork"), initializer=_one_thread) if workers > 1 else None
    try:
        done = pool.map(_export_job, jobs) if pool else map(_export_job, jobs)
        for (name, precision, _), (proto, spec) in zip(jobs, done):  # in order: the files do not depend on timing
            model, suffix = onnx.ModelProto.FromString(proto), ".fp16" if precision == "fp16" else ""
            weights = store.externalize(model, name.split("_")[0], suffix)
            onnx.save(model, out / f"{name}{suffix}.onnx")
            result[precision]["graphs"][name] = {"file": f"{name}{suffix}.onnx", "weights": weights, **spec}
    finally:
        _models, _adapter = (), None
        _cast.clear()
        if pool:
            pool.shutdown(cancel_futures=True)
    return result
