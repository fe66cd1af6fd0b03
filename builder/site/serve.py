"""`serve`: a built site on 127.0.0.1, as a static host serves it.

MIME types the page needs (`.mjs` as JavaScript, `.wasm` as application/wasm); gzip where it pays and the
browser accepts it, as static hosts do (onnxruntime's WebAssembly runtime goes over the wire as a quarter
of its bytes; the weights files, float data a few per cent smaller at best, go as they are), made ahead at
start and once per version of a file, with Last-Modified and 304; the COOP/COEP headers that make the
page cross-origin isolated (WASM threads). No directory listings (a folder without index.html is 404),
`X-Content-Type-Options: nosniff` (a file is only ever what its MIME type says), no server version.
"""
from __future__ import annotations

import email.utils
import gzip
import http.server
import io
import sys
import threading
from functools import lru_cache, partial
from pathlib import Path

from ..contract import MANIFEST
from ..errors import SiteError

MIME = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
        ".json": "application/json", ".onnx": "application/octet-stream", ".data": "application/octet-stream", ".css": "text/css",
        ".html": "text/html", ".png": "image/png", ".svg": "image/svg+xml"}
COMPRESSED = {".wasm", ".mjs", ".js", ".json", ".onnx", ".html", ".css", ".svg"}  # not .data, .png: they barely shrink


@lru_cache(maxsize=64)
def gzipped(path: str, mtime_ns: int, size: int) -> bytes:
    """A file's gzip encoding, made once per version of the file (its mtime and size are the key)."""
    return gzip.compress(Path(path).read_bytes(), compresslevel=6, mtime=0)


class Handler(http.server.SimpleHTTPRequestHandler):
    """Static files with the MIME types the page needs, gzip-encoded where that pays, quietly."""

    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, **MIME}

    def send_header(self, keyword, value):
        if keyword.lower() != "server":  # no Server header: the software and its version are nobody's business
            super().send_header(keyword, value)

    def log_message(self, format, *args):
        pass

    def list_directory(self, path):
        self.send_error(404, "Not Found")
        return None

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
        self.send_header("X-Content-Type-Options", "nosniff")
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
