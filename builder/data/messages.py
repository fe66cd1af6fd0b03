"""Real short messages for the `reply` task: the English dialogs of the chatterbot-corpus package (PyPI, BSD-3).

The documentation corpus's reply prompts are paragraphs, which the base often starts its answer by repeating;
people send short messages. `messages()`: every turn of a dialog that gets an answer, each once, in file
order. The held-back ones (`held_back`): every len // HELD_BACK-th of those with 4 words or more, the prompts
`bench/heads/tau.py --chat-messages` and the head's card measure reply on; the rest are training prompts
(`train-head --chat-messages N`).
"""
from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from ..errors import CheckpointError

HELD_BACK = 48


@lru_cache(maxsize=1)
def messages() -> tuple[str, ...]:
    """Every distinct message that gets an answer in the package's English dialogs, in file order."""
    try:
        import yaml
        english = files("chatterbot_corpus") / "data" / "english"
    except ModuleNotFoundError as e:
        raise CheckpointError(f"real messages come from the chatterbot-corpus package, and {e.name} is missing: "
                              "bash .ci/setup, or pip install chatterbot-corpus pyyaml (dependencies in pyproject.toml)") from e
    out: dict[str, None] = {}
    for f in sorted((f for f in english.iterdir() if f.name.endswith(".yml")), key=lambda f: f.name):
        for turns in yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations", []):
            for m in turns[:-1]:  # a turn that gets an answer
                if isinstance(m, str) and m.strip():
                    out.setdefault(m.strip())
    return tuple(out)


def held_back(n: int = HELD_BACK) -> list[str]:
    """The first n (at most HELD_BACK) held-back messages: of the messages of 4 words or more, every len // HELD_BACK-th."""
    long = [m for m in messages() if len(m.split()) >= 4]
    return long[::max(1, len(long) // HELD_BACK)][:HELD_BACK][:n]


def training_messages() -> list[str]:
    """Every message that is not held back, in file order."""
    kept = set(held_back())
    return [m for m in messages() if m not in kept]
