"""Export of the base and the MTP head to ONNX, and the manifest that says how to run them.

Three graphs, all exported from the one model definition (builder/model.py, builder/mtp.py) through
small wrappers that only rename and flatten:

    base.onnx   input_ids (1, T), past_key_i / past_value_i (1, S, n_kv, head_dim) for every layer i
                -> choices (1, T) int64     the greedy token after each fed position (argmax in the graph)
                   margins (1, T) float32   top-1 minus top-2 logit there (for the exactness rule only)
                   hidden (1, T, C)         the final normed hidden states
                   present_key_i / present_value_i (1, S + T, n_kv, head_dim)
                T and S are dynamic; S = 0 is the prefill (one graph serves prefill, decode and verify).
    head.onnx   (and head_k1 .. head_k{K-1}.onnx: the same chain cut at k drafts, so that drafting k costs k steps)
                hidden (1, T, C) and anchor (1,) int64: the base's hidden output as it is, and the index
                of the anchor in it; token (1, 1) int64: the base's choice at the anchor; past_key /
                past_value (1, S, n_kv, head_dim): the base's cache of layer kv_layer, positions
                0..anchor (the anchor is the last cached position)
                -> drafts (1, K) int64: the chain of K = k_train drafts, each conditioned on the one
                before; the caller uses the first k.
    step.onnx   the base graph's inputs -> its outputs plus accepted (1,) int64 and drafts (1, K) int64:
                verify, acceptance and the next draft chain fused into ONE run per speculative step (the
                head drafts from the anchor the acceptance rule picked, over the present cache masked to
                the accepted prefix). The head graph is then needed only for the first step.

Every graph but the step graph is also exported in half precision (`*.fp16.onnx`, `graph["fp16"]`
in the manifest): the same modules cast to fp16, every float input and output float16; RMSNorm and the
softmax compute in fp32 inside, as transformers does. The page runs them where WebGPU has shader-f16.

The head graph carries its own copy of the base's embedding and LM head (an ONNX session cannot read
another session's weights). Logits are never an output: the decode loop reads only token ids.

`manifest.json` records every file's size and sha256, each graph's inputs and outputs (name, dtype,
shape with symbolic axes, and where a browser keeps the output: "gpu" or read back to the "cpu"), the
KV layout and rollback rule, K, the context length, special tokens and the task prompt formats, and
the sha256 of the checkpoint files it was exported from.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from .generate import greedy
from .model import CheckpointError, Llama, load_llama
from .mtp import MTPHead, load_head
from .tasks import load_tokenizer, special_tokens

MANIFEST = "manifest.json"
FORMAT = "frozen-mtp-onnx/1"
OPSET = 18


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
    """The head's whole draft chain of K tokens in one graph, reading the base's outputs as they are."""

    def __init__(self, head: MTPHead, base: Llama, k: int):
        super().__init__()
        self.head, self.base, self.k = head, base, k

    def forward(self, hidden, anchor, token, past_key, past_value):
        h = hidden.index_select(1, anchor)  # (1, 1, C): the base's hidden state at the anchor
        return self.head.draft_ids(self.base, h, token, past_key, past_value, self.k)


class StepGraph(nn.Module):
    """One speculative step in one run: the base verifies [token, d_1..d_k], the acceptance rule picks
    the anchor (the last accepted position), and the head drafts the next K tokens from it."""

    def __init__(self, head: MTPHead, base: Llama):
        super().__init__()
        self.verify, self.head, self.base = BaseGraph(base), head, base

    def forward(self, input_ids, past: list[torch.Tensor]):
        choices, margins, hidden, present = self.verify(input_ids, past)
        wrong = input_ids[0, 1:] != choices[0, :-1]  # (k,): draft i is not the base's choice before it
        stop = torch.cat((wrong, torch.ones(1, dtype=torch.bool)))
        accepted = stop.to(torch.int64).argmax(dim=0, keepdim=True)  # (1,) n: drafts before the first wrong one
        layer = self.head.config.kv_layer
        drafts = self.head.draft_ids(self.base, hidden.index_select(1, accepted), choices.index_select(1, accepted),
                                     present[2 * layer], present[2 * layer + 1], self.head.config.k_train,
                                     anchor=past[0].shape[1] + accepted)
        return choices, margins, hidden, accepted, drafts, present


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


def step_io(base: Llama, head: MTPHead) -> dict:
    spec = base_io(base)
    outputs = spec["outputs"]
    extra = [io("accepted", "int64", [1], "cpu"), io("drafts", "int64", [1, head.config.k_train], "cpu")]
    return {"inputs": spec["inputs"], "outputs": outputs[:3] + extra + outputs[3:]}


def graph_files(graph: dict) -> list[str]:
    """A graph's files: fp32, and fp16 where it has one."""
    return [graph["file"], *([graph["fp16"]["file"]] if "fp16" in graph else [])]


