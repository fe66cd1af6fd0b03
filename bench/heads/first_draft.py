"""Why one task drafts less than another, and what prompt lookup would add: the head's drafts on the held-back
prompts of its card (12 a task, 48 new tokens), teacher-forced on the base's own greedy answers.

1. The first draft at anchor t (the head's guess at token t + 2 from the base's hidden state at t and token
   t + 1, as in decoding), split by how sure the base is of the token it wrote (the probability of its
   greedy choice) and by whether that token occurs in the prompt; beside it, prompt lookup's guess there.
2. Tokens decided per base pass at k, decoding emulated step by step on the same answers (k drafts, the
   longest matching prefix accepted, one token more; the head drafts at the first step only where the
   prompt's last token is the base's own choice, as the loop does), for the head's chain, for prompt
   lookup alone, for lookup first and the head elsewhere (what `decode` does by default), and for the
   better of the two at each step (a bound on any rule choosing between them).

Prompt lookup is the loop's own (builder/decode/loop.py's `prompt_lookup`: the tokens that followed the
latest earlier occurrence of the text's last three tokens, up to LOOKUP_SPAN x k). The head's chain is
teacher-forced: its j-th draft reads the true token j, which equals its own draft wherever acceptance
still counts. Features come from left-padded batches: equal to decoding's up to float rounding.
docs/results.md reports it. Run from the repository root:

    python bench/heads/first_draft.py [--head models/mtp] [--base models/base] [--k 4]
"""
import argparse

import torch
import torch.nn.functional as F

from builder.data.corpus import HEAD_SOURCES, load_corpus, validation_prompts
from builder.data.tasks import encode_prompt, load_tokenizer
from builder.decode.loop import LOOKUP_SPAN, prompt_lookup
from builder.models.head import load_head
from builder.models.llama import load_llama
from builder.train.distill import greedy_continuations

BINS = ((0.0, 0.5), (0.5, 0.8), (0.8, 1.01))


@torch.no_grad()
def answers(base, head, items: list[list[int]], new_tokens: int, k: int) -> list[dict]:
    """The base's greedy answer to every prompt; per anchor (prompt length - 2 .. the answer's last but
    one position) the head's chain of k drafts; per new token after the first, the base's probability of it;
    and whether the prompt's last token is the base's own choice (the first step can draft)."""
    data, feats = greedy_continuations(base, items, new_tokens, base.config.eos_token_id,
                                       kv_layer=head.config.kv_layer)
    out = []
    for (plen, seq), (hidden, keys, values) in zip(data, feats):
        n = len(seq)
        hidden, keys, values = (t[None].float() for t in (hidden, keys, values))
        anchors = torch.arange(plen - 2, n - 1)                  # anchor a: the token a + 1 is known
        mask = torch.arange(n)[None] <= anchors[:, None]
        ids = torch.tensor(seq)
        h, chains, drafts = hidden[:, anchors], head.new_chains(), []
        for j in range(1, k + 1):
            pos = anchors + j
            h = head.step(h, base.model.embed_tokens(ids[pos.clamp(max=n - 1)])[None], pos, keys, values, mask, chains)
            drafts.append(head.token_ids(head.draft_logits(base, h).argmax(-1))[0])
        probs = F.softmax(base.lm_head(hidden[0]).float(), -1)  # position t: the base's distribution of t + 1
        sure = [float(probs[t - 1, seq[t]]) for t in range(plen + 1, n)]
        out.append({"plen": plen, "seq": seq, "chains": torch.stack(drafts, 1).tolist(), "sure": sure,
                    "first": int(probs[plen - 2].argmax()) == seq[plen - 1]})
    return out


def first_draft_rows(ans: list[dict]) -> list[tuple[float, bool, bool, bool | None]]:
    """Per new token after an answer's first: (the base's probability of it, whether the head's first draft
    was it, whether it occurs in the prompt, whether prompt lookup's was (None: no draft))."""
    rows = []
    for a in ans:
        plen, seq, prompt = a["plen"], a["seq"], set(a["seq"][:a["plen"]])
        for r, t in enumerate(range(plen + 1, len(seq))):        # anchor t - 2 = plen - 2 + (r + 1)
            found = prompt_lookup(seq[:t], 1)
            rows.append((a["sure"][r], a["chains"][r + 1][0] == seq[t], seq[t] in prompt,
                         found[0] == seq[t] if found else None))
    return rows


