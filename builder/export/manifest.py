"""The export as a whole: every graph of the checkpoints, and `manifest.json`, the one I/O contract.

`manifest.json` (README.md, "The manifest") holds every file's size and sha256, per precision each
graph's file, weight files, inputs and outputs (name, dtype, shape with symbolic axes, where a browser
keeps the output: "gpu" or read back to the "cpu"), the KV layout, the head's k and KV layer, the
context length, special tokens, the tasks' prompt formats, the modes, the defaults, and the sha256 of
the checkpoints and code it was exported from (an export of other checkpoints or older code is stale
and made again). Python (decode/onnx_backend.py) and the page (web/src) read it; neither re-derives it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..atomic import locked, replacing
from ..contract import (BLOCKS, DEFAULT_K, DEFAULT_LOOKUP, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODE, DRAFT_CUT,
                        DRAFTER_K_MAX, FORMAT, LOOKUP_SPAN, MANIFEST, MODE_LABELS, MODE_ROLES, MODES, PRECISIONS,
                        graph_files, read_manifest, sha256_file)
from ..data.tasks import load_tokenizer, special_tokens
from ..decode.drafter import load_drafter
from ..errors import CheckpointError
from ..models.adapter import ADAPTER_FILES, is_adapter_key, read_adapter_config
from ..models.adapter import PREFIX as PEFT_PREFIX
from ..models.gguf import SOURCE, packed_blocks
from ..models.head import base_fingerprint, load_head
from ..models.llama import load_llama
from .graphs import OPSET, WeightStore, export_graphs, kv_layout
from .nbits import q4_graph, q4_packed
from .packed import pack, rows_of

logger = logging.getLogger(__name__)

# the code an export is made by (package-relative globs): a change to any of it makes old exports stale
CODE = ("contract.py", "models/*.py", "decode/torch_backend.py", "export/*.py")


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoint directories an export is made from: the base, and optionally a head, a drafter and
    the features' adapters (models/adapter.py; all of one rank and alpha, each trained on this base)."""
    base: Path
    head: Path | None = None
    drafter: Path | None = None
    adapters: tuple[Path, ...] = ()

    def models(self) -> dict[str, Path]:
        """role -> directory of every checkpoint given (an adapter's role: adapter.TASK)."""
        roles = {role: Path(d) for role in ("base", "head", "drafter") if (d := getattr(self, role)) is not None}
        return roles | {f"adapter.{read_adapter_config(d)['task']}": Path(d) for d in self.adapters}


# --- the manifest ------------------------------------------------------------------------------------

def source_hashes(directory: Path) -> dict[str, str]:
    """sha256 of a checkpoint's files: tells whether an export is still the export of this checkpoint."""
    return {name: sha256_file(directory / name) for name in ("config.json", "model.safetensors", *ADAPTER_FILES)
            if (directory / name).is_file()}


