"""The one decode loop: speculative decoding with any draft source gives exactly the plain greedy tokens.

An oracle drafter that knows the reference continuation, and corrupts it on purpose, drives every
branch of the acceptance rule: all drafts accepted, none, a prefix, and rollback of the cache.
"""
from __future__ import annotations

import random

import pytest
import torch

from builder.contract import LOOKUP_SPAN
from builder.decode.loop import cut_drafts, decode, prompt_lookup
from builder.decode.torch_backend import TorchBackend, decode_ar
from builder.models.llama import Llama, LlamaConfig
from tests.conftest import check_steps

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)  # tied, a random model repeats its last token forever


class OracleDrafter:
    """Drafts the reference continuation, with each draft wrong with probability `p_wrong`; it is sure of the
    right ones (confidence 0.95) and unsure of the wrong ones (0.02)."""

    def __init__(self, prompt, reference, p_wrong, seed):
        self.seq, self.p_wrong, self.rng = list(prompt) + list(reference), p_wrong, random.Random(seed)
        self.calls = []

    def draft(self, base, hidden, token, cache, k):
        pos = cache[0][0].shape[1] + 1  # the token sits at position S; drafts follow it
        assert self.seq[pos - 1] == token, "the loop must feed the last decided token"
        self.calls.append((pos, k))
        out, sure = [], []
        for i in range(k):
            right = self.seq[pos + i] if pos + i < len(self.seq) else 0
            wrong = self.rng.random() < self.p_wrong
            out.append((right + 1) % CFG.vocab_size if wrong else right)
            sure.append(0.02 if wrong else 0.95)
        return out, sure


@pytest.fixture(scope="module")
def base():
    m = Llama(CFG)
    m.init_weights(seed=0)
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # sharpen the logits: no near-ties in this random model
    return m.eval()