def names(spec: list[dict]) -> list[str]:
    return [s["name"] for s in spec]


def export_graph(module: nn.Module, args: tuple, spec: dict, dynamic_shapes, path: Path) -> None:
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), input_names=names(spec["inputs"]),
                          output_names=names(spec["outputs"]), dynamic_shapes=dynamic_shapes,
                          opset_version=OPSET, dynamo=True, external_data=False, verbose=False,
                          optimize=True)


def export_base(base: Llama, path: Path) -> dict:
    cfg = base.config
    T = torch.export.Dim("T", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("S", min=0, max=cfg.max_position_embeddings)
    # example sizes >= 2 on every dynamic axis, or the exporter specialises the axis
    ids = torch.zeros(1, 3, dtype=torch.long)
    dtype = next(base.parameters()).dtype
    past = [torch.zeros(1, 5, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]
    spec = base_io(base)
    export_graph(BaseGraph(base), (ids, past), spec, ({1: T}, [{1: S}] * len(past)), path)
    return spec


def export_head(head: MTPHead, base: Llama, path: Path, k: int) -> dict:
    cfg = base.config
    T = torch.export.Dim("T", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("S", min=1, max=cfg.max_position_embeddings)
    dtype = next(head.parameters()).dtype
    hidden = torch.zeros(1, 3, cfg.hidden_size, dtype=dtype)
    kv = torch.zeros(1, 5, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    args = (hidden, torch.tensor([2]), torch.tensor([[1]]), kv, kv.clone())
    spec = head_io(head, k)
    export_graph(HeadGraph(head, base, k), args, spec, ({1: T}, None, None, {1: S}, {1: S}), path)
    return spec


def export_step(head: MTPHead, base: Llama, path: Path) -> dict:
    cfg = base.config
    T = torch.export.Dim("T", min=1, max=cfg.max_position_embeddings)
    S = torch.export.Dim("S", min=0, max=cfg.max_position_embeddings)
    ids = torch.zeros(1, 3, dtype=torch.long)
    past = [torch.zeros(1, 5, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    spec = step_io(base, head)
    export_graph(StepGraph(head, base), (ids, past), spec, ({1: T}, [{1: S}] * len(past)), path)
    return spec


def export(base_dir: Path, head_dir: Path | None, out: Path, note=None, drafter_dir: Path | None = None,
           fp16: bool = True) -> dict:
    """Exports base (and head, drafter, when their directories are given) from their checkpoints into out/,
    with manifest.json; with fp16, also every graph but the step graph in half precision (graph["fp16"]).

    note(message) is called once the checkpoints have loaded, before the (slow) export starts."""
    base_dir, out = Path(base_dir), Path(out)
    base = load_llama(base_dir)
    tok = load_tokenizer(base_dir)
    head = load_head(head_dir, base) if head_dir is not None else None
    drafter = load_drafter(drafter_dir, base) if drafter_dir is not None else None
    if note:
        what = [str(d) for d in (base_dir, head_dir, drafter_dir) if d is not None]
        note(f"exporting {', '.join(what)} to ONNX in {out}")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # no manifest describes a half-written export
    cfg = base.config
    graphs = {"base": {"file": "base.onnx", **export_base(base, out / "base.onnx")}}
    sources = {"base": source_hashes(base_dir), "code": code_hash()}
    head_info = None
    if head is not None:
        K = head.config.k_train
        by_k = {k: "head" if k == K else f"head_k{k}" for k in range(1, K + 1)}  # a chain of exactly k drafts
        for k, name in by_k.items():
            graphs[name] = {"file": f"{name}.onnx", **export_head(head, base, out / f"{name}.onnx", k)}
        graphs["step"] = {"file": "step.onnx", **export_step(head, base, out / "step.onnx")}
        sources["head"] = source_hashes(Path(head_dir))
        head_info = {"k": head.config.k_train, "kv_layer": head.config.kv_layer, "by_k": by_k,
                     "kv_inputs": {"past_key": f"present_key_{head.config.kv_layer}",
                                   "past_value": f"present_value_{head.config.kv_layer}"},
                     "usage": "hidden: the base's last hidden output as it is; anchor: index of the anchor "
                              "(the last accepted position) in it; token: the base's choice at the anchor; "
                              "past_key/past_value: the base's present of layer kv_layer, rolled back so "
                              "that the anchor is its last position. by_k names the head graph that drafts "
                              "exactly k tokens (each costs k draft steps); its drafts[0, :k] are the k drafts.",
                     "step": "the step graph fuses a speculative step into one run: its inputs are the base "
                             "graph's (input_ids = [token, d_1..d_k]); besides the base's outputs it returns "
                             "accepted (n, by the acceptance rule) and the K drafts after the anchor at fed "
                             "position n, drafted from a cache masked to positions 0..S+n. Valid when the "
                             "caller keeps n + 1 fed tokens (rolls back to S + n + 1) and continues from "
                             "choices[n], as the decode loop does unless it stops; the first step after the "
                             "prefill drafts with the head graph."}
    drafter_info = None
    if drafter is not None:
        spec = export_base(drafter, out / "drafter.onnx")
        graphs["drafter"] = {"file": "drafter.onnx", **spec}
        sources["drafter"] = source_hashes(Path(drafter_dir))
        dc = drafter.config
        drafter_info = {"kv": {"layers": dc.num_hidden_layers, "shape": [1, "S", dc.num_key_value_heads, dc.head_dim],
                               "past_inputs": [n for n in names(spec["inputs"]) if n.startswith("past_")],
                               "present_outputs": [n for n in names(spec["outputs"]) if n.startswith("present_")]},
                        "usage": "an independent language model with the base graph's inputs and outputs: it keeps "
                                 "its own cache of the sequence (prefill, then one run per draft token, "
                                 "choices[0, -1] is the next draft), rolled back by prefix like the base's"}
    if fp16:  # the same graphs in half precision (the page picks them where WebGPU has shader-f16)
        base16 = copy.deepcopy(base).half()
        half = {"base": export_base(base16, out / "base.fp16.onnx")}
        if head is not None:
            head16 = copy.deepcopy(head).half()
            half.update({name: export_head(head16, base16, out / f"{name}.fp16.onnx", k) for k, name in by_k.items()})
        if drafter is not None:
            half["drafter"] = export_base(copy.deepcopy(drafter).half(), out / "drafter.fp16.onnx")
        for name, spec in half.items():
            graphs[name]["fp16"] = {"file": f"{name}.fp16.onnx", **spec}
    manifest = {
        "format": FORMAT,
        "opset": OPSET,
        "files": {f: {"bytes": (out / f).stat().st_size, "sha256": sha256_file(out / f)}
                  for g in graphs.values() for f in graph_files(g)},
        "graphs": graphs,
        "context_length": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "kv": {"layers": cfg.num_hidden_layers, "dtype": "float32",
               "shape": [1, "S", cfg.num_key_value_heads, cfg.head_dim], "sequence_axis": 1,
               "past_inputs": [n for n in names(graphs["base"]["inputs"]) if n.startswith("past_")],
               "present_outputs": [n for n in names(graphs["base"]["outputs"]) if n.startswith("present_")],
               "prefill": "past tensors with S = 0",
               "rollback": "keep the first n positions of every present tensor: a prefix view on the "
                           "sequence axis (dims [1, n, ...] over the same buffer), no copy; keep the "
                           "owning tensor alive while a view of it is in use"},
        "head": head_info,
        "drafter": drafter_info,
        "precisions": {"fp32": "graph[\"file\"]", "fp16": "graph[\"fp16\"][\"file\"]: the same graph in half "
                       "precision, every float input and output float16 (KV cache, hidden); for WebGPU adapters "
                       "with the shader-f16 feature. The exactness rule holds within one precision."}
                      if fp16 else {"fp32": "graph[\"file\"]"},
        "special_tokens": special_tokens(tok),
        "eos_token_id": cfg.eos_token_id,
        "tasks": tok.tasks,
        "prompt_format": "tasks[task].prefix + ids of the user's text (special tokens not parsed) + tasks[task].suffix",
        "source": sources,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


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
        raise CheckpointError(f"{path} is not a {FORMAT} manifest (format {manifest.get('format')!r})")
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


def load_drafter(directory: Path, base: Llama) -> Llama:
    """An independent drafter checkpoint, checked to share the base's vocabulary and context."""
    drafter = load_llama(directory)
    for field in ("vocab_size", "max_position_embeddings", "eos_token_id"):
        if getattr(drafter.config, field) != getattr(base.config, field):
            raise CheckpointError(f"the drafter in {directory} has {field} {getattr(drafter.config, field)}, "
                                  f"the base {getattr(base.config, field)}: it cannot draft for this base")
    return drafter


def is_export_of(directory: Path, base_dir: Path, head_dir: Path | None, drafter_dir: Path | None = None) -> bool:
    """Whether directory holds an export of exactly these checkpoints (files not checked here)."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    src = manifest.get("source", {})
    if src.get("base") != source_hashes(Path(base_dir)) or src.get("code") != code_hash():
        return False
    if drafter_dir is not None and src.get("drafter") != source_hashes(Path(drafter_dir)):
        return False
    return head_dir is None or src.get("head") == source_hashes(Path(head_dir))
