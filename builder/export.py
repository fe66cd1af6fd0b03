"""Export of the base, the MTP head and the independent drafter to ONNX, and the manifest that says how
to run them.

Graphs, all exported from the one model definition (builder/model.py, builder/mtp.py) through small
wrappers that only rename and flatten:

    base.onnx     input_ids (1, T), past_key_i / past_value_i (1, S, n_kv, head_dim) for every layer i
                  -> choices (1, T) int64     the greedy token after each fed position (argmax in the graph)
                     margins (1, T) float     top-1 minus top-2 logit there (for the exactness rule only)
                     hidden (1, T, C)         the final normed hidden states
                     present_key_i / present_value_i (1, S + T, n_kv, head_dim)
                  T and S are dynamic; S = 0 is the prefill (one graph serves prefill, decode and verify).
    head_k{k}.onnx  k = 1..K: the head's chain of exactly k drafts (drafting k costs k steps)
                  hidden (1, T, C) and anchor (1,) int64: the base's hidden output as it is, and the
                  index of the anchor in it; token (1, 1) int64: the base's choice at the anchor;
                  past_key / past_value (1, S, n_kv, head_dim): the base's cache of layer kv_layer,
                  positions 0..anchor -> drafts (1, k) int64, each conditioned on the one before.
    drafter.onnx  the independent drafter, with the base graph's inputs and outputs.

Each graph is exported in every precision asked for: fp32, and fp16 (`*.fp16.onnx`: the same modules
cast to half, every float input and output float16; RMSNorm and softmax compute in fp32 inside).

In the fp32 graphs each residual RMSNorm and each rotary embedding is one of onnxruntime's fused
operators (com.microsoft domain, kernels on CPU, WASM and WebGPU; `fuse`): 35 % fewer nodes in the base.

Every weight is stored once. A graph file holds only the graph; its weights are ONNX external data in one
file per model and precision (`base.data`, `head.data`, `drafter.data`, `*.fp16.data`), found by
content: the head graphs read the embedding and LM head from the base's file, and the six head graphs
share the head's. A checkpoint saved in fp16 (the shipped ones are) has its fp32 graphs read the fp16
files too, behind Casts (`half_stored`): one file per model, half the download, the same fp32 values.
Logits are never an output: the decode loop reads only token ids.

`manifest.json` is the one I/O contract (README.md, "The manifest"): every file's size and sha256, per
precision each graph's file, weight files, inputs and outputs (name, dtype, shape with symbolic axes,
where a browser keeps the output: "gpu" or read back to the "cpu"), the KV layout, the head's k and KV
layer, the context length, special tokens, task prompt formats and defaults, and the sha256 of the
checkpoints and code it was exported from.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn

from .drafter import DRAFTER_K_MAX, load_drafter
from .generate import DEFAULT_K, DEFAULT_MAX_NEW_TOKENS, greedy
from .model import CheckpointError, Llama, load_llama
from .mtp import MTPHead, load_head
from .tasks import load_tokenizer, special_tokens

MANIFEST = "manifest.json"
FORMAT = "frozen-mtp-onnx/2"
OPSET = 18
PRECISIONS = {"fp32": "float32", "fp16": "float16"}  # precision -> ONNX name of its float type
INLINE_BYTES = 1024  # initializers this small or smaller (scalars, shapes, norms' weights) stay inside the graph file


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoint directories an export is made from: the base, and optionally a head and a drafter."""
    base: Path
    head: Path | None = None
    drafter: Path | None = None


class BaseGraph(nn.Module):
    """The base with flat per-layer KV inputs/outputs and the greedy choice and margin computed inside."""

    def __init__(self, base: Llama):
        super().__init__()
        self.base = base

    def forward(self, input_ids, past: list[torch.Tensor]):
        logits, hidden, present = self.base(input_ids, list(zip(past[0::2], past[1::2])))
        choices, margins = greedy(logits[0])  # (T,), (T,)
        return choices[None], margins[None], hidden, [t for kv in present for t in kv]


