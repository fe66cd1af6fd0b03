"""The base's graph on the GGUF's blocks: precision `q4`, for WebGPU, of a base imported from a GGUF.

The fp32 graphs read the dequantized weights, 4 bytes each (SmolLM2: 538 MB in the GPU's memory, all of it
read by every pass). onnxruntime's `MatMulNBits` and `GatherBlockQuantized` (com.microsoft, blocks of 32;
kernels on WebGPU and the CPU) read the file's blocks nearly as they are:

- a Q4_1 weight (`d * q + m`, q in 0..15) as 4-bit `MatMulNBits` on q and d, with zero points 0 (WebGPU
  takes only uint8 zero points), plus the block minimum's share, `m * sum(x over the block)`: the block
  sums of the input times an (in / 32, out) matrix of the minima, 1/32 of the product's work;
- a Q8_0 weight (`d * q`, q in -128..127; SmolLM2's tied embedding and LM head) as 8-bit `MatMulNBits` and
  `GatherBlockQuantized` on q + 128 with zero points 128, one copy of its bytes for both.

The values are the fp32 graph's (the same d, q and m: d * q is exact in fp32); a product only rounds in
another order (1e-6 of the output), and the tokens are tested equal to torch's. 4.25 or 8.6 bits a weight
in the GPU's memory instead of 32.

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

from ..contract import BLOCKS  # kind -> (weights, bytes) of one GGUF block

BLOCK = BLOCKS["q4_1"][0]  # weights per block (32, Q4_1 and Q8_0 alike), in the GGUF and in onnxruntime's operators


def q4_1_parts(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """A (rows, in) weight's Q4_1 blocks (uint8, rows x (in / 32 * 20): fp16 d, fp16 m, 16 bytes of q, byte j
    holding weight j in its low nibble and j + 16 in its high one) as MatMulNBits reads them: `q` packed two
    a byte in order (rows, in / 32, 16) uint8, the scales `d` (rows * in / 32) fp32, and the minima
    transposed, `mT` (in / 32, rows) fp32."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCKS["q4_1"][1])
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # (rows, in / 32, 32) in order
    return {"q": np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)), "d": d.reshape(-1), "mT": np.ascontiguousarray(m.T)}


