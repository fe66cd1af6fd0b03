"""The reference side of the exactness tests, as versioned parity files (llm.c's habit).

contract.md's reference is plain greedy decoding with the PyTorch base. It is decoded once per base, for
the prompts that base's tests use, into `tests/reference/<base fingerprint[:16]>.json`: per prompt its
task, text, prompt ids, and the first `TOKENS` new ids with their top-1/top-2 margins. Two bases have one:
the in-house test model (the validation prompts, `PER_TASK` per task) and SmolLM2, the default
(`SMOLLM2_PROMPTS`: everyday text of every task, which test_gguf.py decodes). Every other mode, backend and
the page are checked against it (`Reference.decoded`); `test_reference.py` checks each file against its
PyTorch base, so it cannot drift from what it stands for.

    python -m tests.reference      # writes both files (after a change of base or of the prompts)
"""
from __future__ import annotations

import json
from pathlib import Path

from builder.decode.loop import Decoded

ROOT = Path(__file__).resolve().parent.parent
DIRECTORY = ROOT / "tests" / "reference"
TOKENS = 48      # new tokens per prompt: the most any exactness test asks for
PER_TASK = 30    # validation prompts per task (conftest.validation_prompts)
INHOUSE, SMOLLM2 = ROOT / "models" / "inhouse" / "base", ROOT / "models" / "base"
# SmolLM2's: everyday text of every task it offers, written for the tests
SMOLLM2_PROMPTS = [
    {"task": "proofread", "prompt": "The functon returns a new dictionery with the same keys."},
    {"task": "summarize", "prompt": "Hi all, the office will be closed on Monday for the public holiday. The support line "
                                    "stays open from 9 to 5, and urgent tickets go to the on-call engineer as usual. "
                                    "Have a good weekend!"},
    {"task": "reply", "prompt": "Can you send me the slides from today's meeting?"},
    {"task": "continue", "prompt": "Give me three tips for writing clear emails."},
    {"task": "continue", "prompt": "What is the capital of France?"},
]


def path_for(fingerprint: str) -> Path:
    return DIRECTORY / f"{fingerprint[:16]}.json"


class Reference:
    """The parity file of one base: the reference decode of a prompt, for any number of new tokens up to TOKENS."""

    def __init__(self, fingerprint: str):
        path = path_for(fingerprint)
        if not path.is_file():
            raise FileNotFoundError(f"no parity file for the base with fingerprint {fingerprint[:16]} ({path}): "
                                    "write it with `python -m tests.reference`")
        data = json.loads(path.read_text())
        assert data["base_fingerprint"] == fingerprint, f"{path} belongs to another base"
        self.path, self.eos = path, data["eos_token_id"]
        self.entries = {tuple(e["prompt_ids"]): e for e in data["prompts"]}

    def decoded(self, prompt_ids: list[int], max_new_tokens: int) -> Decoded:
        """What decode_ar(base, prompt_ids, max_new_tokens) gives, read from the file (its first tokens: greedy
        decoding's first n tokens do not depend on how many come after)."""
        entry = self.entries.get(tuple(prompt_ids))
        if entry is None:
            raise KeyError(f"{self.path} has no reference for this prompt: rewrite it with `python -m tests.reference`")
        if max_new_tokens > TOKENS and entry["stopped"] != "end-of-sequence":
            raise ValueError(f"{self.path} holds {TOKENS} new tokens per prompt, {max_new_tokens} asked")
        ids, margins = entry["ids"][:max_new_tokens], entry["margins"][:max_new_tokens]
        stopped = "end-of-sequence" if ids and ids[-1] == self.eos else "max-new-tokens"
        return Decoded(ids=ids, steps=len(ids), margins=margins, stopped=stopped)


def prompts_for(base_dir: Path) -> list[dict]:
    """The prompts of a base's parity file: SmolLM2's own, or the validation prompts of the tasks it offers."""
    if Path(base_dir).resolve() == SMOLLM2.resolve():
        return SMOLLM2_PROMPTS
    from builder.data.corpus import load_corpus, validation_prompts
    from builder.data.tasks import load_tokenizer

    return validation_prompts(load_corpus(), PER_TASK, tasks=tuple(load_tokenizer(base_dir).tasks))


def write(base_dir: Path) -> Path:
    """Decodes the base's prompts (prompts_for) with the PyTorch base and writes its parity file."""
    from builder.data.tasks import encode_prompt, load_tokenizer
    from builder.decode.torch_backend import decode_ar
    from builder.models.head import base_fingerprint
    from builder.models.llama import load_llama

    base, tok = load_llama(base_dir).eval(), load_tokenizer(base_dir)
    fingerprint, eos = base_fingerprint(base), base.config.eos_token_id
    entries = []
    for p in prompts_for(base_dir):
        ids = encode_prompt(tok, p["task"], p["prompt"])
        n = min(TOKENS, base.config.max_position_embeddings - len(ids))
        out = decode_ar(base, ids, n, eos)
        entries.append({"task": p["task"], "prompt": p["prompt"], "prompt_ids": ids, "ids": out.ids,
                        "margins": [round(m, 6) for m in out.margins], "stopped": out.stopped})
    path = path_for(fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"base": str(Path(base_dir).resolve().relative_to(ROOT)), "base_fingerprint": fingerprint,
                                "eos_token_id": eos, "tokens": TOKENS, "prompts": entries}, ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    for base_dir in (INHOUSE, SMOLLM2):
        print(f"wrote {write(base_dir)}")
