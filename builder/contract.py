"""The facts every room shares, defined once (docs/contract.md): the bottom of the import order.

It imports no torch and no onnx, and nothing of builder but errors.py; every other module may import it.
What the page needs of it the export writes into the manifest (export/manifest.py), and the page reads
it from there: the modes with their labels and roles, the defaults, the lookup span, the draft cut, the
GGUF block table (web/src/blocks.mjs refuses one it does not read).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import CheckpointError

# --- modes and their defaults ---------------------------------------------------------------------------

# mode -> its draft source: plain decoding (the reference), the MTP head, the independent drafter (the baseline)
MODES = {"ar": None, "mtp": "head", "drafter": "drafter"}
MODE_LABELS = {"ar": "plain", "mtp": "MTP", "drafter": "drafter"}  # how the report and the page name them
MODE_ROLES = {"ar": "base alone", "mtp": "head drafts, base verifies", "drafter": "independent, the baseline"}  # the page's menu
DEFAULT_MODE = "mtp"          # the CLI's and (by the manifest) the page's
DEFAULT_K = 4                 # drafts per speculative step: the one default of the CLI and (by the manifest) the page
DEFAULT_MAX_NEW_TOKENS = 32   # likewise
DEFAULT_LOOKUP = True         # prompt lookup before the mode's draft source: likewise
LOOKUP_SPAN = 2               # prompt lookup drafts up to this many times k tokens (the page reads it from the manifest)
# the page's draft cut by execution provider (the manifest's draft_cut): chosen on prompts other than the cards'
# (bench/heads/draft_cut.py); WebGPU's 0 until measured on a GPU, where verifying more tokens should cost little
DRAFT_CUT = {"wasm": 0.15, "webgpu": 0.0}
DRAFTER_K_MAX = 16  # the most drafts per step the drafter is asked for (any k works; more is not useful)
NEAR_TIE = 1e-3  # docs/contract.md: a divergence is excused only where the reference's margin is below this
STOP_REASONS = ("max-new-tokens", "end-of-sequence", "context-window")  # why a decode ended (Decoded.stopped)

# --- precisions ---------------------------------------------------------------------------------------

PRECISIONS = {"fp32": "float32", "fp16": "float16"}  # exported from any checkpoint: precision -> ONNX float type
# q4: the fp32 graphs with the base's on the Q4_1/Q8_0 blocks of the GGUF (export/nbits.py); it needs a base
# imported from a GGUF and the fp32 graphs, and is exported beside them
Q4 = "q4"
ALL_PRECISIONS = (*PRECISIONS, Q4)


def exported_for(precision: str) -> tuple[str, ...]:
    """The precisions to export for running in this one."""
    return ("fp32",) if precision == Q4 else (precision,)


# --- the GGUF blocks a page unpacks (web/src/blocks.mjs) ----------------------------------------------

BLOCKS = {"q4_1": (32, 20), "q8_0": (32, 34)}  # kind -> (weights, bytes) of one block
GGUF_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGUF block type -> kind

# --- the benchmark's runtimes and peers (`bench`) -----------------------------------------------------

RUNTIMES = ("torch", "onnx-cpu", "browser-wasm", "browser-wasm-1thread", "browser-webgpu")
# a peer -> its runtimes -> their threads ("max": as many as the page's browser-wasm picks, one per core, at most
# 4): the same model in the runtimes a user would pick instead (bench/run.py)
PEERS = {"wllama": {"wllama-wasm": "max", "wllama-wasm-1thread": 1},
         "transformersjs": {"transformersjs-wasm": "max", "transformersjs-wasm-1thread": 1},
         # the 8-bit and 4-bit weights transformers.js users load on WASM (onnxruntime's quantizers, bench/hf_onnx.py)
         "transformersjs-q8": {"transformersjs-q8-wasm": "max", "transformersjs-q8-wasm-1thread": 1},
         "transformersjs-q4": {"transformersjs-q4-wasm": "max", "transformersjs-q4-wasm-1thread": 1},
         "llamacpp": {"llamacpp-native": "max", "llamacpp-native-1thread": 1}}

# --- the manifest -------------------------------------------------------------------------------------
# manifest.json (written by export/manifest.py) holds every file's size and sha256, per precision each
# graph's file, weight files, inputs and outputs, the KV layout, the head's k and KV layer, the context
# length, special tokens, the tasks' prompt formats, the modes, the defaults, and what it was exported from.

MANIFEST = "manifest.json"
FORMAT = "frozen-mtp-onnx/2"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def graph_files(graph: dict) -> list[str]:
    """The files a graph needs: its ONNX file and the weights files it reads."""
    return [graph["file"], *graph["weights"]]


def read_json(path: Path, missing: str = "") -> dict:
    """A JSON object from path: a missing file (missing: what to do about it), invalid JSON or anything but an
    object is a CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing {path}" + (f": {missing}" if missing else ""))
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value


def read_manifest(directory: Path) -> dict:
    """The manifest of an export, every file checked against its recorded size and sha256."""
    directory = Path(directory)
    path = directory / MANIFEST
    manifest = read_json(path, "export the models first")
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
