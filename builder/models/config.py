"""A checkpoint's config.json, read without torch (data/tasks.py reads a tokenizer's special ids from it)."""
from __future__ import annotations

from pathlib import Path

from ..contract import read_json
from ..errors import CheckpointError


def load_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    return read_json(path)
