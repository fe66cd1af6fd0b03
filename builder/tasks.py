"""The two tasks and their one prompt format, shared by training, Python decoding and the site.

A prompt is the task's marker token, the user's text, then the task's separator (if any):

    continue:   <|continue|>{text}                 the model continues the text
    proofread:  <|proofread|>{text}<|fix|>         the model writes the corrected sentence, then <|endoftext|>

Special tokens are encoded by id, never parsed out of the user's text, so a user who types
"<|fix|>" gets those characters, not the marker. Text is encoded as the code points it holds (control
characters, right-to-left marks and all); a lone surrogate (half of a UTF-16 pair, which no UTF-8 text
can hold: it comes from broken JSON escapes or undecodable command-line bytes) is replaced by U+FFFD,
as the page does with String.prototype.toWellFormed.
"""
from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Tokenizer

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|continue|>", "<|proofread|>", "<|fix|>"]

# task -> (marker before the text, separator after it)
TASKS: dict[str, tuple[str, str | None]] = {
    "continue": ("<|continue|>", None),
    "proofread": ("<|proofread|>", "<|fix|>"),
}


class PromptError(ValueError):
    """The user's prompt cannot be decoded (empty, unknown task, too long)."""


def load_tokenizer(directory: str | Path) -> Tokenizer:
    from .model import CheckpointError

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"missing {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{path} is not a valid tokenizer.json: {e}") from None
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise CheckpointError(f"{path} lacks the special tokens {missing}")
    tok.encode_special_tokens = True  # "<|fix|>" typed by a user is text, not the marker
    return tok


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def well_formed(text: str) -> str:
    """text with every lone surrogate replaced by U+FFFD (a Python str holds pairs as one code point)."""
    return LONE_SURROGATE.sub("\ufffd", text)


def encode_text(tok: Tokenizer, text: str) -> list[int]:
    """The ids of plain text: no special tokens are recognised in it."""
    return tok.encode(well_formed(text), add_special_tokens=False).ids if text else []


def encode_prompt(tok: Tokenizer, task: str, text: str) -> list[int]:
    if task not in TASKS:
        raise PromptError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    if not text.strip():
        raise PromptError("the prompt is empty")
    marker, sep = TASKS[task]
    ids = [tok.token_to_id(marker)] + encode_text(tok, text)
    return ids + [tok.token_to_id(sep)] if sep else ids


def decode(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)
