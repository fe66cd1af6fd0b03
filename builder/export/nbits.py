"""The base's graph with 4-bit weights: precision `q4`, for WebGPU, of a base imported from a GGUF.

The fp32 graphs read the dequantized weights, 4 bytes each (SmolLM2: 540 MB in the GPU's memory, all of it
read by every pass). onnxruntime's `MatMulNBits` (com.microsoft: 4-bit, block 32, WebGPU, CPU) reads the
GGUF's Q4_1 blocks nearly as they are: each weight `d * q + m` becomes `d * (q - 0)`, computed by the
kernel, plus the block minimum's share, `m * sum(x over the block)`, which is the block sums of the input
times an (in / 32, out) matrix of the minima: 1/32 of the product's work. WebGPU takes only uint8 zero
points, so they are 0 and the minima go through that correction. The values are the fp32 graph's (the same
d, q and m); only the order of the roundings differs (1e-6 of the output), and the tokens are tested equal
to torch's. Each Q4_1 weight of the graph so becomes three tensors, 4.25 bits a weight in the GPU's memory
(the packed q, the scales and the minima) instead of 32; the tied embedding (Q8_0) stays fp32.

`q4_graph` rewrites the exported fp32 base graph; `q4_packed` says how the page rebuilds its weights file
from the blocks file it already downloads for the fp32 one (web/src/blocks.mjs): nothing more goes over
the wire. WASM has no fast 4-bit kernel (docs/web.md): the page uses this graph on WebGPU only.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

BLOCK = 32  # weights per Q4_1 block (and per MatMulNBits block)


def q4_1_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (rows, in) weight's Q4_1 blocks (uint8, rows x (in / 32 * 20): fp16 d, fp16 m, 16 bytes of q, byte j
    holding weight j in its low nibble and j + 16 in its high one) as MatMulNBits reads them: q packed two a
    byte in order (rows, in / 32, 16) uint8, the scales d (rows * in / 32) fp32, and the minima transposed,
    (in / 32, rows) fp32."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # (rows, in / 32, 32) in order
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed), d.reshape(-1), np.ascontiguousarray(m.T)


def _external(t: onnx.TensorProto) -> tuple[str, int, int] | None:
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    return info["location"], int(info["offset"]), int(info["length"])


def q4_graph(out: Path, graph_file: str, blocks: dict[str, dict]) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """The fp32 base graph out/graph_file with every MatMul by a Q4_1 weight (found by the sha256 of its fp32
    values in `blocks`, models/gguf.packed_blocks) as MatMulNBits plus the minima's correction. Returns the
    graph, its fp32 initializers inline (read from their weights file; fp16 ones left where they are), and
    where each comes from: name -> (kind, (weights file, offset) of the fp32 tensor), kind "q4_1.q",
    "q4_1.d", "q4_1.mT" (parts of a Q4_1 weight), "copy", or "zeros" (no source)."""
    model = onnx.load(out / graph_file, load_external_data=False)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    files: dict[str, bytes] = {}

    def values(t: onnx.TensorProto) -> np.ndarray:
        where = _external(t)
        if where is None:
            return numpy_helper.to_array(t)
        file, at, length = where
        if file not in files:
            files[file] = (out / file).read_bytes()
        raw = files[file][at:at + length]
        return np.frombuffer(raw, dtype=helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims))

    users: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for name in node.input:
            users.setdefault(name, []).append(node)

    new_inits, origin = [], {}
    replaced: dict[str, str] = {}  # a Transpose's output (the weight, transposed) -> the weight's name
    for node in g.node:
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        t = inits[node.input[0]]
        if t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2:
            continue
        w = values(t)
        digest = hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()
        hit = blocks.get(digest)
        if hit is None or hit["kind"] != "q4_1" or w.shape[1] % BLOCK:
            continue
        if not all(u.op_type == "MatMul" and list(u.input).index(node.output[0]) == 1 for u in users[node.output[0]]):
            continue
        q, d, mT = q4_1_parts(hit["blocks"])
        zeros = f"q4.zeros_{w.shape[0]}x{w.shape[1] // BLOCK}"
        for suffix, kind, data in (("q4", "q4_1.q", q), ("scales", "q4_1.d", d), ("mins", "q4_1.mT", mT)):
            new_inits.append(numpy_helper.from_array(data, f"{t.name}.{suffix}"))
            origin[f"{t.name}.{suffix}"] = (kind, _external(t)[:2])
        if zeros not in origin:  # 4-bit zero points, two a byte: all 0
            new_inits.append(numpy_helper.from_array(np.zeros(w.shape[0] * -(-(w.shape[1] // BLOCK) // 2), np.uint8), zeros))
            origin[zeros] = ("zeros", None)
        replaced[node.output[0]] = t.name

    nodes, sums = [], {}  # sums: an input -> its block sums' name
    shapes = {}
    for node in g.node:
        if node.op_type == "Transpose" and node.output[0] in replaced:
            continue
        if node.op_type != "MatMul" or node.input[1] not in replaced:
            nodes.append(node)
            continue
        x, y, w = node.input[0], node.output[0], replaced[node.input[1]]
        out_f, in_f = inits[w].dims
        blocks_in = in_f // BLOCK
        if x not in sums:
            shape = f"q4.shape_{blocks_in}"
            if shape not in shapes:
                shapes[shape] = numpy_helper.from_array(np.array([0, 0, blocks_in, BLOCK], np.int64), shape)
            sums[x] = f"{x}.block_sums"
            nodes += [helper.make_node("Reshape", [x, shape], [f"{x}.blocks"], name=f"q4_blocks_{x}"),
                      helper.make_node("ReduceSum", [f"{x}.blocks", "q4.last_axis"], [sums[x]], keepdims=0,
                                       name=f"q4_block_sums_{x}")]
        zeros = f"q4.zeros_{out_f}x{blocks_in}"
        nodes += [helper.make_node("MatMulNBits", [x, f"{w}.q4", f"{w}.scales", zeros], [f"{y}.dq"], domain="com.microsoft",
                                   K=in_f, N=out_f, bits=4, block_size=BLOCK, name=f"q4_{node.name}"),
                  helper.make_node("MatMul", [sums[x], f"{w}.mins"], [f"{y}.mq"], name=f"q4_mins_{node.name}"),
                  helper.make_node("Add", [f"{y}.dq", f"{y}.mq"], [y], name=f"q4_add_{node.name}")]
    if not replaced:
        raise ValueError(f"{graph_file}: no MatMul reads a Q4_1 weight of the GGUF")

    kept = []
    for t in g.initializer:
        if t.name in replaced.values():
            continue
        where = _external(t)
        if where is not None and t.data_type == onnx.TensorProto.FLOAT:  # into the q4 graph's own file
            origin[t.name] = ("copy", where[:2])
            t = numpy_helper.from_array(np.array(values(t)), t.name)
        kept.append(t)
    del g.initializer[:], g.node[:]
    g.initializer.extend(kept + new_inits + list(shapes.values())
                         + [numpy_helper.from_array(np.array([-1], np.int64), "q4.last_axis")])
    g.node.extend(nodes)
    return model, origin


def q4_packed(file: str, model: onnx.ModelProto, origin: dict[str, tuple], packed: dict) -> dict:
    """How the page rebuilds the q4 graph's weights file `file` (model's initializers stored there) from
    the blocks file it downloads for the fp32 graph's (`packed`, export/packed.py): each tensor from the
    segment of the fp32 tensor it comes from, as a part of its Q4_1 blocks (kinds q4_1.q, q4_1.d,
    q4_1.mT), as a copy of that segment (raw, q8_0), or zeros. Nothing more goes over the wire."""
    segments, blocks_file = {}, set()
    for t in model.graph.initializer:
        where = _external(t)
        if where is None or where[0] != file or where[1] in segments:
            continue
        _, at, length = where
        kind, source = origin[t.name]
        if kind == "zeros":
            segments[at] = {"at": at, "bytes": length, "kind": "zeros"}
            continue
        src_file, src_at = source
        if src_file not in packed:
            raise ValueError(f"{t.name} comes from {src_file}, which has no packed form")
        s = next(s for s in packed[src_file]["segments"] if s["at"] == src_at)
        blocks_file.add(packed[src_file]["file"])
        segments[at] = {"at": at, "bytes": length, "from": s["from"], "kind": s["kind"] if kind == "copy" else kind,
                        **({"rows": s["rows"]} if "rows" in s else {})}
    if len(blocks_file) != 1:
        raise ValueError(f"{file}: its tensors come from {len(blocks_file)} blocks files, not one")
    return {"file": blocks_file.pop(), "segments": [segments[at] for at in sorted(segments)]}