class HeadGraph(nn.Module):
    """The head's chain of k drafts in one graph, reading the base's outputs as they are."""

    def __init__(self, head: MTPHead, base: Llama, k: int):
        super().__init__()
        self.head, self.base, self.k = head, base, k

    def forward(self, hidden, anchor, token, past_key, past_value):
        h = hidden.index_select(1, anchor)  # (1, 1, C): the base's hidden state at the anchor
        return self.head.draft_ids(self.base, h, token, past_key, past_value, self.k)


# --- the I/O contract of each graph ------------------------------------------------------------------

def io(name: str, dtype: str, shape: list, location: str | None = None) -> dict:
    d = {"name": name, "dtype": dtype, "shape": shape}
    if location:
        d["location"] = location
    return d


def float_type(module: nn.Module) -> str:
    """The ONNX name of a module's float type: its graphs' float inputs and outputs have this type."""
    return str(next(module.parameters()).dtype).removeprefix("torch.").replace("half", "float16")


def base_io(base: Llama) -> dict:
    cfg, fl = base.config, float_type(base)
    kv = [cfg.num_key_value_heads, cfg.head_dim]
    layers = range(cfg.num_hidden_layers)
    past = [io(f"past_{kind}_{i}", fl, [1, "S", *kv]) for i in layers for kind in ("key", "value")]
    present = [io(f"present_{kind}_{i}", fl, [1, "S + T", *kv], "gpu") for i in layers for kind in ("key", "value")]
    return {"inputs": [io("input_ids", "int64", [1, "T"])] + past,
            "outputs": [io("choices", "int64", [1, "T"], "cpu"), io("margins", fl, [1, "T"], "cpu"),
                        io("hidden", fl, [1, "T", cfg.hidden_size], "gpu")] + present}


def head_io(head: MTPHead, k: int) -> dict:
    cfg, fl = head.config, float_type(head)
    kv = [cfg.num_key_value_heads, cfg.head_dim]
    return {"inputs": [io("hidden", fl, [1, "T", cfg.hidden_size]), io("anchor", "int64", [1]),
                       io("token", "int64", [1, 1]), io("past_key", fl, [1, "S", *kv]),
                       io("past_value", fl, [1, "S", *kv])],
            "outputs": [io("drafts", "int64", [1, k], "cpu")]}


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


def without_provenance(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drops the exporter's notes on every node and value (the torch module, stack and node each came
    from): three quarters of a graph file's bytes (base.onnx 1.2 -> 0.27 MB), and no runtime reads them."""
    for item in [*model.graph.node, *model.graph.value_info, *model.graph.input, *model.graph.output,
                 *model.graph.initializer]:
        del item.metadata_props[:]
    return model