def emulated_tau(ans: list[dict], k: int, source: str, limit: int) -> float:
    """tau of decoding each answer with the draft source: "head", "lookup" (prompt lookup alone),
    "lookup-else-head" (lookup's drafts where it has any, else the head's chain: `decode`'s default) or
    "better" (the one of the two that is accepted further: the bound of any rule choosing between them)."""
    taus = []
    for a in ans:
        plen, seq = a["plen"], a["seq"]
        new, g = len(seq) - plen, 0                             # g new tokens decided
        while g < new:
            left = limit - g - 1                                # anchor plen - 2 + g; token plen - 1 + g known
            span = prompt_lookup(seq[:plen + g], min(LOOKUP_SPAN * k, left)) if min(k, left) > 0 else []
            chain = a["chains"][g][:min(k, left)] if g or a["first"] else []
            options = {"head": [chain], "lookup": [span], "lookup-else-head": [span or chain],
                       "better": [chain, span]}[source]
            truth = seq[plen + g:plen + g + max(map(len, options))]
            accepted = max(next((i for i, (d, t) in enumerate(zip(o, truth)) if d != t), min(len(o), len(truth)))
                           for o in options)
            taus.append(accepted + 1)
            g += accepted + 1
    return sum(taus) / len(taus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--head", default="models/mtp")
    ap.add_argument("--prompts", type=int, default=12, help="held-back prompts per task (the card's 12)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    base, tok = load_llama(args.base), load_tokenizer(args.base)
    head = load_head(args.head, base).float().eval()
    prompts = validation_prompts(load_corpus(HEAD_SOURCES), args.prompts, tasks=tuple(tok.tasks))
    share = lambda part, whole: f"{len(part) / max(1, len(whole)):.0%}"  # noqa: E731
    right = lambda rows: f"{sum(r[1] for r in rows) / max(1, len(rows)):.0%}"  # noqa: E731
    first, taus = [], []
    for task in tok.tasks:
        items = [encode_prompt(tok, task, p["prompt"]) for p in prompts if p["task"] == task]
        items = [ids for ids in items if len(ids) <= base.config.max_position_embeddings - args.new_tokens]
        ans = answers(base, head, items, args.new_tokens, args.k)
        rows = first_draft_rows(ans)
        cells = [f"{share(b, rows)}, {right(b)}" for b in ([r for r in rows if lo <= r[0] < hi] for lo, hi in BINS)]
        sure = [r for r in rows if r[0] >= 0.8]
        copied = [r for r in sure if r[2]]
        drafted = [r for r in rows if r[3] is not None]
        first.append(f"| {task} | {len(rows)} | {right(rows)} | " + " | ".join(cells)
                     + f" | {share(copied, sure)}, {right(copied)} | {right([r for r in sure if not r[2]])} | "
                     f"{share(drafted, rows)}, {sum(r[3] for r in drafted) / max(1, len(drafted)):.0%} | "
                     f"{share([r for r in drafted if r[3] and not r[1]], rows)} |")
        taus.append(f"| {task} | " + " | ".join(f"{emulated_tau(ans, args.k, s, args.new_tokens):.2f}" for s in
                                                 ("head", "lookup", "lookup-else-head", "better")) + " |")
    print("First drafts\n\n| task | tokens | first draft right | " + " | ".join(
        f"p in [{lo:.1f}, {min(hi, 1):.1f}{']' if hi > 1 else ')'}: share, right" for lo, hi in BINS)
        + " | p >= 0.8, in the prompt: share, right | p >= 0.8, not in it: right | prompt lookup: drafts, right "
        "| head wrong, lookup right (of all) |")
    print("| --- " * (7 + len(BINS)) + "|")
    print("\n".join(first))
    print(f"\nTokens per base pass at k = {args.k}, decoding emulated\n\n| task | head | prompt lookup | prompt lookup, else the head "
          "(decode's default) | the better of the two at each step (a bound) |\n| --- | --- | --- | --- | --- |")
    print("\n".join(taus))


if __name__ == "__main__":
    main()
