"""Tokens decided per base pass (tau) of the shipped draft sources, with and without prompt lookup, on held-back
prompts: decode itself (builder/decode/loop.py, torch), every output checked against plain greedy decoding.

Sources: the head alone, prompt lookup first and the head elsewhere (what `generate` and the page do by
default), and the same two for the drafter. The prompts are the held-back prompts of the head's card
(corpus.validation_prompts over the installed Debian documentation); their sha256 is printed, because another
version of that documentation gives other prompts. `--chat-messages N` measures reply on N real short messages
instead (the first N of data/messages.py's 48 held back): the corpus's reply prompts are documentation sentences,
which the base often repeats back. docs/results.md reports it. Run from the repository root:

    python bench/heads/tau.py [--prompts 12] [--k 4] [--new-tokens 48] [--drafter] [--lookup both|yes|no]
                              [--chat-messages 48]
"""
import argparse

import torch

from builder.data.corpus import HEAD_SOURCES, load_corpus, prompts_digest, validation_prompts
from builder.data.messages import HELD_BACK, held_back
from builder.data.tasks import load_tokenizer
from builder.decode.drafter import load_drafter, torch_drafter
from builder.decode.loop import LOOKUP_SPAN
from builder.models.head import load_head
from builder.models.llama import load_llama
from builder.train.distill import measure_acceptance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--head", default="models/mtp")
    ap.add_argument("--drafter", action="store_true", help="also the drafter in models/drafter")
    ap.add_argument("--prompts", type=int, default=12, help="held-back prompts per task (the card's 12)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", default="4", help="comma-separated")
    ap.add_argument("--lookup", choices=("both", "yes", "no"), default="both", help="with prompt lookup first, without, or both")
    ap.add_argument("--chat-messages", type=int, choices=range(1, HELD_BACK + 1), metavar=f"1..{HELD_BACK}",
                    help="instead: reply on this many held-back chatterbot-corpus messages")
    args = ap.parse_args()
    base, tok = load_llama(args.base), load_tokenizer(args.base)
    if args.chat_messages:
        prompts = [{"task": "reply", "prompt": m} for m in held_back(args.chat_messages)]
        what = f"{args.chat_messages} held-back chatterbot-corpus messages (reply)"
    else:
        prompts = validation_prompts(load_corpus(HEAD_SOURCES), args.prompts, tasks=tuple(tok.tasks))
        what = f"{args.prompts} prompts a task"
    print(f"{what}, {args.new_tokens} new tokens; prompts sha256 {prompts_digest(prompts)}; "
          f"prompt lookup drafts up to {LOOKUP_SPAN} x k")
    ks = [int(k) for k in args.k.split(",")]
    sources = {"head": {"head": load_head(args.head, base).float().eval()}}
    if args.drafter:
        sources["drafter"] = {"drafter": torch_drafter(load_drafter("models/drafter", base))}
    print("| task | source | prompt lookup first | " + " | ".join(f"k={k}" for k in ks) + " | mismatches |")
    print("| --- " * (4 + len(ks)) + "|")
    for name, source in sources.items():
        for lookup in {"both": (False, True), "yes": (True,), "no": (False,)}[args.lookup]:
            with torch.no_grad():
                table = measure_acceptance(base, tok, prompts, ks, args.new_tokens, lookup=lookup, **source)
            for task in [t for t in tok.tasks if any(p["task"] == t for p in prompts)]:
                rows = [table[f"{task}/k={k}"] for k in ks]
                print(f"| {task} | {name} | {'yes' if lookup else 'no'} | " + " | ".join(f"{r['tau']:.2f}" for r in rows)
                      + f" | {sum(r['mismatches'] for r in rows)} |", flush=True)


if __name__ == "__main__":
    main()
