"""The page's draft cut (builder/decode/loop.py's DRAFT_CUT): how sure the head must be of a draft for the base to
verify it, chosen on prompts the head's card does not measure, then checked on the card's.

A step verifies the drafts before the running product of the head's probabilities for them falls below the cut.
Each further draft verified costs the base one more token in its pass: on WASM a fifth of a one-token pass, on native
onnxruntime a few percent (docs/web.md). This decodes with torch (loop.py's decode: k = 4, prompt lookup first, as the
page) at each cut, checks every output against the cut-free one, and prices the steps with the bench's profile of a
runtime (docs/bench/bench.json: a base pass over T tokens against one token, the head's graph of k): the figure is
MTP/plain after the prefill as that profile predicts it (the bench's "from the runs" column), not a timing. It
prints the cut that maximizes the geometric mean over the tasks. Run from the repository root:

    python bench/heads/draft_cut.py [--set tune|card] [--cuts 0,0.05,0.1] [--runtime browser-wasm,...]

--set tune (default): up to 20 validation prompts a task drawn with another seed, less the card's; card: the card's
12 a task and the 48 held-back real messages (reply).
"""
import argparse
import json
import math

import torch

from builder.bench.report import base_ms
from builder.data.corpus import HEAD_SOURCES, load_corpus, prompts_digest, validation_prompts
from builder.data.messages import HELD_BACK, held_back
from builder.data.tasks import encode_prompt, load_tokenizer
from builder.decode.loop import decode
from builder.decode.torch_backend import TorchBackend
from builder.models.head import load_head
from builder.models.llama import load_llama

K, NEW_TOKENS = 4, 48


def prompt_set(which: str, tasks: tuple) -> list[dict]:
    corpus = load_corpus(HEAD_SOURCES)
    card = validation_prompts(corpus, 12, tasks=tasks)
    if which == "card":
        return card + [{"task": "messages", "prompt": m} for m in held_back(HELD_BACK)]
    seen = {p["prompt"] for p in card}
    return [p for p in validation_prompts(corpus, 20, seed=2, tasks=tasks) if p["prompt"] not in seen]


def step_costs(profile: dict) -> tuple[list[float], float]:
    """A base pass over T tokens against one token, T = 0..9 (the profile's, between its lengths by straight line:
    report.py's base_ms; made non-decreasing, as a longer pass never costs less: a length measured a few times
    may read high), and the head's graph of K."""
    ms = {name: v["median_ms"] for name, v in profile.items()}
    cost = [0.0] + [base_ms(ms, t) / ms["base T=1"] for t in range(1, 2 * K + 2)]  # a lookup step: up to 2k + 1
    for t in range(len(cost) - 2, 0, -1):
        cost[t] = min(cost[t], cost[t + 1])
    return cost, ms[f"head k={K}"] / ms["base T=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("tune", "card"), default="tune")
    ap.add_argument("--cuts", default="0,0.03,0.05,0.075,0.1,0.125,0.15,0.2")
    ap.add_argument("--runtime", default="browser-wasm,browser-wasm-1thread,onnx-cpu", help="profiles of docs/bench/bench.json")
    args = ap.parse_args()
    base, tok = load_llama("models/base"), load_tokenizer("models/base")
    head = load_head("models/mtp", base).float().eval()
    prompts = prompt_set(args.set, tuple(tok.tasks))
    print(f"{args.set}: {len(prompts)} prompts, sha256 {prompts_digest(prompts)}; k = {K}, prompt lookup first, "
          f"{NEW_TOKENS} new tokens")
    cuts = [float(c) for c in args.cuts.split(",")]
    tasks = sorted({p["task"] for p in prompts})
    runs = {}  # (task, cut) -> decodes
    reference = {}
    with torch.no_grad():
        for cut in cuts:
            for i, p in enumerate(prompts):
                ids = encode_prompt(tok, "reply" if p["task"] == "messages" else p["task"], p["prompt"])
                if len(ids) > base.config.max_position_embeddings - NEW_TOKENS:
                    continue
                out = decode(TorchBackend(base, head=head), ids, NEW_TOKENS, base.config.eos_token_id, K, lookup=True,
                             draft_cut=cut)
                assert reference.setdefault(i, out.ids) == out.ids, f"prompt {i}: the cut changed the output"
                runs.setdefault((p["task"], cut), []).append(out)
    profiles = json.load(open("docs/bench/bench.json"))["profile"]
    for runtime in args.runtime.split(","):
        cost, head_cost = step_costs(profiles[runtime])
        print(f"\n{runtime}: a base pass over 2..5 tokens {', '.join(f'{cost[t]:.2f}' for t in range(2, 6))}x one token; "
              f"the head's k = {K} {head_cost:.2f}x\n")
        print("| task | " + " | ".join(f"cut {c:g}" for c in cuts) + " |")
        print("| --- " * (len(cuts) + 1) + "|")
        means = {c: [] for c in cuts}
        for task in tasks:
            cells = []
            for cut in cuts:
                outs = runs[(task, cut)]
                tokens = sum(len(o.ids) for o in outs)
                steps = sum(len(o.verified) for o in outs)
                spent = sum(cost[v] + (0.0 if looked else head_cost) for o in outs
                            for v, looked in zip(o.verified, o.lookups))
                ratio = tokens / spent
                means[cut].append(ratio)
                cells.append(f"{ratio:.2f}x (tau {tokens / steps:.2f}, {sum(sum(o.verified) for o in outs) / steps:.2f} fed)")
            print(f"| {task} | " + " | ".join(cells) + " |")
        geo = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in means.items()}
        print("| geometric mean | " + " | ".join(f"{geo[c]:.3f}x" for c in cuts) + " |")
        best = max(cuts, key=geo.get)
        print(f"\n{runtime}: best cut {best:g} ({geo[best] / geo[cuts[0]]:.3f} of cut {cuts[0]:g})")


if __name__ == "__main__":
    main()