def q8_0_parts(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """A (rows, in) weight's Q8_0 blocks (uint8, rows x (in / 32 * 34): fp16 d, 32 int8 q) as MatMulNBits
    and GatherBlockQuantized read them: `q` + 128 (rows, in) uint8 and the scales `d` (rows, in / 32) fp32."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCKS["q8_0"][1])
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return {"q": np.ascontiguousarray(q.reshape(rows, -1)), "d": d}


def _external(t: onnx.TensorProto) -> tuple[str, int, int] | None:
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    return info["location"], int(info["offset"]), int(info["length"])


def q4_graph(out: Path, graph_file: str, blocks: dict[str, dict]) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """The fp32 base graph out/graph_file with every MatMul by a Q4_1 or Q8_0 weight (found by the sha256
    of its fp32 values in `blocks`, models/gguf.packed_blocks; a Transpose of it) and every Gather from a
    Q8_0 one on the weight's blocks. Returns the graph, its fp32 initializers inline (read from their
    weights file; fp16 ones left where they are), and where each comes from: name -> (kind, (weights file,
    offset) of the fp32 tensor): kind "q4_1.q", "q4_1.d", "q4_1.mT", "q8_0.q", "q8_0.d" (parts of a
    weight's blocks), "copy", or "zeros" / "128s" (no source)."""
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
        return np.frombuffer(files[file][at:at + length], dtype=helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims))

    users: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for name in node.input:
            users.setdefault(name, []).append(node)

    def matmul_by(name: str) -> bool:  # a Transpose whose every use is a MatMul's weight
        return all(u.op_type == "MatMul" and list(u.input).index(name) == 1 for u in users.get(name, []))

    new, origin = {}, {}
    quantized = {}  # weight name -> its kind
    for t in g.initializer:
        if t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2 or t.dims[1] % BLOCK or _external(t) is None:
            continue
        uses = users.get(t.name, [])
        transposes = [u for u in uses if u.op_type == "Transpose" and list(u.attribute[0].ints) == [1, 0]]
        gathers = [u for u in uses if u.op_type == "Gather" and u.input[0] == t.name
                   and all(a.i == 0 for a in u.attribute if a.name == "axis")]
        if len(transposes) + len(gathers) != len(uses) or not all(matmul_by(u.output[0]) for u in transposes):
            continue
        hit = blocks.get(hashlib.sha256(np.ascontiguousarray(values(t)).tobytes()).hexdigest())
        if hit is None or (hit["kind"] == "q4_1" and gathers):
            continue
        kind, rows, n_blocks = hit["kind"], t.dims[0], t.dims[1] // BLOCK
        parts = (q4_1_parts if kind == "q4_1" else q8_0_parts)(hit["blocks"])
        if kind == "q4_1":
            zeros = (f"q4.zeros_{rows}x{n_blocks}", np.zeros(rows * -(-n_blocks // 2), np.uint8), "zeros")  # two a byte
        else:  # MatMulNBits wants (rows, blocks, 32) and flat scales and zero points; Gather its shapes: same bytes
            parts |= {"q_blocks": parts["q"].reshape(rows, n_blocks, BLOCK), "d_flat": parts["d"].reshape(-1)}
            zeros = (f"q8.zp_{rows}x{n_blocks}", np.full((rows, n_blocks), 128, np.uint8), "128s")
            new[f"{zeros[0]}_flat"] = numpy_helper.from_array(zeros[1].reshape(-1), f"{zeros[0]}_flat")
            origin[f"{zeros[0]}_flat"] = (zeros[2], None)
        for part, data in parts.items():
            new[f"{t.name}.{part}"] = numpy_helper.from_array(data, f"{t.name}.{part}")
            origin[f"{t.name}.{part}"] = (f"{kind}.{part.split('_')[0]}", _external(t)[:2])
        new[zeros[0]] = numpy_helper.from_array(zeros[1], zeros[0])
        origin[zeros[0]] = (zeros[2], None)
        quantized[t.name] = kind

    # the nodes: each Transpose of a quantized weight dropped; its MatMuls and the Gathers from it rewritten
    transposed = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Transpose" and n.input[0] in quantized}
    nodes, sums = [], {}  # sums: an input -> its block sums' name
    for node in g.node:
        if node.output[0] in transposed:
            continue
        if node.op_type == "Gather" and node.input[0] in quantized:
            w = node.input[0]
            rows, cols = inits[w].dims
            nodes += [helper.make_node("GatherBlockQuantized", [f"{w}.q", node.input[1], f"{w}.d", f"q8.zp_{rows}x{cols // BLOCK}"],
                                       list(node.output), domain="com.microsoft", bits=8, block_size=BLOCK, gather_axis=0,
                                       quantize_axis=1, name=f"q8_{node.output[0]}")]
            continue
        if node.op_type != "MatMul" or node.input[1] not in transposed:
            nodes.append(node)
            continue
        x, y, w = node.input[0], node.output[0], transposed[node.input[1]]
        out_f, in_f = inits[w].dims
        n_blocks = in_f // BLOCK
        if quantized[w] == "q8_0":
            nodes.append(helper.make_node("MatMulNBits", [x, f"{w}.q_blocks", f"{w}.d_flat", f"q8.zp_{out_f}x{n_blocks}_flat"], [y],
                                          domain="com.microsoft", K=in_f, N=out_f, bits=8, block_size=BLOCK, name=f"q8_{y}"))
            continue
        if x not in sums:
            shape = f"q4.shape_{n_blocks}"
            new.setdefault(shape, numpy_helper.from_array(np.array([0, 0, n_blocks, BLOCK], np.int64), shape))
            sums[x] = f"{x}.block_sums"
            nodes += [helper.make_node("Reshape", [x, shape], [f"{x}.blocks"], name=f"q4_blocks_{x}"),
                      helper.make_node("ReduceSum", [f"{x}.blocks", "q4.last_axis"], [sums[x]], keepdims=0,
                                       name=f"q4_block_sums_{x}")]
        nodes += [helper.make_node("MatMulNBits", [x, f"{w}.q", f"{w}.d", f"q4.zeros_{out_f}x{n_blocks}"], [f"{y}.dq"],
                                   domain="com.microsoft", K=in_f, N=out_f, bits=4, block_size=BLOCK, name=f"q4_{y}"),
                  helper.make_node("MatMul", [sums[x], f"{w}.mT"], [f"{y}.mq"], name=f"q4_mins_{y}"),
                  helper.make_node("Add", [f"{y}.dq", f"{y}.mq"], [y], name=f"q4_add_{y}")]
    if "q4_1" not in quantized.values():
        raise ValueError(f"{graph_file}: no MatMul reads a Q4_1 weight of the GGUF")
    new["q4.last_axis"] = numpy_helper.from_array(np.array([-1], np.int64), "q4.last_axis")

    kept = []
    for t in g.initializer:
        if t.name in quantized:
            continue
        where = _external(t)
        if where is not None and t.data_type == onnx.TensorProto.FLOAT:  # into the q4 graph's own file
            origin[t.name] = ("copy", where[:2])
            t = numpy_helper.from_array(np.array(values(t)), t.name)
        kept.append(t)
    del g.initializer[:], g.node[:]
    g.initializer.extend(kept + list(new.values()))
    g.node.extend(nodes)
    return model, origin


def q4_packed(file: str, model: onnx.ModelProto, origin: dict[str, tuple], packed: dict) -> dict:
    """How the page rebuilds the q4 graph's weights file `file` (model's initializers stored there) from
    the blocks file it downloads for the fp32 graph's (`packed`, export/packed.py): each tensor from the
    segment of the fp32 tensor it comes from, as a part of its blocks (kinds q4_1.q, q4_1.d, q4_1.mT,
    q8_0.q, q8_0.d), as a copy of that segment (raw, q8_0), or bytes of 0 or 128. Nothing more goes over
    the wire."""
    segments, blocks_file = {}, set()
    for t in model.graph.initializer:
        where = _external(t)
        if where is None or where[0] != file or where[1] in segments:
            continue
        _, at, length = where
        kind, source = origin[t.name]
        if source is None:
            segments[at] = {"at": at, "bytes": length, "kind": kind}
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
