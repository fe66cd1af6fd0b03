"""Shared fixtures: the shipped base model, its tokenizer and validation prompts no training saw."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BASE_DIR = ROOT / "models" / "base"
HEAD_DIR = ROOT / "models" / "mtp"
DRAFTER_DIR = ROOT / "models" / "drafter"

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def base():
    from builder.model import load_llama

    return load_llama(BASE_DIR)


@pytest.fixture(scope="session")
def tokenizer():
    from builder.tasks import load_tokenizer

    return load_tokenizer(BASE_DIR)


@pytest.fixture(scope="session")
def corpus():
    from builder.corpus import load_corpus

    return load_corpus()


@pytest.fixture(scope="session")
def validation_prompts(corpus):
    from builder.corpus import validation_prompts

    return validation_prompts(corpus, 30)


@pytest.fixture(scope="session")
def onnx_dir(tmp_path_factory):
    """The shipped base, head and drafter exported to ONNX once for the session (ONNX and site tests)."""
    from builder.export import export

    out = tmp_path_factory.mktemp("onnx")
    export(BASE_DIR, HEAD_DIR, out, drafter_dir=DRAFTER_DIR)
    return out
