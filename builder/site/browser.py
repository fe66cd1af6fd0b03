"""Headless Chromium for the benchmark and the browser tests: Debian's chromium driven by Playwright.

DESIGN.md: Playwright's own browser download does not work on these machines; Debian's `chromium`
offers WebGPU (SwiftShader) in headless mode with --enable-unsafe-webgpu, on http://127.0.0.1 only.
"""
from __future__ import annotations

import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

from ..errors import BrowserError
from .serve import make_server

CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--enable-unsafe-webgpu"]


def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise BrowserError("chromium is not installed (Debian: apt-get install chromium; elsewhere "
                           "`playwright install chromium` and put it on PATH as chromium)")
    return path


@contextmanager
def running(server):
    """A server of 127.0.0.1 (serve.py's Server) on a thread of its own; yields its URL, then stops it."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def served(directory: Path):
    """The built site in directory, served on a free port of 127.0.0.1; yields its URL."""
    with running(make_server(directory, 0)) as url:
        yield url


@contextmanager
def chromium():
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
