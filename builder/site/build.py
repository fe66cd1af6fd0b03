"""`build`: the static site, rendered from web/ into one self-contained folder.

build() reads as the recipe:
1. export the checkpoints to ONNX (reused when build/onnx already is their export);
2. install the browser libraries with `npm ci` from web/package-lock.json when they are missing;
3. render web/templates with jinja2, copy the page's ES modules and stylesheet;
4. copy the graphs and weights files of the precisions asked for (a weights file with a packed form,
   export/packed.py: that form instead), the tokenizer, the features' adapters, and a manifest that lists
   exactly those files;
5. copy only the onnxruntime-web and tokenizer library files the page loads (and their licences); the
   manifest records the sha256 of its WebAssembly runtimes, which the page checks in its cache.

Every path in the site is relative, so the folder works on any static host.

The site is written into a temporary sibling of out/ and renamed into place (atomic.py), so an interrupted
build leaves the previous site as it was. build replaces only what it made: out/ must be new, empty, or a
site it built (the marker file SITE_MARKER), and must not hold the ONNX export, the checkout or $HOME.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import jinja2

from ..atomic import locked, replacing
from ..contract import FORMAT, MANIFEST, PRECISIONS, Q4, graph_files, sha256_file
from ..errors import SiteError
from ..export.manifest import Checkpoints, ensure_export

logger = logging.getLogger(__name__)

WEB = Path(__file__).resolve().parents[2] / "web"
SITE_MARKER = ".frozen-mtp-site"  # written into every site: a folder without it is not build's to replace
# node_modules file -> site file. Two builds of onnxruntime-web, each bundle with the WebAssembly runtime
# it imports next to itself; the page loads one (load.mjs): ort.webgpu.min.mjs, the native WebGPU bundle
# (its asyncify runtime also runs the wasm EP), on WebGPU; ort.wasm.min.mjs, half the bytes, on WASM.
VENDOR = {
    "onnxruntime-web/dist/ort.webgpu.min.mjs": "vendor/ort/ort.webgpu.min.mjs",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.mjs": "vendor/ort/ort-wasm-simd-threaded.asyncify.mjs",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.wasm": "vendor/ort/ort-wasm-simd-threaded.asyncify.wasm",
    "onnxruntime-web/dist/ort.wasm.min.mjs": "vendor/ort/ort.wasm.min.mjs",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.mjs": "vendor/ort/ort-wasm-simd-threaded.mjs",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.wasm": "vendor/ort/ort-wasm-simd-threaded.wasm",
    "@huggingface/tokenizers/dist/tokenizers.min.mjs": "vendor/tokenizers/tokenizers.min.mjs",
    "@huggingface/tokenizers/LICENSE": "vendor/tokenizers/LICENSE",
}

def build(ckpts: Checkpoints, out: Path, onnx_dir: Path, precisions: tuple[str, ...] = tuple(PRECISIONS)) -> dict:
    """Builds the static site into out/ (replacing it) with the graphs of ckpts in the given precisions.
    Returns the site's manifest."""
    out = Path(out)
    check_out(out, Path(onnx_dir))
    manifest = ensure_export(ckpts, Path(onnx_dir), precisions)  # every file checked against its sha256
    node_modules = npm_ci(WEB)

    with locked(out):
        check_out(out, Path(onnx_dir))  # again: another build may have written it meanwhile
        with replacing(out) as new:
            for src, dst in VENDOR.items():
                (new / dst).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(node_modules / src, new / dst)
            # the WebAssembly runtimes, which the page keeps in Cache Storage, checked there against these
            runtimes = {dst: {"bytes": (new / dst).stat().st_size, "sha256": sha256_file(new / dst)}
                        for dst in VENDOR.values() if dst.endswith(".wasm")}
            (new / "models").mkdir()
            site_manifest = site_models(manifest, Path(onnx_dir), precisions, new / "models", runtimes)
            render(new, site_manifest)
            (new / SITE_MARKER).write_text("a site written by `python -m builder build`, which replaces this folder\n")
    logger.info("built the site in %s (%.1f MB)", out, site_bytes(out) / 1e6)
    return site_manifest


