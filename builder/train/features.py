"""tau on everyday text, feature by feature: each feature decoded by its production model (the frozen base
plus the feature's adapter, models/adapters/TASK; continue: the base alone), drafted by the MTP head alone
and by the independent drafter (no prompt lookup), on the feature's held-out set (the eval split that no
adapter and no head saw: everyday.held_out; continue goes on with the held-out reply set's messages).
PyTorch on the CPU; every output is checked against the production model's plain greedy decoding.

    python -m builder.train.features [--prompts 20] [--tokens 32] --out docs/bench/features.json
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from ..data.everyday import held_out_texts
from ..data.tasks import load_tokenizer
from ..decode.drafter import load_drafter, torch_drafter
from ..models.adapter import load_adapter
from ..models.head import base_fingerprint, load_head
from ..models.llama import load_llama
from .distill import measure_acceptance

TASKS = ("proofread", "summarize", "reply", "continue")


def feature_prompts(task: str, n: int) -> list[dict]:
    """The feature's held-out texts as prompts (continue: the held-out messages, gone on with)."""
    return [{"task": task, "prompt": text} for text in held_out_texts(task, n)]


def features_tau(base_dir: Path, head_dir: Path, drafter_dir: Path | None, adapters: Path, n: int, tokens: int,
                 ks=range(1, 7)) -> dict:
    tok = load_tokenizer(base_dir)
    out = {"prompts": n, "new_tokens": tokens, "lookup": False, "features": {}}
    for task in TASKS:
        model = load_llama(base_dir).eval()
        fingerprint = base_fingerprint(model)
        adapter = adapters / task
        production = "base"
        if (adapter / "adapter_config.json").is_file():
            load_adapter(model, adapter, fingerprint)
            production = f"base + {adapter}"
        prompts = feature_prompts(task, n)
        t0 = time.time()
        row = {"production_model": production,
               "head": measure_acceptance(model, tok, prompts, ks, max_new_tokens=tokens, head=load_head(head_dir, model))}
        if drafter_dir is not None:
            row["drafter"] = measure_acceptance(model, tok, prompts, ks, max_new_tokens=tokens,
                                                drafter=torch_drafter(load_drafter(drafter_dir, model)))
        row["minutes"] = round((time.time() - t0) / 60, 1)
        out["features"][task] = row
        logging.getLogger(__name__).info("%s: head tau at k=4 %.2f", task, row["head"][f"{task}/k=4"]["tau"])
    return out


def table(result: dict) -> str:
    """Markdown: per feature and source, tau at k = 1..6 (and mismatches, which must be 0)."""
    lines = ["| feature | production model | drafts | " + " | ".join(f"k={k}" for k in range(1, 7)) + " | mismatches |",
             "| --- | --- | --- | " + " | ".join("---" for _ in range(6)) + " | --- |"]
    for task, row in result["features"].items():
        for source in ("head", "drafter"):
            if source in row:
                cells = [row[source].get(f"{task}/k={k}", {}).get("tau") for k in range(1, 7)]
                bad = sum(r["mismatches"] for r in row[source].values())
                lines.append(f"| {task} | {row['production_model']} | {source} | "
                             + " | ".join(f"{c:.2f}" if c is not None else "" for c in cells) + f" | {bad} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="models/base")
    p.add_argument("--head", default="models/mtp")
    p.add_argument("--drafter", default="models/drafter", help="or 'none'")
    p.add_argument("--adapters", default="models/adapters")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default="docs/bench/features.json")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = features_tau(Path(a.base), Path(a.head), None if a.drafter == "none" else Path(a.drafter),
                          Path(a.adapters), a.prompts, a.tokens)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    Path(a.out).with_suffix(".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