def half_stored(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each large fp32 weight whose every value is a float16 (a checkpoint saved in fp16, as the shipped
    models are) is stored as float16 behind a Cast to fp32: the graph computes on the same fp32 values, so
    its output is unchanged on every backend, and its download is half. onnxruntime folds the Cast when it
    loads the graph (no cost per run), and the fp16 graphs hold the very same bytes (one copy, shared)."""
    casts = []
    for t in model.graph.initializer:
        if t.data_type != onnx.TensorProto.FLOAT:
            continue
        data = onnx.numpy_helper.to_array(t)
        half = data.astype(np.float16)
        if data.nbytes <= INLINE_BYTES or not np.array_equal(half.astype(np.float32), data):
            continue
        stored = f"{t.name}.fp16"
        casts.append(onnx.helper.make_node("Cast", [stored], [t.name], to=onnx.TensorProto.FLOAT, name=f"cast_{stored}"))
        t.CopyFrom(onnx.numpy_helper.from_array(half, stored))
    if casts:  # their inputs are initializers: first in topological order
        nodes = casts + list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return model


def fuse(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's fused operators where this exporter's graphs have their pattern (7-8 nodes become 1):

    - RMSNorm, by onnxruntime's own transformer optimizer: each norm of a residual sum (Add, then
      Pow-ReduceMean-Add-Sqrt-Reciprocal-Mul-Mul) becomes one SkipSimplifiedLayerNormalization, which also
      outputs the sum. onnxruntime does not fuse this pattern itself when it loads a graph. A norm of
      anything else of one row, (1, 1, C) (each draft of the head has three: of the token's embedding, of
      the hidden state, of the layer's input), becomes the same operator with a skip of zeros (x + 0 is x):
      its own fused form, SimplifiedLayerNormalization, is an onnxruntime operator in the ONNX domain,
      which the ONNX checker rejects. A norm of T rows that is no residual sum (the base's embedding)
      stays as it is.
    - Rotary embedding (`fuse_rotary`), which onnxruntime's optimizer does not match here.

    Both are com.microsoft operators with kernels on CPU, WASM and WebGPU. The fp16 graphs, whose norms and
    rotary angles compute in fp32 between Casts, do not match and stay as they are."""
    from onnxruntime.transformers.fusion_simplified_layernorm import (
        FusionSimplifiedLayerNormalization, FusionSkipSimplifiedLayerNormalization)
    from onnxruntime.transformers.onnx_model import OnnxModel

    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in [*model.graph.value_info, *model.graph.input]}
    one_row = lambda name: shapes.get(name, [])[-3:-1] == [1, 1]  # noqa: E731  (1, 1, C)

    class ResidualNorms(FusionSimplifiedLayerNormalization):
        def fuse(self, node, input_name_to_nodes, output_name_to_node):
            added, removed = len(self.nodes_to_add), len(self.nodes_to_remove)
            super().fuse(node, input_name_to_nodes, output_name_to_node)
            if len(self.nodes_to_add) > added:
                x = self.nodes_to_add[-1].input[0]
                root = output_name_to_node.get(x)
                if (root is None or root.op_type != "Add") and not one_row(x):  # T rows, no residual sum: undo
                    del self.nodes_to_add[added:], self.nodes_to_remove[removed:]

    graph = OnnxModel(model)
    for fusion in (ResidualNorms, FusionSkipSimplifiedLayerNormalization):
        fusion(graph).apply()
    for norm in graph.get_nodes_by_op_type("SimplifiedLayerNormalization"):  # one row, no residual sum
        gamma = onnx.numpy_helper.to_array(graph.get_initializer(norm.input[1]))
        zeros = f"zeros_{gamma.shape[0]}_{gamma.dtype}"
        if graph.get_initializer(zeros) is None:
            graph.add_initializer(onnx.numpy_helper.from_array(np.zeros((1, *gamma.shape), gamma.dtype), zeros))
        epsilon = next(a.f for a in norm.attribute if a.name == "epsilon")
        graph.remove_node(norm)
        graph.add_node(onnx.helper.make_node("SkipSimplifiedLayerNormalization", [norm.input[0], zeros, norm.input[1]],
                                             norm.output[:1], name=norm.name, domain="com.microsoft", epsilon=epsilon))
    fuse_rotary(graph)
    graph.topological_sort()
    if any(n.domain == "com.microsoft" for n in graph.model.graph.node):
        graph.model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return graph.model