def check_out(out: Path, onnx_dir: Path) -> None:
    """Refuses an --out that build would wrongly replace: one holding the export, the checkout or $HOME, or a
    folder with files that is not a site build made."""
    where = out.resolve()
    for what, inside in (("the ONNX export", onnx_dir), ("the checkout", WEB.parent), ("your home folder", Path.home())):
        if where == inside.resolve() or where in inside.resolve().parents:
            raise SiteError(f"--out {out} holds {what} ({inside}), which building there would delete: "
                            "name a folder of its own, e.g. build/site")
    if where.exists() and not where.is_dir():
        raise SiteError(f"--out {out} is a file, not a folder")
    if where.is_dir() and any(where.iterdir()) and not is_site(where):
        raise SiteError(f"--out {out} holds files and is not a site `build` made, which it would replace: "
                        "name a new or empty folder")


def is_site(directory: Path) -> bool:
    """A site build wrote: its marker, or (built before the marker) index.html and a manifest of this format."""
    if (directory / SITE_MARKER).is_file():
        return True
    try:
        manifest = json.loads((directory / "models" / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (directory / "index.html").is_file() and manifest.get("format") == FORMAT


def npm_ci(web: Path) -> Path:
    """web/node_modules, installed from the lock file (`npm ci`) unless every file the site needs is there."""
    node_modules = web / "node_modules"
    if all((node_modules / src).is_file() for src in VENDOR):
        return node_modules
    npm = shutil.which("npm")
    if npm is None:
        raise SiteError("npm is not installed: it installs onnxruntime-web from web/package-lock.json "
                        "(Debian: apt-get install npm)")
    logger.info("installing the browser libraries: npm ci in web/")
    done = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=web,
                          capture_output=True, text=True)
    missing = [src for src in VENDOR if not (node_modules / src).is_file()]
    if done.returncode != 0 or missing:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SiteError(f"npm ci in {web} failed ({last})" if done.returncode else
                        f"npm ci in {web} did not install {missing[0]}")
    return node_modules


def site_models(manifest: dict, onnx_dir: Path, precisions: tuple[str, ...], models: Path, runtimes: dict) -> dict:
    """Copies the files of the precisions asked for and the tokenizer; writes the manifest of exactly those, and
    of the site's WebAssembly runtimes (site path -> bytes and sha256)."""
    # q4 (export/nbits.py) comes with fp32: its files are fp32's but the base's, rebuilt from the same blocks
    q4 = (Q4,) if "fp32" in precisions and Q4 in manifest["precisions"] else ()
    kept = {p: manifest["precisions"][p] for p in (*precisions, *q4)}
    files = {f for p in kept.values() for g in p["graphs"].values() for f in graph_files(g)} | {manifest["tokenizer"]}
    files |= set((manifest.get("adapters") or {}).get("by_task", {}).values())  # the features' adapters
    # a weights file with a packed form: the site holds that (the page rebuilds the file from it)
    files |= {manifest["files"][f]["packed"]["file"] for f in files if "packed" in manifest["files"][f]}
    for name in sorted(files):
        if "packed" not in manifest["files"][name]:
            shutil.copyfile(onnx_dir / name, models / name)
    site_manifest = {**manifest, "precisions": kept, "files": {f: manifest["files"][f] for f in sorted(files)},
                     "runtimes": runtimes}
    (models / MANIFEST).write_text(json.dumps(site_manifest, indent=2) + "\n")
    return site_manifest


def render(out: Path, manifest: dict) -> None:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(WEB / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    examples = json.loads((WEB / "examples.json").read_text(encoding="utf-8"))["examples"]
    tasks = list(manifest["tasks"])  # the tasks this model offers, each with its examples
    # the modes this export runs, the draft source's first (the page's default): mtp, ar, drafter
    modes = sorted(manifest["modes"], key=lambda m: (m != manifest["defaults"]["mode"], m != "ar"))
    context = {"examples": {t: examples.get(t, []) for t in tasks}, "tasks": tasks, "k_max": manifest["head"]["k"], "modes": modes,
               "mode_labels": manifest["mode_labels"], "mode_roles": manifest["mode_roles"],
               "context_length": manifest["context_length"], "n_layers": manifest["kv"]["layers"], "defaults": manifest["defaults"],
               "lookup_span": manifest["lookup_span"]}
    for template in sorted((WEB / "templates").glob("[!_]*.html")):
        (out / template.name).write_text(env.get_template(template.name).render(**context), encoding="utf-8")
    for static in sorted((WEB / "src").iterdir()):
        shutil.copyfile(static, out / static.name)


def site_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
