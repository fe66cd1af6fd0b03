"""SmolLM2 as transformers.js loads a Llama decoder: the ONNX export the transformers.js peer runs.

transformers.js (@huggingface/transformers) runs a decoder-only model from a folder laid out as the
Hugging Face hub's ONNX repositories are (optimum's export):

    <dir>/<model-id>/config.json              model_type "llama" and the sizes it reads (layers, kv heads, head_dim)
                     generation_config.json   bos / eos
                     tokenizer.json, tokenizer_config.json
                     onnx/model.onnx          the graph (fp32: dtype "fp32" loads onnx/model.onnx)
                     onnx/model.onnx_data     its weights, as ONNX external data
                     onnx/model_quantized.onnx  8-bit weights (dtype "q8", transformers.js's default on WASM)
                     onnx/model_q4.onnx       4-bit weights (dtype "q4")

The graph has optimum's I/O for a Llama decoder with KV cache: inputs input_ids (batch, T) int64,
attention_mask (batch, S + T) int64, position_ids (batch, T) int64, past_key_values.{i}.key / .value
(batch, n_kv_heads, S, head_dim); outputs logits (batch, T, vocab) and present.{i}.key / .value
(batch, n_kv_heads, S + T, head_dim). transformers.js makes the empty cache of the first call from the
graph's input shapes (a named axis it does not know is 0), feeds position_ids from the mask's cumulative
sum and reads the last position's logits. Like recent optimum exports, it also takes `num_logits_to_keep`
(int64 scalar: the logits of the last n positions, 0 for all), which transformers.js feeds as 1 when it
generates: the prompt's positions never pass the LM head, a fifth of a pass's arithmetic (as our page's
base graph, with its `outputs_at`: the peer gets the same saving).

It is exported from the project's one model definition (models/llama.py) through `HFDecoder`, which only
transposes the cache between the two layouts and reads the positions and mask it is given: the same fp32
computation as the PyTorch reference. Batch 1 only: the batch axis is static (transformers.js greedy
generation of one prompt always has an all-ones mask; a padded batch is not supported here). The
project's own rewrites (fused RMSNorm and rotary operators, fp16 storage) are not applied:
this is a plain export, as a transformers.js user would get one; onnxruntime optimizes it when it loads.

Weights go to one external data file (model.onnx_data, named in config.json's transformers.js_config as
transformers.js expects): it is not gzipped when served, and the graph file stays small. The quantized
graphs are made from it with onnxruntime's own quantizers, as transformers.js's conversion script makes
the q8 and q4 files its users load (`quantized`, on the weights with their Transposes folded): q8, dynamic
int8 quantization of every MatMul's weights (MatMulInteger, activations quantized per call); q4, MatMulNBits
with blocks of 32 weights, symmetric.
Their weights are inline (each file well under protobuf's 2 GB). Their outputs are not the fp32 model's:
the bench counts their mismatches, and compares speed only. The export is cached under build/hf-onnx/,
keyed by the base's fingerprint and this module's FORMAT.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn

from ..export.fuse import INLINE_BYTES, untranspose, without_provenance
from ..export.graphs import OPSET
from ..models.head import base_fingerprint
from ..models.llama import Llama, LlamaConfig, load_config, load_llama, rope_cos_sin

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "hf-onnx"
MODEL_ID = "smollm2"
FORMAT = 4  # bump when the export changes: a new cache key (2: num_logits_to_keep; 4: q8 and q4 graphs)
QUANTIZED = {"q8": "model_quantized.onnx", "q4": "model_q4.onnx"}  # transformers.js's file for each dtype
COPIED = ("tokenizer.json", "tokenizer_config.json")


class HFDecoder(nn.Module):
    """Llama with optimum's decoder I/O (batch 1): the cache in (B, n_kv, S, D), transposed to and from
    the model's (B, S, n_kv, D); RoPE at the given position_ids; the mask as attend()'s key bias (all
    ones: + 0, the reference's scores exactly)."""

    def __init__(self, base: Llama):
        super().__init__()
        self.base = base

    def forward(self, input_ids, attention_mask, position_ids, past: list[torch.Tensor]):
        base, cfg = self.base, self.base.config
        x = base.model.embed_tokens(input_ids)
        cos, sin = (t.to(x.dtype) for t in rope_cos_sin(position_ids[0], cfg.head_dim, cfg.rope_theta))
        key_bias = (1 - attention_mask).to(x.dtype) * -1e9  # 0 where a key may be read
        present = []
        for i, layer in enumerate(base.model.layers):
            kv = (past[2 * i].transpose(1, 2), past[2 * i + 1].transpose(1, 2))
            x, (k, v) = layer(x, cos, sin, kv, key_bias)
            present += [k.transpose(1, 2), v.transpose(1, 2)]
        return base.lm_head(base.model.norm(x)), present


def io_names(cfg) -> tuple[list[str], list[str]]:
    layers = range(cfg.num_hidden_layers)
    past = [f"past_key_values.{i}.{kind}" for i in layers for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in layers for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_graph(base: Llama) -> onnx.ModelProto:
    """HFDecoder(base) through torch.onnx's dynamo exporter (opset 18, as export/graphs.py)."""
    cfg = base.config
    T = torch.export.Dim("sequence_length", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("past_sequence_length", min=0, max=cfg.max_position_embeddings)
    # example sizes >= 2 on every dynamic axis, or the exporter specialises the axis; batch stays 1
    ids = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.ones(1, 8, dtype=torch.long)
    positions = torch.arange(5, 8)[None]
    past = [torch.zeros(1, cfg.num_key_value_heads, 5, cfg.head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    inputs, outputs = io_names(cfg)
    module = HFDecoder(base).eval()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, (ids, mask, positions, past), None, input_names=inputs, output_names=outputs,
            dynamic_shapes=({1: T}, {1: torch.export.Dim.AUTO}, {1: T}, [{2: S}] * len(past)),
            opset_version=OPSET, dynamo=True, verbose=False, optimize=True)
    # one copy of the tied embedding / LM head matrix (the exporter folds a transposed second copy)
    return logits_to_keep(untranspose(without_provenance(program.model_proto), module))


def logits_to_keep(model: onnx.ModelProto) -> onnx.ModelProto:
    """Adds optimum's `num_logits_to_keep` input: the LM head reads the last n positions of the normed
    hidden states (a Slice from -n: n = 0 keeps them all), and `logits` is (1, n, vocab)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    lm_head = next(n for n in graph.node if "logits" in n.output)
    graph.initializer.extend([numpy_helper.from_array(np.array(a, np.int64), name) for name, a in
                              (("keep_shape", [1]), ("keep_end", [np.iinfo(np.int64).max]), ("keep_axis", [1]))])
    kept = lm_head.input[0] + "_kept"
    nodes = [helper.make_node("Reshape", ["num_logits_to_keep", "keep_shape"], ["keep_n"]),
             helper.make_node("Neg", ["keep_n"], ["keep_start"]),
             helper.make_node("Slice", [lm_head.input[0], "keep_start", "keep_end", "keep_axis"], [kept])]
    lm_head.input[0] = kept
    at = list(graph.node).index(lm_head)
    for i, node in enumerate(nodes):
        graph.node.insert(at + i, node)
    graph.input.insert(3, helper.make_tensor_value_info("num_logits_to_keep", TensorProto.INT64, []))
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].dim_param = "num_logits"
    return model


def hf_config(model_dir: Path) -> dict:
    """config.json for transformers.js: the checkpoint's, normalized by LlamaConfig, and where the weights are."""
    cfg = LlamaConfig.from_hf(load_config(model_dir))
    return {**cfg.to_hf(), "transformers.js_config": {"dtype": "fp32", "use_external_data_format": {"model.onnx": True}}}


def folded_transposes(model: onnx.ModelProto) -> onnx.ModelProto:
    """model with every Transpose of a weight replaced by the transposed weight. The exporter feeds each
    projection's weight to its MatMul through a Transpose, and onnxruntime's quantizers quantize a MatMul only
    where its second input is a weight (the tied LM head gets a transposed copy of the embedding)."""
    from onnx import numpy_helper

    graph = model.graph
    weights = {w.name: w for w in graph.initializer}
    nodes = []
    for node in graph.node:
        if node.op_type == "Transpose" and node.input[0] in weights:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            value = numpy_helper.to_array(weights[node.input[0]]).transpose(perm)
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), node.output[0]))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [w for w in graph.initializer if w.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return model


def quantized(fp32: Path, dtype: str, out: Path) -> None:
    """The graph in fp32 (with its external data) quantized to dtype "q8" or "q4" into out (module doc)."""
    model = folded_transposes(onnx.load(str(fp32)))
    if dtype == "q8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(model, str(out), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
    elif dtype == "q4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True)
        quantizer.process()
        onnx.save_model(quantizer.model.model, str(out))
    else:
        raise ValueError(f"dtype {dtype!r}: q8 or q4")


def cache_key(model_dir: Path) -> str:
    """The base's fingerprint (recorded in gguf.json for an imported base, else computed) and FORMAT."""
    source = model_dir / "gguf.json"
    if source.is_file():
        fingerprint = json.loads(source.read_text())["fingerprint"]
    else:
        fingerprint = base_fingerprint(load_llama(model_dir))
    return hashlib.sha256(f"{fingerprint}:hf-onnx-{FORMAT}".encode()).hexdigest()[:20]


def export_hf_onnx(model_dir: Path = ROOT / "models" / "base", cache: Path = CACHE,
                   model_id: str = MODEL_ID) -> Path:
    """The transformers.js folder of the checkpoint in model_dir: `<cache>/<key>/<model_id>/`, exported
    on first use (a minute or two for SmolLM2), reused after. Returns `<cache>/<key>` (the local model path
    transformers.js is pointed at; the model is `model_id` in it)."""
    model_dir = Path(model_dir)
    root = cache / cache_key(model_dir)
    out = root / model_id
    if (out / "config.json").is_file():  # written last: the export is complete
        return root
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / model_id / "onnx").mkdir(parents=True)
    t0 = time.perf_counter()
    graph = export_graph(load_llama(model_dir))
    onnx.save_model(graph, tmp / model_id / "onnx" / "model.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx_data", size_threshold=INLINE_BYTES)
    del graph
    for dtype, name in QUANTIZED.items():
        quantized(tmp / model_id / "onnx" / "model.onnx", dtype, tmp / model_id / "onnx" / name)
    config = load_config(model_dir)
    (tmp / model_id / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
         "do_sample": False}, indent=2) + "\n")
    for name in COPIED:
        shutil.copyfile(model_dir / name, tmp / model_id / name)
    (tmp / model_id / "export.json").write_text(json.dumps(
        {"source": str(model_dir), "key": root.name, "format": FORMAT, "export_s": round(time.perf_counter() - t0, 1),
         "torch": torch.__version__}, indent=2) + "\n")
    (tmp / model_id / "config.json").write_text(json.dumps(hf_config(model_dir), indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


if __name__ == "__main__":  # python -m builder.bench.hf_onnx: export (or find) and print the folder
    print(export_hf_onnx() / MODEL_ID)
