"""Shared fixtures (the shipped base model, its tokenizer, validation prompts no training saw, the ONNX
export, the built site in headless Chromium) and the helpers test modules share."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from builder.export.manifest import Checkpoints

ROOT = Path(__file__).resolve().parent.parent
BASE_DIR = ROOT / "models" / "inhouse" / "base"
HEAD_DIR = ROOT / "models" / "inhouse" / "mtp"
DRAFTER_DIR = ROOT / "models" / "inhouse" / "drafter"
SHIPPED = Checkpoints(BASE_DIR, HEAD_DIR, DRAFTER_DIR)
# the in-house 10 M trio, the fast test model, named on the command line: the CLI's defaults are SmolLM2's
INHOUSE = ("--base", str(BASE_DIR), "--head", str(HEAD_DIR), "--drafter", str(DRAFTER_DIR))
CONTEXT = json.loads((BASE_DIR / "config.json").read_text())["max_position_embeddings"]  # the shipped base's window

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # both cores, unless told otherwise


def run(*args, cwd=ROOT, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`python -m builder *args`, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def expect_error(r: subprocess.CompletedProcess, *fragments):
    """The CLI failed as docs/contract.md says: non-zero, one line on stderr holding every fragment, no traceback."""
    assert r.returncode != 0, f"expected failure, got success: {r.stdout}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{r.stderr}"
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"


def check_steps(accepted: list[int], n_ids: int, stopped: str):
    """Each speculative step decides its accepted drafts + 1 tokens: the steps before the last decide fewer
    than all the tokens, and all steps exactly all of them, unless the end token stopped decoding inside the
    last step (then the rest of that step is dropped)."""
    decided = [a + 1 for a in accepted]
    assert sum(decided[:-1]) < n_ids <= sum(decided), f"{n_ids} tokens from steps deciding {decided}"
    if stopped != "end-of-sequence":
        assert sum(decided) == n_ids, f"stopped at {stopped}: {n_ids} tokens from steps deciding {decided}"


@pytest.fixture(autouse=True, scope="session")
def distill_cache(tmp_path_factory):
    """Head and drafter training in tests keep the base's continuations in a temporary folder, not build/."""
    import builder.train.distill

    builder.train.distill.DISTILL_CACHE = tmp_path_factory.mktemp("distill")


@pytest.fixture(scope="session")
def base():
    from builder.models.llama import load_llama

    return load_llama(BASE_DIR)


@pytest.fixture(scope="session")
def reference(base):
    """The shipped base's parity file (tests/reference.py): the reference ids of the validation prompts."""
    from builder.models.head import base_fingerprint
    from tests.reference import Reference

    return Reference(base_fingerprint(base))


@pytest.fixture(scope="session")
def tokenizer():
    from builder.data.tasks import load_tokenizer

    return load_tokenizer(BASE_DIR)


@pytest.fixture(scope="session")
def corpus():
    from builder.data.corpus import load_corpus

    return load_corpus()


@pytest.fixture(scope="session")
def validation_prompts(corpus, tokenizer):
    """30 per task the shipped base offers: continue [0:30], proofread [30:60], summarize [60:]."""
    from builder.data.corpus import validation_prompts

    return validation_prompts(corpus, 30, tasks=tuple(tokenizer.tasks))


@pytest.fixture(scope="session")
def onnx_dir(tmp_path_factory):
    """The shipped base, head and drafter exported to ONNX once for the session (ONNX and site tests)."""
    from builder.export.manifest import export

    out = tmp_path_factory.mktemp("onnx")
    export(SHIPPED, out)
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Checkpoints:
    """A tiny random base with the shipped tokenizer (2 layers x 64, the shipped context window), a random
    head and a random drafter for it: the page's mechanics (zero-copy, faults, long sessions on WebGPU) in
    seconds of SwiftShader, where the shipped 24-layer base takes about a second a pass. Its weights are
    scaled up so that its greedy text varies and its top two logits stay far apart (margins of 0.2 and
    more, against float differences of 1e-4 between backends): its output is checked against the torch
    reference like the shipped model's."""
    from builder.models.llama import Llama, LlamaConfig, load_config, save_llama
    from builder.models.head import HeadConfig, MTPHead, base_fingerprint, save_head

    root = tmp_path_factory.mktemp("tiny")
    shipped = load_config(BASE_DIR)
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=shipped["vocab_size"], max_position_embeddings=shipped["max_position_embeddings"],
                 eos_token_id=shipped["eos_token_id"], tie_word_embeddings=True)
    for name, layers in (("base", 2), ("drafter", 1)):
        model = Llama(LlamaConfig(num_hidden_layers=layers, **small))
        model.init_weights(seed=layers)
        with torch.no_grad():  # embeddings of unit scale, layers strong enough to change the next token
            for weight_name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.mul_(50 if "embed" in weight_name else 12)
        save_llama(model, root / name)
        shutil.copyfile(BASE_DIR / "tokenizer.json", root / name / "tokenizer.json")
        if name == "base":
            base = model
    head = MTPHead(HeadConfig.for_base(base.config, k_train=6))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    head.config.base_fingerprint = base_fingerprint(base)
    save_head(head, root / "mtp")
    return Checkpoints(root / "base", root / "mtp", root / "drafter")


