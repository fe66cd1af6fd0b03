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
from ..errors import CheckpointError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "frozen-mtp-onnx/2"
PRECISIONS = {"fp32": "float32", "fp16": "float16"}  # precision -> ONNX name of its float type


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoint directories an export is made from: the base, and optionally a head and a drafter."""
    base: Path
    head: Path | None = None
    drafter: Path | None = None


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
    package = Path(__file__).resolve().parent.parent
    for name in ("models/llama.py", "models/head.py", "models/gguf.py", "decode/torch_backend.py", "export/graphs.py",
                 "export/fuse.py", "export/packed.py", "export/nbits.py", "export/manifest.py"):
        h.update((package / name).read_bytes())
    return h.hexdigest()


def sources(ckpts: Checkpoints) -> dict:
    """What an export is made from: each checkpoint's file hashes and the exporter's code hash."""
    return {"code": code_hash(),
            **{role: source_hashes(Path(d)) for role, d in vars(ckpts).items() if d is not None}}


def graph_files(graph: dict) -> list[str]:
    """The files a graph needs: its ONNX file and the weights files it reads."""
    return [graph["file"], *graph["weights"]]


def write_manifest(ckpts: Checkpoints, out: Path, precisions: dict, base, head, drafter, packed: dict | None = None) -> dict:
    from ..data.tasks import load_tokenizer, special_tokens
    from ..decode.drafter import DRAFTER_K_MAX
    from ..decode.loop import DEFAULT_K, DEFAULT_LOOKUP, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODE, DRAFT_CUT, LOOKUP_SPAN, MODES
    from .graphs import OPSET, kv_layout

    cfg, tok = base.config, load_tokenizer(ckpts.base)
    first = next(iter(precisions.values()))["graphs"]
    shutil.copyfile(Path(ckpts.base) / "tokenizer.json", out / "tokenizer.json")
    files = [f for p in precisions.values() for g in p["graphs"].values() for f in graph_files(g)] + ["tokenizer.json"]
    packed = packed or {}
    files += [spec["file"] for spec in packed.values()]
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
        "precisions": precisions,
        # a weights file with a packed form (packed.py): the page downloads that and rebuilds this one
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
    from ..decode.drafter import load_drafter
    from ..models.gguf import SOURCE, packed_blocks
    from ..models.head import load_head
    from ..models.llama import load_llama
    from .graphs import export_graphs
    from .packed import pack, rows_of

    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise CheckpointError(f"{out} holds files and is not an ONNX export, which exporting there would replace: "
                              "name a new or empty folder")
    precisions = precisions or tuple(PRECISIONS)
    base = load_llama(ckpts.base)
    head = load_head(ckpts.head, base) if ckpts.head is not None else None
    drafter = load_drafter(ckpts.drafter, base) if ckpts.drafter is not None else None
    logger.info("exporting %s to ONNX (%s) in %s", ", ".join(str(d) for d in vars(ckpts).values() if d),
             ", ".join(precisions), out)
    with replacing(out) as new:  # a kill mid-export leaves the earlier export whole (atomic.py)
        graphs = export_graphs(base, head, drafter, new, precisions)
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
        return write_manifest(ckpts, new, graphs, base, head, drafter, packed)


def export_q4(out: Path, fp32: dict, blocks: dict, packed: dict) -> tuple[dict, dict]:
    """Precision q4 (export/nbits.py): the fp32 graphs, but the base's on the GGUF's Q4_1 and Q8_0 blocks,
    in base.q4.onnx and base.q4.data, which the page rebuilds from the fp32 base's blocks file."""
    from .graphs import WeightStore
    from .nbits import q4_graph, q4_packed

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
        if "packed" in want and not f.is_file():
            continue  # a site: it holds the packed form (listed too, and checked), which the page unpacks
        if not f.is_file():
            raise CheckpointError(f"missing {f} (listed in {path})")
        size, digest = f.stat().st_size, sha256_file(f)
        if digest != want["sha256"]:
            raise CheckpointError(f"{f}: sha256 mismatch, the file is altered or truncated "
                                  f"({size} bytes, sha256 {digest[:16]}..; manifest: {want['bytes']} bytes, "
                                  f"sha256 {want['sha256'][:16]}..)")
    return manifest
