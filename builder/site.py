"""`build` and `serve`: the static site, rendered from web/ into one self-contained folder.

build() reads as the recipe:
1. export the checkpoints to ONNX (reused when build/onnx already is their export);
2. install the browser libraries with `npm ci` from web/package-lock.json when they are missing;
3. render web/templates with jinja2, copy the page's ES modules and stylesheet;
4. copy the graphs and weights files of the precisions asked for, the tokenizer, and a manifest that
   lists exactly those files;
5. copy only the onnxruntime-web and tokenizer library files the page loads (and their licences).

Every path in the site is relative, so the folder works on any static host.

`serve` compresses what compresses as static hosts do (gzip, when the browser accepts it): onnxruntime's
WebAssembly runtime goes over the wire as 6.7 MB instead of 26.8; the weights files (float data, a few
per cent smaller at best) go as they are.
"""
from __future__ import annotations

import email.utils
import gzip
import http.server
import io
import json
import shutil
import subprocess
import sys
import threading
from functools import lru_cache, partial
from pathlib import Path

import jinja2

from .export import MANIFEST, PRECISIONS, Checkpoints, ensure_export, graph_files

WEB = Path(__file__).resolve().parent.parent / "web"
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
MIME = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
        ".json": "application/json", ".onnx": "application/octet-stream", ".data": "application/octet-stream", ".css": "text/css",
        ".html": "text/html", ".png": "image/png", ".svg": "image/svg+xml"}


class SiteError(RuntimeError):
    """The site cannot be built or served (npm missing, web/ incomplete, port taken)."""


def build(ckpts: Checkpoints, out: Path, onnx_dir: Path, precisions: tuple[str, ...] = tuple(PRECISIONS),
          note=print) -> dict:
    """Builds the static site into out/ (replacing it) with the graphs of ckpts in the given precisions.
    Returns the site's manifest."""
    out = Path(out)
    manifest = ensure_export(ckpts, Path(onnx_dir), precisions, note)  # every file checked against its sha256
    node_modules = npm_ci(WEB, note)

    if out.exists():
        shutil.rmtree(out)
    (out / "models").mkdir(parents=True)
    site_manifest = site_models(manifest, Path(onnx_dir), precisions, out / "models")
    render(out, site_manifest)
    for src, dst in VENDOR.items():
        (out / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(node_modules / src, out / dst)
    note(f"built the site in {out} ({site_bytes(out) / 1e6:.1f} MB)")
    return site_manifest


def npm_ci(web: Path, note) -> Path:
    """web/node_modules, installed from the lock file (`npm ci`) unless every file the site needs is there."""
    node_modules = web / "node_modules"
    if all((node_modules / src).is_file() for src in VENDOR):
        return node_modules
    npm = shutil.which("npm")
    if npm is None:
        raise SiteError("npm is not installed: it installs onnxruntime-web from web/package-lock.json "
                        "(Debian: apt-get install npm)")
    note("installing the browser libraries: npm ci in web/")
    done = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=web,
                          capture_output=True, text=True)
    missing = [src for src in VENDOR if not (node_modules / src).is_file()]
    if done.returncode != 0 or missing:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SiteError(f"npm ci in {web} failed ({last})" if done.returncode else
                        f"npm ci in {web} did not install {missing[0]}")
    return node_modules


def site_models(manifest: dict, onnx_dir: Path, precisions: tuple[str, ...], models: Path) -> dict:
    """Copies the files of the precisions asked for and the tokenizer; writes the manifest of exactly those."""
    kept = {p: manifest["precisions"][p] for p in precisions}
    files = {f for p in kept.values() for g in p["graphs"].values() for f in graph_files(g)} | {manifest["tokenizer"]}
    for name in sorted(files):
        shutil.copyfile(onnx_dir / name, models / name)
    site_manifest = {**manifest, "precisions": kept, "files": {f: manifest["files"][f] for f in sorted(files)}}
    (models / MANIFEST).write_text(json.dumps(site_manifest, indent=2) + "\n")
    return site_manifest