@pytest.fixture(scope="session")
def tiny_onnx(tiny, tmp_path_factory):
    """The tiny models exported to ONNX in every precision, once for the session."""
    from builder.export.manifest import export

    out = tmp_path_factory.mktemp("tiny-onnx")
    export(tiny, out)
    return out


@pytest.fixture(scope="session")
def tiny_site(tiny, tiny_onnx, tmp_path_factory):
    from builder.site.build import build

    out = tmp_path_factory.mktemp("tiny-site")
    build(tiny, out, tiny_onnx)  # the export is reused: every file checked against its manifest
    return out


@pytest.fixture(scope="session")
def tiny_url(tiny_site):
    from builder.site.browser import served

    with served(tiny_site) as address:
        yield address


@pytest.fixture(scope="session")
def tiny_base(tiny):
    from builder.models.llama import load_llama

    return load_llama(tiny.base)


# ---------------------------------------------------------------- the built site in headless Chromium

@pytest.fixture(scope="session")
def site(onnx_dir, tmp_path_factory):
    from builder.site.build import build

    out = tmp_path_factory.mktemp("site")
    build(SHIPPED, out, onnx_dir)
    return out


@pytest.fixture(scope="session")
def url(site):
    from builder.site.browser import served

    with served(site) as address:
        yield address


@pytest.fixture(scope="session")
def browser():
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium is not installed (bash .ci/setup installs it): the browser tests cannot run")
    from playwright.sync_api import sync_playwright

    from builder.site.browser import CHROMIUM_ARGS

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A page of the site with its console errors, uncaught errors and requests recorded."""

    def __init__(self, browser, url: str, query: str = "", viewport=None, init_script: str | None = None):
        self.context = browser.new_context(viewport=viewport or {"width": 1000, "height": 900})
        self.page = self.context.new_page()
        self.errors, self.requests = [], []
        if init_script:
            self.page.add_init_script(init_script)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and "onnxruntime" not in m.text and self.errors.append(m.text))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.url = url
        self.page.goto(url + query)
        self.info = self.page.evaluate("window.frozenMTP.ready")

    def generate(self, **options):
        return self.page.evaluate("(o) => window.frozenMTP.generate(o)", options)

    def foreign_requests(self) -> list[str]:
        """Every request the page made that is not to the site's own origin."""
        origin = urlsplit(self.url)[:2]
        return [r for r in self.requests if urlsplit(r)[:2] != origin]

    def close(self):
        self.context.close()


# Fixtures that cost more than half a minute to set up on the 2-core machine: every test that needs one is slow.
SLOW_FIXTURES = {"onnx_dir": "the in-house models' ONNX export, about 90 s",
                 "tiny_onnx": "the tiny models exported in every precision, about 45 s",
                 "adapted_export": "the tiny base exported with three adapters (test_adapter.py), about 45 s"}


def pytest_collection_modifyitems(items):
    """Every test that drives the browser carries the `browser` marker, and every test that needs a fixture
    of SLOW_FIXTURES the `slow` marker (pyproject.toml): the quick run (-m "not slow and not browser") stays
    under 3 minutes."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "browser" in names:
            item.add_marker(pytest.mark.browser)
        if names & SLOW_FIXTURES.keys():
            item.add_marker(pytest.mark.slow)
