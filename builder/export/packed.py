"""Weights files as the GGUF's own blocks: what the page downloads for a base imported from a GGUF.

A base imported from a GGUF (models/gguf.py) computes in fp32 on the dequantized values, and so do its
graphs: `base.data` holds 4 bytes a weight (SmolLM2: 540 MB). The file's blocks hold the same values in
5 bits (Q4_1: fp16 d and m, 32 4-bit q; `d * q + m`) or 8.5 (Q8_0: fp16 d, 32 int8 q; `d * q`). `pack`
writes `<name>.blocks` beside each fp32 weights file that has such tensors: their blocks, and the other
tensors' bytes as they are. The manifest lists it (files[<name>.data].packed: the blocks file and one
segment per tensor, where it lies in each file and how it is stored), and the page rebuilds the fp32
file from it once per download (web/src/blocks.mjs), checked against the fp32 file's sha256: the graphs
read the very bytes torch computes on. WASM has no fast 4-bit kernel (docs/web.md): 4 bits pay on the wire.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx

from ..contract import BLOCKS  # kind -> (values per block, bytes per block)


def external_tensors(out: Path) -> dict[str, set[tuple[int, int]]]:
    """weights file -> the (offset, length) of every tensor a graph in out/ reads from it."""
    found: dict[str, set[tuple[int, int]]] = {}
    for graph in sorted(out.glob("*.onnx")):
        model = onnx.load(graph, load_external_data=False)
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            found.setdefault(info["location"], set()).add((int(info["offset"]), int(info["length"])))
    return found


def rows_of(blocks: dict[str, dict], weight: np.ndarray, rows: np.ndarray) -> dict[str, dict]:
    """The entry of weight[rows] (fp32), when weight has one in `blocks`: the same blocks, those rows
    (an MTP head's draft-vocabulary rows of the embedding). {} when it has none."""
    hit = blocks.get(hashlib.sha256(np.ascontiguousarray(weight, dtype=np.float32).tobytes()).hexdigest())
    if hit is None:
        return {}
    part = np.ascontiguousarray(weight[rows], dtype=np.float32)
    return {hashlib.sha256(part.tobytes()).hexdigest(): {"kind": hit["kind"], "blocks": np.ascontiguousarray(hit["blocks"][rows])}}


def pack(out: Path, blocks: dict[str, dict]) -> dict[str, dict]:
    """Writes <name>.blocks for each fp32 weights file in out/ holding tensors found in `blocks`
    (models/gguf.packed_blocks: sha256 of the fp32 values -> kind and blocks). Returns weights file ->
    {"file": its blocks file, "segments": [{"at", "bytes", "kind", "from", "rows"}, ..]}: the tensor of
    `bytes` bytes at offset `at` in the weights file is stored from offset `from` of the blocks file,
    as its `rows` rows of blocks (kind q4_1 or q8_0) or as it is (kind raw). Bytes between tensors are 0."""
    packed = {}
    for file, tensors in sorted(external_tensors(out).items()):
        if file.endswith(".fp16.data"):
            continue  # fp16 values: not the file's
        data = (out / file).read_bytes()
        segments, parts, size = [], [], 0
        for at, length in sorted(tensors):
            raw = data[at:at + length]
            hit = blocks.get(hashlib.sha256(raw).hexdigest())
            if hit is None:
                body, seg = raw, {"kind": "raw"}
            else:
                body, seg = hit["blocks"].tobytes(), {"kind": hit["kind"], "rows": int(hit["blocks"].shape[0])}
                per, nbytes = BLOCKS[hit["kind"]]
                if len(body) // nbytes * per * 4 != length:
                    raise ValueError(f"{file} at {at}: {len(body)} bytes of {hit['kind']} blocks for {length} bytes of fp32")
            segments.append({"at": at, "bytes": length, "from": size, **seg})
            parts.append(body)
            size += len(body)
        if all(s["kind"] == "raw" for s in segments):
            continue
        name = file.removesuffix(".data") + ".blocks"
        (out / name).write_bytes(b"".join(parts))
        packed[file] = {"file": name, "segments": segments}
    return packed
