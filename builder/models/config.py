"""A checkpoint's config.json, read without torch (data/tasks.py reads a tokenizer's special ids from it)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError


def load_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    if not path.is_file():
        raise CheckpointError(f"missing {path}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config
