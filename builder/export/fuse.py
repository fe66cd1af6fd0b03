"""Rewrites of the exported graphs that change how they run, never what they compute.

- `without_provenance`: drops the exporter's notes (three quarters of a graph file's bytes).
- `untranspose`: every graph holds a weight as the module does, whatever the exporter folded.
- `half_stored`: weights whose values are all float16 are stored so, behind a Cast to fp32.
- `fuse`: onnxruntime's fused operators where this exporter's graphs have their pattern: each RMSNorm
  of a residual sum or of one row is one SkipSimplifiedLayerNormalization, each rotary embedding one
  RotaryEmbedding (com.microsoft operators with kernels on CPU, WASM and WebGPU): 35 % fewer nodes in
  the base. The fp16 graphs, whose norms and rotary angles compute in fp32 between Casts, keep theirs.
"""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import torch.nn as nn

INLINE_BYTES = 1024  # initializers this small or smaller (scalars, shapes, norms' weights) stay inside the graph file


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