def fuse_rotary(graph) -> None:
    """Each rotary embedding of q or k as this exporter writes it (model.py's half-split rotate_half):

        x = Reshape(proj, [1, -1, H, D]);  a, b = Split(x, axis=3)
        out = Add(Mul(x, Unsqueeze(Cos(e))), Mul(Concat(Neg(b), a), Unsqueeze(Sin(e))));  e = Concat(f, f)

    becomes out = Reshape(RotaryEmbedding(proj, [0], Cos(f), Sin(f)), [1, -1, H, D]) with com.microsoft's
    RotaryEmbedding: f (T, D/2) holds the angles of the T fed positions, so its tables are those rows
    and the position ids their offset, 0. The same values as before, computed by the same operators;
    the nodes left unused go."""
    producer, consumers = graph.output_name_to_node(), graph.input_name_to_nodes()
    parent = lambda node, i: producer.get(node.input[i]) if len(node.input) > i else None  # noqa: E731

    def angles(unsqueezed: str, op: str) -> str | None:
        """f's name behind Unsqueeze(Cos|Sin(Concat(f, f))), or None."""
        u = producer.get(unsqueezed)
        trig = parent(u, 0) if u is not None and u.op_type == "Unsqueeze" else None
        cat = parent(trig, 0) if trig is not None and trig.op_type == op else None
        return cat.input[0] if cat is not None and cat.op_type == "Concat" and len(set(cat.input)) == 1 else None

    axis = lambda node: next((a.i for a in node.attribute if a.name == "axis"), 0)  # noqa: E731
    tables, remove, add = {}, [], []  # f -> (cos, sin) of the new nodes
    for node in graph.get_nodes_by_op_type("Add"):
        muls = [producer.get(i) for i in node.input]
        if len(muls) != 2 or any(m is None or m.op_type != "Mul" for m in muls):
            continue
        for m_cos, m_sin in (muls, muls[::-1]):
            cat = parent(m_sin, 0)
            neg = parent(cat, 0) if cat is not None and cat.op_type == "Concat" else None
            split = parent(neg, 0) if neg is not None and neg.op_type == "Neg" else None
            if (split is None or split.op_type != "Split" or axis(split) not in (3, -1)
                    or axis(cat) not in (3, -1) or list(cat.input[1:]) != [split.output[0]]
                    or neg.input[0] != split.output[1] or m_cos.input[0] != split.input[0]):
                continue
            x = producer.get(split.input[0])
            f = angles(m_cos.input[1], "Cos")
            if (x is None or x.op_type != "Reshape" or f is None or f != angles(m_sin.input[1], "Sin")
                    or {n.name for n in consumers[x.output[0]]} != {split.name, m_cos.name}):
                continue
            if f not in tables:
                tables[f] = (f"{f}_cos", f"{f}_sin")
                add += [onnx.helper.make_node("Cos", [f], [f"{f}_cos"], name=f"{f}_cos"),
                        onnx.helper.make_node("Sin", [f], [f"{f}_sin"], name=f"{f}_sin")]
            out, (cos, sin) = node.output[0], tables[f]
            heads = int(graph.get_constant_value(x.input[1])[2])
            add += [onnx.helper.make_node("RotaryEmbedding", [x.input[0], "rotary_offset", cos, sin], [f"{out}_rotary"],
                                          name=f"{out}_rotary", domain="com.microsoft", interleaved=0, num_heads=heads),
                    onnx.helper.make_node("Reshape", [f"{out}_rotary", x.input[1]], [out], name=f"{out}_reshape")]
            remove += [node, m_cos, m_sin, cat, neg, split]
            break
    if add:
        graph.add_initializer(onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), "rotary_offset"))
        graph.remove_nodes(remove)
        graph.add_nodes(add)
        graph.prune_graph()


def untranspose(model: onnx.ModelProto, module: nn.Module) -> onnx.ModelProto:
    """The exporter's optimizer folds Transpose(weight) into a new initializer where a weight has one use
    (so a head graph of one draft would hold its weights transposed, and those of several drafts as they
    are). Store each such weight as it is in the module instead, behind a Transpose node that onnxruntime
    folds again when it loads the graph: every graph then holds the same bytes for the same weight."""
    transposed = {}  # sha256 of a 2-D weight's transpose -> (its name, its values)
    for name, w in module.state_dict().items():
        if w.dim() == 2:
            w = w.detach().cpu().numpy()
            transposed[hashlib.sha256(np.ascontiguousarray(w.T).tobytes()).digest()] = (name, w)
    have = {t.name for t in model.graph.initializer}
    kept, transposes = [], []
    for t in model.graph.initializer:
        data = onnx.numpy_helper.to_array(t)
        hit = transposed.get(hashlib.sha256(data.tobytes()).digest()) if data.ndim == 2 else None
        if hit is None or data.shape != hit[1].shape[::-1]:
            kept.append(t)
            continue
        name, w = hit
        if name not in have:
            kept.append(onnx.numpy_helper.from_array(w, name))
            have.add(name)
        transposes.append(onnx.helper.make_node("Transpose", [name], [t.name], perm=[1, 0], name=f"untranspose_{t.name}"))
    nodes = transposes + list(model.graph.node)  # their inputs are initializers: first in topological order
    del model.graph.initializer[:], model.graph.node[:]
    model.graph.initializer.extend(kept)
    model.graph.node.extend(nodes)
    return model