@pytest.mark.parametrize("p_wrong", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_speculative_tokens_equal_plain_greedy(base, k, p_wrong):
    for seed in range(4):
        prompt = torch.randint(0, CFG.vocab_size, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = decode_ar(base, prompt, 40, None)
        assert len(set(ref.ids)) >= 5, f"seed={seed}: the reference repeats itself, a weak check of the loop"
        drafter = OracleDrafter(prompt, ref.ids, p_wrong, seed)
        got = decode(TorchBackend(base, drafter), prompt, 40, None, k)
        first = next((i for i, (a, b) in enumerate(zip(got.ids, ref.ids)) if a != b), None)
        assert got.ids == ref.ids, f"k={k} p_wrong={p_wrong} seed={seed}: first mismatch at token {first}"
        assert got.margins == pytest.approx(ref.margins, abs=1e-4)
        assert len(got.accepted) == got.steps and all(0 <= a <= k for a in got.accepted)
        check_steps(got.accepted, len(got.ids), got.stopped)  # no end token here: exactly accepted + 1 per step
        if p_wrong == 0.0:
            assert got.steps == -(-40 // (k + 1)), "perfect drafts: every step accepts all k"
        if p_wrong == 1.0:
            assert set(got.accepted) == {0} and got.steps == 40


def test_drafts_never_run_past_max_new_tokens_or_the_context(base):
    prompt = list(range(1, 20))
    ref = decode_ar(base, prompt, CFG.max_position_embeddings - len(prompt), None)
    drafter = OracleDrafter(prompt, ref.ids, 0.0, 0)
    got = decode(TorchBackend(base, drafter), prompt, len(ref.ids), None, 6)
    assert got.ids == ref.ids
    assert all(pos + k <= CFG.max_position_embeddings for pos, k in drafter.calls)


def test_stops_at_end_of_sequence_inside_an_accepted_run(base):
    """Perfect drafts at k=4: every step decides 5 tokens; the end token is one first decided in the middle
    of a later step, whose remaining accepted tokens must be dropped."""
    prompt = [3, 1, 4, 1, 5]
    ref = decode_ar(base, prompt, 30, None)
    first_at = {}
    for i, t in enumerate(ref.ids):
        first_at.setdefault(t, i)
    eos = next(t for t, i in first_at.items() if i >= 5 and i % 5 != 4)  # pretend this token is the end token
    want = ref.ids[: first_at[eos] + 1]
    got = decode(TorchBackend(base, OracleDrafter(prompt, ref.ids, 0.0, 0)), prompt, 30, eos, 4)
    assert got.ids == want == decode_ar(base, prompt, 30, eos).ids
    assert got.stopped == "end-of-sequence" and got.accepted[-1] == 4
    assert sum(a + 1 for a in got.accepted) > len(got.ids), "the end token was not inside the last step"
    check_steps(got.accepted, len(got.ids), got.stopped)


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_trigram():
    assert prompt_lookup([4, 5, 6, 7, 8, 4, 5, 6, 9, 4, 5, 6], 3) == [9, 4, 5], "the latest occurrence"
    assert prompt_lookup([4, 5, 6, 7, 8, 9, 10, 4, 5, 6], 3) == [7, 8, 9], "at most k"
    assert prompt_lookup([4, 5, 6, 7, 4, 5, 6], 9) == [7, 4, 5, 6], "up to the end"
    assert prompt_lookup([1, 5, 6, 7, 4, 5, 6], 4) == [], "only the last two tokens occurred: no draft"
    assert prompt_lookup([6, 6, 6, 6], 2) == [6], "overlapping occurrences"
    assert prompt_lookup([4, 5, 6], 2) == [] and prompt_lookup([4, 5], 2) == []


@pytest.mark.parametrize("p_wrong", [0.0, 0.5, 1.0])
def test_prompt_lookup_first_keeps_plain_greedy_tokens(base, p_wrong):
    """Prompt lookup's drafts go through the same acceptance as the drafter's: the tokens stay the reference's
    whatever either drafts, and the steps lookup drafted are those where the text's last three tokens occurred
    before (here the first, by construction of the prompt)."""
    looked_up = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, CFG.vocab_size, (8,), generator=g).tolist()
        prompt = prompt + prompt[2:6]  # its last three tokens occurred before: the first step looks up
        ref = decode_ar(base, prompt, 40, None)
        drafter = OracleDrafter(prompt, ref.ids, p_wrong, seed)
        got = decode(TorchBackend(base, drafter), prompt, 40, None, 4, lookup=True)
        assert got.ids == ref.ids, f"p_wrong={p_wrong} seed={seed}"
        assert len(got.lookups) == len(got.accepted) == got.steps and got.lookups[0]
        check_steps(got.accepted, len(got.ids), got.stopped)
        decided = [len(prompt) + sum(a + 1 for a in got.accepted[:i]) for i in range(got.steps)]
        seq = prompt + got.ids
        k_steps = [min(4, 40 - (n - len(prompt)) - 1) for n in decided]  # none at a last step with room for one
        assert got.lookups == [k > 0 and bool(prompt_lookup(seq[:n], k)) for n, k in zip(decided, k_steps)]
        spans = [min(LOOKUP_SPAN * 4, 40 - (n - len(prompt)) - 1) for n in decided]  # a lookup step's most drafts
        assert all(a <= (s if looked else k) for a, s, k, looked in zip(got.accepted, spans, k_steps, got.lookups))
        assert len(drafter.calls) == sum(k > 0 for k in k_steps) - sum(got.lookups), \
            "the drafter runs only where lookup drafts nothing"
        looked_up += sum(got.lookups)
        plain_drafts = decode(TorchBackend(base, OracleDrafter(prompt, ref.ids, p_wrong, seed)), prompt, 40, None, 4)
        assert plain_drafts.ids == ref.ids and not any(plain_drafts.lookups), "lookup is off by default in decode"
    assert looked_up > 4


def test_draft_cut_keeps_the_drafts_before_the_running_confidence_falls_below_it():
    assert cut_drafts([1, 2, 3, 4], [0.9, 0.5, 0.3, 0.9], 0.1) == [1, 2, 3, 4], "0.9, 0.45, 0.135, 0.12"
    assert cut_drafts([1, 2, 3, 4], [0.9, 0.5, 0.3, 0.9], 0.2) == [1, 2]
    assert cut_drafts([1, 2, 3, 4], [0.05, 1.0, 1.0, 1.0], 0.1) == [], "the product never recovers"
    assert cut_drafts([1, 2], [0.5, 0.5], 0.25) == [1, 2], "at the cut is kept"
    assert cut_drafts([1, 2], None, 0.5) == [1, 2] and cut_drafts([1, 2], [0.01, 0.01], 0.0) == [1, 2], \
        "no confidence (the drafter) or no cut: every draft"


@pytest.mark.parametrize("p_wrong", [0.2, 0.5])
def test_a_draft_cut_verifies_fewer_drafts_and_keeps_plain_greedy_tokens(base, p_wrong):
    """OracleDrafter is sure of its right drafts and unsure of its wrong ones: cut at 0.1, a step verifies
    only its run of right drafts, every one of which is accepted; the tokens stay the reference's."""
    for seed in range(4):
        prompt = torch.randint(0, CFG.vocab_size, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = decode_ar(base, prompt, 40, None)
        whole = decode(TorchBackend(base, OracleDrafter(prompt, ref.ids, p_wrong, seed)), prompt, 40, None, 4)
        got = decode(TorchBackend(base, OracleDrafter(prompt, ref.ids, p_wrong, seed)), prompt, 40, None, 4, draft_cut=0.1)
        assert whole.ids == got.ids == ref.ids, f"p_wrong={p_wrong} seed={seed}"
        check_steps(got.accepted, len(got.ids), got.stopped)
        assert all(v == a + 1 for v, a in zip(got.verified, got.accepted)), "only right drafts were verified"
        assert sum(got.verified) < sum(whole.verified) and any(v < 5 for v in got.verified[:-1])


class CycleBackend:
    """A fake base whose greedy choice after token t is (t + 1) mod 10: its text is a cycle, so once the cycle
    has come round, prompt lookup drafts all the way; it records every verify's length."""

    context = 64

    def __init__(self):
        self.fed = []

    def prefill(self, ids):
        return list(ids)

    def verify(self, state, ids):
        self.fed.append(len(ids))
        return [(t + 1) % 10 for t in ids], [1.0] * len(ids), state + list(ids)

    def rollback(self, state, n_fed):
        return state[: len(state) - self.fed[-1] + n_fed]  # the last verify's rejected drafts go

    def draft(self, state, token, k):
        return [], None  # the mode's own source drafts nothing: only lookup drafts


def test_prompt_lookup_drafts_up_to_its_span_not_just_k():
    """Where the text copies itself further than k tokens, a lookup step drafts up to LOOKUP_SPAN x k and
    accepts them all; the acceptance figures count those positions beyond k too (tau = 1 + their sum)."""
    from builder.decode.loop import acceptance

    base = CycleBackend()
    prompt = list(range(10)) * 2 + [0, 1]  # the cycle has come round: its last three tokens occurred before
    got = decode(base, prompt, 30, None, 3, lookup=True)
    assert got.ids == [(2 + i) % 10 for i in range(30)]
    assert got.lookups[0] and got.accepted[0] == LOOKUP_SPAN * 3 and base.fed[0] == LOOKUP_SPAN * 3 + 1
    assert max(base.fed) == LOOKUP_SPAN * 3 + 1, "never more than the span, plus the token it follows"
    assert got.verified == base.fed, "each step records the tokens its base pass read"
    tau, by_position = acceptance(got.accepted, 3)
    assert len(by_position) == max(got.accepted) == LOOKUP_SPAN * 3 and abs(tau - 1 - sum(by_position)) < 1e-9
    assert acceptance([1, 0], 3) == (1.5, [0.5, 0.0, 0.0]), "at least k positions"


LOOKUP_JS = """
const [,, lib, cases] = process.argv;
const { promptLookup } = await import(lib);
console.log(JSON.stringify(JSON.parse(cases).map(([ids, k]) => promptLookup(ids, k))));
"""


def test_the_page_looks_up_the_same_drafts_as_python(tmp_path):
    """web/src/generate.mjs's promptLookup, run by node, against prompt_lookup on random texts with repeats."""
    import json
    import subprocess

    from tests.conftest import ROOT

    rng = random.Random(0)
    cases = [([rng.randrange(4) for _ in range(rng.randint(2, 60))], rng.randint(1, 6)) for _ in range(500)]
    (tmp_path / "lookup.mjs").write_text(LOOKUP_JS)
    run = subprocess.run(["node", str(tmp_path / "lookup.mjs"), (ROOT / "web" / "src" / "generate.mjs").as_uri(),
                          json.dumps(cases)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    want = [prompt_lookup(ids, k) for ids, k in cases]
    assert sum(map(bool, want)) > 100 and json.loads(run.stdout) == want


CUT_JS = """
const [,, lib, cases] = process.argv;
const { cutDrafts } = await import(lib);
console.log(JSON.stringify(JSON.parse(cases).map(([drafts, sure, cut]) => cutDrafts(drafts, sure, cut))));
"""


def test_the_page_cuts_the_same_drafts_as_python(tmp_path):
    """web/src/generate.mjs's cutDrafts, run by node, against cut_drafts on random confidences and cuts."""
    import json
    import subprocess

    from tests.conftest import ROOT

    rng = random.Random(1)
    cases = []
    for _ in range(500):
        n = rng.randint(0, 6)
        sure = [round(rng.random(), 3) for _ in range(n)] if rng.random() < 0.9 else None
        cases.append((list(range(n)), sure, rng.choice([0, 0.05, 0.075, 0.1, 0.2, 0.5])))
    (tmp_path / "cut.mjs").write_text(CUT_JS)
    run = subprocess.run(["node", str(tmp_path / "cut.mjs"), (ROOT / "web" / "src" / "generate.mjs").as_uri(),
                          json.dumps(cases)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    want = [cut_drafts(*case) for case in cases]
    assert len({len(w) for w in want}) == 7 and json.loads(run.stdout) == want


DECODE_JS = """
const [,, lib, prompt, span] = process.argv;
const { decode } = await import(lib);
const fed = [];
const backend = {  // CycleBackend's fake base: after token t, (t + 1) mod 10; the mode's source drafts nothing
  context: 64,
  async prefill(ids) { return ids.slice(); },
  async verify(state, ids) { fed.push(ids.length); return [ids.map((t) => (t + 1) % 10), state.concat(ids)]; },
  rollback(state, nFed) { return state.slice(0, state.length - fed.at(-1) + nFed); },
  async draft() { return [[], null]; },
};
const out = await decode(backend, JSON.parse(prompt), { maxNewTokens: 30, eos: null, k: 3, lookup: true, lookupSpan: +span });
console.log(JSON.stringify({ ids: out.ids, accepted: out.accepted, lookups: out.lookups, verified: out.verified, fed }));
"""


def test_the_page_decodes_with_the_same_lookup_span_as_python(tmp_path):
    """web/src/generate.mjs's decode, run by node on CycleBackend's fake base with the manifest's span, takes
    the steps Python's decode takes: the same tokens, accepted drafts, lookup steps and verify lengths."""
    import json
    import subprocess

    from tests.conftest import ROOT

    prompt = list(range(10)) * 2 + [0, 1]
    base = CycleBackend()
    want = decode(base, prompt, 30, None, 3, lookup=True)
    (tmp_path / "decode.mjs").write_text(DECODE_JS)
    run = subprocess.run(["node", str(tmp_path / "decode.mjs"), (ROOT / "web" / "src" / "generate.mjs").as_uri(),
                          json.dumps(prompt), str(LOOKUP_SPAN)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert max(want.accepted) > 3, "a check of the span: some step accepted more than k"
    assert got == {"ids": want.ids, "accepted": want.accepted, "lookups": want.lookups, "verified": want.verified,
                   "fed": base.fed}


CHUNKS_JS = r"""
const [,, src] = process.argv;
const { startRuntime } = await import(`${src}/runtime.mjs`);
const ort = await startRuntime('wasm');  // its Tensor class: no session runs here
const { OnnxBackend, PREFILL_CHUNK } = await import(`${src}/onnx_backend.mjs`);
const kv = { layers: 1, shape: [1, 'S', 1, 2], past_inputs: ['past_key_0', 'past_value_0'],
  present_outputs: ['present_key_0', 'present_value_0'] };
const runs = [];
const disposed = new Set();
const floats = (dims) => new ort.Tensor('float32', new Float32Array(dims.reduce((a, b) => a * b)), dims);
const sessions = {  // the graphs' shapes, no model: each run records what it read and returns fresh tensors
  manifest: { context_length: 4096, kv, head: null, drafter: { k: 16, kv } }, dtype: 'float32', graphs: {},
  dispose: (t) => t && disposed.add(t),
  async run(graph, feeds) {
    const [T, S, U] = [feeds.input_ids.dims[1], feeds.past_key_0.dims[1], feeds.outputs_at.dims[0]];
    runs.push({ graph, T, S, used_freed: Object.values(feeds).some((t) => disposed.has(t)) });
    return { choices: new ort.Tensor('int64', new BigInt64Array(U).fill(7n), [1, U]), margins: floats([1, U]),
      hidden: floats([1, U, 2]), present_key_0: floats([1, S + T, 1, 2]), present_value_0: floats([1, S + T, 1, 2]) };
  },
};
const backend = new OnnxBackend(sessions, { source: 'drafter', k: 2 });
const prompt = Array.from({ length: 600 }, (_, i) => i % 50);
const state = await backend.prefill(prompt.slice(0, -1));
const [drafts] = await backend.draft(state, prompt.at(-1), 2);
console.log(JSON.stringify({ chunk: PREFILL_CHUNK, runs, cache: state.cache.past_key_0.dims[1], ids: state.ids.length, drafts }));
"""


def test_the_page_reads_a_long_prompt_in_chunks_after_their_cache(tmp_path):
    """web/src/onnx_backend.mjs, run by node on a fake base and drafter (the graphs' shapes, no model): a prefill of
    599 tokens is three base runs of 256, 256 and 87 tokens, each after the cache of the ones before (never one
    run over all: its attention would hold heads x T x T scores, 2.4 GB for SmolLM2 at T = 8,190); the drafter
    reads the 600 tokens in the same chunks; no run reads a tensor the backend has already freed."""
    import json
    import shutil
    import subprocess

    from tests.conftest import ROOT

    src = tmp_path / "site"  # the page's modules with the onnxruntime-web build they import, as in a built site
    shutil.copytree(ROOT / "web" / "src", src)
    (src / "vendor" / "ort").mkdir(parents=True)
    for name in ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs"):
        shutil.copyfile(ROOT / "web" / "node_modules" / "onnxruntime-web" / "dist" / name, src / "vendor" / "ort" / name)
    (tmp_path / "chunks.mjs").write_text(CHUNKS_JS)
    run = subprocess.run(["node", str(tmp_path / "chunks.mjs"), src.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["chunk"] == 256
    base = [(r["T"], r["S"]) for r in got["runs"] if r["graph"] == "base"]
    drafter = [(r["T"], r["S"]) for r in got["runs"] if r["graph"] == "drafter"]
    assert base == [(256, 0), (256, 256), (87, 512)], base
    assert drafter == [(256, 0), (256, 256), (88, 512), (1, 600)], drafter  # then its second draft
    assert got["cache"] == got["ids"] == 599 and got["drafts"] == [7, 7]
    assert not any(r["used_freed"] for r in got["runs"]), got["runs"]