def code_hash() -> str:
    """sha256 over the code an export is made from: a changed model or exporter makes old exports stale."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for pattern in CODE:
        for path in sorted(package.glob(pattern)):
            h.update(path.read_bytes())
    return h.hexdigest()


def sources(ckpts: Checkpoints) -> dict:
    """What an export is made from: each checkpoint's file hashes and the exporter's code hash."""
    return {"code": code_hash(), **{role: source_hashes(d) for role, d in ckpts.models().items()}}


def write_manifest(ckpts: Checkpoints, out: Path, precisions: dict, base, head, drafter, packed: dict | None = None,
                   adapters: dict | None = None) -> dict:
    cfg, tok = base.config, load_tokenizer(ckpts.base)
    first = next(iter(precisions.values()))["graphs"]
    shutil.copyfile(Path(ckpts.base) / "tokenizer.json", out / "tokenizer.json")
    files = [f for p in precisions.values() for g in p["graphs"].values() for f in graph_files(g)] + ["tokenizer.json"]
    packed, adapters = packed or {}, adapters or {}
    files += [spec["file"] for spec in packed.values()] + [adapter_file(task) for task in adapters]
    sources_here = {"head": head, "drafter": drafter}
    manifest = {
        "format": FORMAT,
        "opset": OPSET,
        "context_length": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "eos_token_id": cfg.eos_token_id,
        "special_tokens": special_tokens(tok.tokenizer),
        "tasks": tok.tasks,
        "chat": tok.chat,  # a chat model's template as turns (tasks.py's chat_turns), else null
        # mode -> its draft source: the modes this export can run (a mode whose source was not exported is left out)
        "modes": {mode: source for mode, source in MODES.items() if source is None or sources_here[source] is not None},
        "mode_labels": MODE_LABELS,  # how the page names them (contract.py)
        "mode_roles": MODE_ROLES,  # and says what each does
        "defaults": {"mode": DEFAULT_MODE if head is not None else "ar",
                     "k": min(DEFAULT_K, head.config.k_train) if head else DEFAULT_K,  # a head may draft fewer
                     "max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "lookup": DEFAULT_LOOKUP},
        "lookup_span": LOOKUP_SPAN,  # prompt lookup drafts up to this many times k tokens (loop.py)
        "draft_cut": DRAFT_CUT,  # execution provider -> the page's draft cut (loop.py)
        "kv": kv_layout(first["base"], cfg),
        "head": None if head is None else {
            "k": head.config.k_train, "kv_layer": head.config.kv_layer,
            "by_k": {str(k): f"head_k{k}" for k in range(1, head.config.k_train + 1)},
            "kv_inputs": {"past_key": f"present_key_{head.config.kv_layer}",
                          "past_value": f"present_value_{head.config.kv_layer}"}},
        "drafter": None if drafter is None else {"k": DRAFTER_K_MAX, "kv": kv_layout(first["drafter"], drafter.config)},
        # the features' adapters: each task's file (safetensors, fp16, PEFT's keys), and the base graph's inputs
        # they feed: input name -> [the file's key, scale]: that tensor transposed, times scale (zeros for a task
        # without an adapter: the base alone)
        "adapters": None if not adapters else adapter_manifest(adapters, first["base"]["inputs"]),
        "precisions": precisions,
        # a weights file with a packed form (packed.py): the page downloads that and rebuilds this one
        "blocks": BLOCKS,  # a packed file's block kinds -> (weights, bytes) of one block (contract.py)
        "files": {f: {"bytes": (out / f).stat().st_size, "sha256": sha256_file(out / f),
                      **({"packed": packed[f]} if f in packed else {})} for f in files},
        "tokenizer": "tokenizer.json",
        "source": sources(ckpts),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def export(ckpts: Checkpoints, out: Path, precisions: tuple[str, ...] | None = None) -> dict:
    """Exports the checkpoints into out/ (replacing an earlier export there, whole) in the given precisions
    (default: every one) and writes its manifest."""
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise CheckpointError(f"{out} holds files and is not an ONNX export, which exporting there would replace: "
                              "name a new or empty folder")
    precisions = precisions or tuple(PRECISIONS)
    base = load_llama(ckpts.base)
    head = load_head(ckpts.head, base) if ckpts.head is not None else None
    drafter = load_drafter(ckpts.drafter, base) if ckpts.drafter is not None else None
    adapters = adapter_configs(ckpts, base)
    logger.info("exporting %s to ONNX (%s) in %s", ", ".join(map(str, ckpts.models().values())),
                ", ".join(precisions), out)
    with replacing(out) as new:  # a kill mid-export leaves the earlier export whole (atomic.py)
        rank = next((c["r"] for c in adapters.values()), None)
        graphs = export_graphs(base, head, drafter, new, precisions, adapter=rank)
        for task, config in adapters.items():  # each feature's adapter as it is (fp16), fed to the base graph
            shutil.copyfile(config["dir"] / "adapter_model.safetensors", new / adapter_file(task))
        # a base imported from a GGUF: its weights also as the file's blocks, what the page downloads
        packed = {}
        if (Path(ckpts.base) / SOURCE).is_file():
            blocks = packed_blocks(ckpts.base)
            if head is not None and head.config.draft_vocab:  # the head's rows of the embedding and LM head
                for weight in {id(w): w for w in (base.model.embed_tokens.weight, base.lm_head.weight)}.values():
                    blocks.update(rows_of(blocks, weight.detach().numpy(), head.d2t.numpy()))
            packed = pack(new, blocks)
            if "fp32" in graphs:
                graphs["q4"], packed["base.q4.data"] = export_q4(new, graphs["fp32"], blocks, packed)
        return write_manifest(ckpts, new, graphs, base, head, drafter, packed, adapters)


def adapter_file(task: str) -> str:
    return f"adapter.{task}.safetensors"


def adapter_manifest(adapters: dict[str, dict], inputs: list[dict]) -> dict:
    c = next(iter(adapters.values()))
    scale = c["lora_alpha"] / c["r"]
    return {"rank": c["r"], "alpha": c["lora_alpha"], "by_task": {task: adapter_file(task) for task in adapters},
            "inputs": {i["name"]: [PEFT_PREFIX + i["name"].removesuffix(".T") + ".weight",
                                   scale if ".lora_B." in i["name"] else 1.0] for i in inputs if is_adapter_key(i["name"])}}


def adapter_configs(ckpts: Checkpoints, base) -> dict[str, dict]:
    """task -> the config of its adapter (with "dir"), each checked: trained on this base, one per task, all
    of one rank and alpha (the base graph takes them as inputs of one shape, scaled by one alpha / rank)."""
    configs: dict[str, dict] = {}
    fingerprint = base_fingerprint(base) if ckpts.adapters else None
    for d in map(Path, ckpts.adapters):
        c = {**read_adapter_config(d), "dir": d}
        c.setdefault("lora_alpha", c["r"])
        if c.get("base_fingerprint") != fingerprint:
            raise CheckpointError(f"the adapter in {d} was trained for another base than {ckpts.base}")
        if c.get("task") in configs or not isinstance(c.get("task"), str):
            raise CheckpointError(f"{d}: an adapter names its task, one adapter a task ({c.get('task')!r} twice or none)")
        first = next(iter(configs.values()), c)
        if (c["r"], c["lora_alpha"]) != (first["r"], first["lora_alpha"]):
            raise CheckpointError(f"the adapters in {first['dir']} and {d} differ in rank or alpha: one base graph "
                                  "takes them all, so they must share both")
        configs[c["task"]] = c
    return configs


def export_q4(out: Path, fp32: dict, blocks: dict, packed: dict) -> tuple[dict, dict]:
    """Precision q4 (export/nbits.py): the fp32 graphs, but the base's on the GGUF's Q4_1 and Q8_0 blocks,
    in base.q4.onnx and base.q4.data, which the page rebuilds from the fp32 base's blocks file."""
    model, origin = q4_graph(out, fp32["graphs"]["base"]["file"], blocks)
    weights = WeightStore(out).externalize(model, "base", ".q4")
    onnx.save(model, out / "base.q4.onnx")
    graphs = {**fp32["graphs"], "base": {**fp32["graphs"]["base"], "file": "base.q4.onnx", "weights": weights}}
    return {"dtype": fp32["dtype"], "graphs": graphs}, q4_packed("base.q4.data", model, origin, packed)


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


def ensure_export(ckpts: Checkpoints, directory: Path, precisions: tuple[str, ...] = tuple(PRECISIONS)) -> dict:
    """The manifest of the export of ckpts in directory, exported there first when missing or stale;
    every file checked against the manifest. Holds the export's lock: a second writer waits its turn."""
    with locked(directory):
        if not is_export_of(directory, ckpts, precisions):
            export(ckpts, directory, precisions)
        return read_manifest(directory)