def render(out: Path, manifest: dict) -> None:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(WEB / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    examples = json.loads((WEB / "examples.json").read_text(encoding="utf-8"))["examples"]
    tasks = list(manifest["tasks"])  # the tasks this model offers, each with its examples
    context = {"examples": {t: examples.get(t, []) for t in tasks}, "tasks": tasks, "k_max": manifest["head"]["k"],
               "context_length": manifest["context_length"], "n_layers": manifest["kv"]["layers"], "defaults": manifest["defaults"]}
    for template in sorted((WEB / "templates").glob("[!_]*.html")):
        (out / template.name).write_text(env.get_template(template.name).render(**context), encoding="utf-8")
    for static in sorted((WEB / "src").iterdir()):
        shutil.copyfile(static, out / static.name)


def site_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


COMPRESSED = {".wasm", ".mjs", ".js", ".json", ".onnx", ".html", ".css", ".svg"}  # not .data, .png: they barely shrink


@lru_cache(maxsize=64)
def gzipped(path: str, mtime_ns: int, size: int) -> bytes:
    """A file's gzip encoding, made once per version of the file (its mtime and size are the key)."""
    return gzip.compress(Path(path).read_bytes(), compresslevel=6, mtime=0)


class Handler(http.server.SimpleHTTPRequestHandler):
    """Static files with the MIME types the page needs, gzip-encoded where that pays, quietly."""

    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, **MIME}

    def log_message(self, format, *args):
        pass

    def send_head(self):
        path = Path(self.translate_path(self.path))
        if (path.suffix not in COMPRESSED or not path.is_file()
                or "gzip" not in self.headers.get("Accept-Encoding", "")):
            return super().send_head()
        stat = path.stat()
        since = self.headers.get("If-Modified-Since")
        try:
            unchanged = since is not None and int(stat.st_mtime) <= email.utils.parsedate_to_datetime(since).timestamp()
        except (TypeError, ValueError):
            unchanged = False
        if unchanged:
            self.send_response(304)
            self.end_headers()
            return None
        body = gzipped(str(path), stat.st_mtime_ns, stat.st_size)
        self.send_response(200)
        self.send_header("Content-Type", self.guess_type(str(path)))
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Vary", "Accept-Encoding")
        self.send_header("Last-Modified", self.date_time_string(stat.st_mtime))
        self.end_headers()
        return io.BytesIO(body)

    def end_headers(self):
        self.send_header("Cache-Control", "no-cache")
        # cross-origin isolation: onnxruntime-web's WASM runs on several threads only in an isolated page
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a page closed mid-download is no error
            super().handle_error(request, client_address)


def make_server(directory: Path, port: int = 0) -> Server:
    directory = Path(directory)
    if not (directory / "index.html").is_file() or not (directory / "models" / MANIFEST).is_file():
        raise SiteError(f"{directory} is not a built site (no index.html or models/{MANIFEST}): "
                              "run `python -m builder build` first")
    try:
        server = Server(("127.0.0.1", port), partial(Handler, directory=str(directory.resolve())))
    except OSError as e:
        raise SiteError(f"cannot serve on 127.0.0.1:{port}: {e.strerror}") from None
    threading.Thread(target=compress_ahead, args=(directory.resolve(),), daemon=True).start()  # 27 MB take seconds
    return server


def compress_ahead(directory: Path) -> None:
    """Makes the gzip encodings before a browser asks, as a static host keeps them ready."""
    for path in sorted(directory.rglob("*")):
        if path.suffix in COMPRESSED and path.is_file():
            stat = path.stat()
            gzipped(str(path), stat.st_mtime_ns, stat.st_size)


def serve(directory: Path, port: int) -> None:
    server = make_server(directory, port)
    print(f"serving {directory} at http://127.0.0.1:{server.server_address[1]}/  (Ctrl+C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.stderr.write("stopped\n")
    finally:
        server.server_close()