def export_base(base: Llama) -> tuple[onnx.ModelProto, dict]:
    cfg = base.config
    T = torch.export.Dim("T", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("S", min=0, max=cfg.max_position_embeddings)
    # example sizes >= 2 on every dynamic axis, or the exporter specialises the axis
    ids = torch.zeros(1, 3, dtype=torch.long)
    dtype = next(base.parameters()).dtype
    past = [torch.zeros(1, 5, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]
    spec = base_io(base)
    return to_onnx(BaseGraph(base), (ids, past), spec, ({1: T}, [{1: S}] * len(past))), spec


def export_head(head: MTPHead, base: Llama, k: int) -> tuple[onnx.ModelProto, dict]:
    cfg = base.config
    T = torch.export.Dim("T", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("S", min=1, max=cfg.max_position_embeddings)
    dtype = next(head.parameters()).dtype
    hidden = torch.zeros(1, 3, cfg.hidden_size, dtype=dtype)
    kv = torch.zeros(1, 5, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    args = (hidden, torch.tensor([2]), torch.tensor([[1]]), kv, kv.clone())
    spec = head_io(head, k)
    return to_onnx(HeadGraph(head, base, k), args, spec, ({1: T}, None, None, {1: S}, {1: S})), spec


class WeightStore:
    """Writes the initializers of many graphs as ONNX external data, each distinct tensor once: a tensor
    goes to the weights file of the first model that has it, and any later graph holding the same
    tensor (same type, shape and bytes) points at that copy."""

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
            data = onnx.numpy_helper.to_array(t)
            if data.nbytes <= INLINE_BYTES:
                continue
            file = f"{owner}{'.fp16' if data.dtype == np.float16 else suffix}.data"
            raw = np.ascontiguousarray(data).tobytes()
            key = hashlib.sha256(f"{t.data_type}{list(t.dims)}".encode() + raw).digest()
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


def export_graphs(base: Llama, head: MTPHead | None, drafter: Llama | None, out: Path,
                  precisions: tuple[str, ...]) -> dict:
    """Writes every graph, in each precision, with their weights files into out/.
    Returns precision -> {"dtype", "graphs": name -> {file, weights, inputs, outputs}}."""
    store, result = WeightStore(out), {}
    for precision in precisions:
        cast = (lambda m: copy.deepcopy(m).half()) if precision == "fp16" else (lambda m: m)
        suffix = ".fp16" if precision == "fp16" else ""
        b = cast(base)
        jobs = [("base", "base", lambda: export_base(b))]
        if head is not None:
            h = cast(head)
            jobs += [(f"head_k{k}", "head", lambda k=k: export_head(h, b, k)) for k in range(1, head.config.k_train + 1)]
        if drafter is not None:
            d = cast(drafter)
            jobs.append(("drafter", "drafter", lambda: export_base(d)))
        graphs = {}
        for name, owner, make in jobs:
            model, spec = make()
            weights = store.externalize(model, owner, suffix)
            onnx.save(model, out / f"{name}{suffix}.onnx")
            graphs[name] = {"file": f"{name}{suffix}.onnx", "weights": weights, **spec}
        result[precision] = {"dtype": PRECISIONS[precision], "graphs": graphs}
    return result


# --- the manifest ------------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_hashes(directory: Path) -> dict[str, str]:
    """sha256 of a checkpoint's files: tells whether an export is still the export of this checkpoint."""
    return {name: sha256_file(directory / name) for name in ("config.json", "model.safetensors")
            if (directory / name).is_file()}


def code_hash() -> str:
    """sha256 over the code an export is made from: a changed model or exporter makes old exports stale."""
    h = hashlib.sha256()
    for name in ("model.py", "mtp.py", "generate.py", "export.py"):
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()


def sources(ckpts: Checkpoints) -> dict:
    """What an export is made from: each checkpoint's file hashes and the exporter's code hash."""
    return {"code": code_hash(),
            **{role: source_hashes(Path(d)) for role, d in vars(ckpts).items() if d is not None}}


def graph_files(graph: dict) -> list[str]:
    """The files a graph needs: its ONNX file and the weights files it reads."""
    return [graph["file"], *graph["weights"]]


def write_manifest(ckpts: Checkpoints, out: Path, precisions: dict, base: Llama, head: MTPHead | None,
                   drafter: Llama | None) -> dict:
    cfg, tok = base.config, load_tokenizer(ckpts.base)
    first = next(iter(precisions.values()))["graphs"]
    shutil.copyfile(Path(ckpts.base) / "tokenizer.json", out / "tokenizer.json")
    files = [f for p in precisions.values() for g in p["graphs"].values() for f in graph_files(g)] + ["tokenizer.json"]
    manifest = {
        "format": FORMAT,
        "opset": OPSET,
        "context_length": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "eos_token_id": cfg.eos_token_id,
        "special_tokens": special_tokens(tok.tokenizer),
        "tasks": tok.tasks,
        "defaults": {"k": min(DEFAULT_K, head.config.k_train) if head else DEFAULT_K,  # a head may draft fewer
                     "max_new_tokens": DEFAULT_MAX_NEW_TOKENS},
        "kv": kv_layout(first["base"], cfg),
        "head": None if head is None else {
            "k": head.config.k_train, "kv_layer": head.config.kv_layer,
            "by_k": {str(k): f"head_k{k}" for k in range(1, head.config.k_train + 1)},
            "kv_inputs": {"past_key": f"present_key_{head.config.kv_layer}",
                          "past_value": f"present_value_{head.config.kv_layer}"}},
        "drafter": None if drafter is None else {"k": DRAFTER_K_MAX, "kv": kv_layout(first["drafter"], drafter.config)},
        "precisions": precisions,
        "files": {f: {"bytes": (out / f).stat().st_size, "sha256": sha256_file(out / f)} for f in files},
        "tokenizer": "tokenizer.json",
        "source": sources(ckpts),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def export(ckpts: Checkpoints, out: Path, precisions: tuple[str, ...] = tuple(PRECISIONS), note=None) -> dict:
    """Exports the checkpoints into out/ (replacing an earlier export there) and writes its manifest.
    note(message) is called once the checkpoints have loaded, before the (slow) export starts."""
    out = Path(out)
    base = load_llama(ckpts.base)
    head = load_head(ckpts.head, base) if ckpts.head is not None else None
    drafter = load_drafter(ckpts.drafter, base) if ckpts.drafter is not None else None
    if note:
        note(f"exporting {', '.join(str(d) for d in vars(ckpts).values() if d)} to ONNX "
             f"({', '.join(precisions)}) in {out}")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # no manifest describes a half-written export
    for old in [*out.glob("*.onnx"), *out.glob("*.data")]:
        old.unlink()
    graphs = export_graphs(base, head, drafter, out, precisions)
    return write_manifest(ckpts, out, graphs, base, head, drafter)


def is_export_of(directory: Path, ckpts: Checkpoints, precisions: tuple[str, ...]) -> bool:
    """Whether directory holds an export of these checkpoints (it may hold more), by this code, in these
    precisions (files not checked here)."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    have = manifest.get("source", {})
    return (manifest.get("format") == FORMAT and set(precisions) <= set(manifest.get("precisions", {}))
            and all(have.get(role) == want for role, want in sources(ckpts).items()))


def ensure_export(ckpts: Checkpoints, directory: Path, precisions: tuple[str, ...] = tuple(PRECISIONS),
                  note=None) -> dict:
    """The manifest of the export of ckpts in directory, exported there first when missing or stale;
    every file checked against the manifest."""
    if not is_export_of(directory, ckpts, precisions):
        export(ckpts, directory, precisions, note)
    return read_manifest(directory)


def read_manifest(directory: Path) -> dict:
    """The manifest of an export, every file checked against its recorded size and sha256."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"missing {path}: export the models first")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest (format {manifest.get('format')!r}): "
                              "export the models again")
    for name, want in manifest["files"].items():
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"missing {f} (listed in {path})")
        size, digest = f.stat().st_size, sha256_file(f)
        if digest != want["sha256"]:
            raise CheckpointError(f"{f}: sha256 mismatch, the file is altered or truncated "
                                  f"({size} bytes, sha256 {digest[:16]}..; manifest: {want['bytes']} bytes, "
                                  f"sha256 {want['sha256'][:16]}..)")
    return manifest
