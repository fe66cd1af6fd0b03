"""The frozen MTP head: exact speculative decoding, frozen base, fingerprint, zero extra prompt state."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from builder.data.corpus import Corpus
from builder.decode.loop import acceptance, compare_to_reference, decode
from builder.decode.torch_backend import TorchBackend
from builder.errors import CheckpointError
from builder.models.llama import Llama, LlamaConfig, save_llama
from builder.models.head import base_fingerprint, induction_scores, load_head, save_head
from builder.data.tasks import encode_prompt
from builder.train.head import HeadTrainConfig, train_head
from tests.conftest import BASE_DIR, HEAD_DIR, check_steps, expect_error, run


@pytest.fixture(scope="module")
def head(base):
    return load_head(HEAD_DIR, base)


@pytest.mark.slow  # over 30 s in CI (2026-12-07)
def test_mtp_output_equals_plain_greedy_for_k_1_to_6(base, head, tokenizer, validation_prompts, reference):
    """60 validation prompts (30 per task) never trained on, k = 1..6: docs/contract.md's exactness rule."""
    eos = base.config.eos_token_id
    near_ties, checked = [], 0
    for p in validation_prompts:
        ids = encode_prompt(tokenizer, p["task"], p["prompt"])
        ref = reference.decoded(ids, 32)
        for k in range(1, 7):
            out = decode(TorchBackend(base, head), ids, 32, eos, k)
            verdict, where = compare_to_reference(ref, out.ids)
            assert verdict != "mismatch", f"{p['task']} {p['prompt']!r} k={k}: first mismatch at token {where}"
            if verdict == "near-tie":
                near_ties.append((p["prompt"], k, where))
            checked += 1
    print(f"\nexactness: {checked} decodes, {len(near_ties)} excused near-ties {near_ties}")
    assert len(near_ties) <= checked // 20, f"too many near-tie divergences: {near_ties}"


def test_head_drafts_are_accepted_on_proofread(base, head, tokenizer, validation_prompts):
    """A regression guard, far below the measured figures in models/inhouse/mtp/README.md."""
    eos = base.config.eos_token_id
    accepted = []
    for p in [q for q in validation_prompts if q["task"] == "proofread"][:10]:
        accepted += decode(TorchBackend(base, head), encode_prompt(tokenizer, "proofread", p["prompt"]), 48, eos, 4).accepted
    tau, _ = acceptance(accepted, 4)
    assert tau > 3.0, f"proofread tau at k=4 is {tau:.2f}: the head no longer copies the prompt"


def test_the_head_reads_the_base_layer_that_copies(base, head):
    """A proofread answer is mostly a copy of the prompt. The head reads the KV cache of the base layer
    with the strongest induction head (the copying circuit), which stands far out from the layers without one."""
    scores = induction_scores(base)
    best = max(range(len(scores)), key=scores.__getitem__)
    assert scores[best] > 10 * sorted(scores)[len(scores) // 2], f"no layer stands out: {scores}"
    assert head.config.kv_layer == best, f"the head reads layer {head.config.kv_layer}, induction scores {scores}"


def test_head_is_light_and_reuses_the_base(base, head):
    layer = sum(p.numel() for p in base.model.layers[0].parameters())
    assert head.num_params() <= 2 * layer, "the head must not exceed two of the base's decoder layers"
    vocab = base.config.vocab_size
    assert not any(vocab in t.shape for t in head.state_dict().values()), "embedding and LM head are the base's"


def test_drafting_reads_the_base_cache_without_changing_it(base, head, tokenizer):
    ids = encode_prompt(tokenizer, "continue", "The json module provides")
    _, hidden, cache = base(torch.tensor([ids]))
    before = [(k.clone(), v.clone()) for k, v in cache]
    drafts, confidence = head.draft(base, hidden[0, -1], 42, cache, 5)
    assert len(drafts) == len(confidence) == 5 and all(0 < c <= 1 for c in confidence)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(cache, before))


def test_head_trained_for_another_base_is_refused(base, tmp_path):
    other = Llama(base.config)
    other.load_state_dict(base.state_dict())
    with torch.no_grad():
        other.model.norm.weight[0] += 1e-3
    with pytest.raises(CheckpointError, match="another base"):
        load_head(HEAD_DIR, other)
    save_llama(other, tmp_path / "other")
    shutil.copy(BASE_DIR / "tokenizer.json", tmp_path / "other")
    expect_error(run("generate", "--prompt", "Lists are", "--mode", "mtp", "--base", str(tmp_path / "other")),
                 "another base")


def test_a_one_layer_head_saved_before_heads_had_layers_still_loads(base, head, tmp_path):
    """Heads saved before heads had layers kept their one layer's weights at the top level of the file."""
    from dataclasses import replace

    from safetensors.torch import save_file

    from builder.models.head import MTPHead

    one = MTPHead(replace(head.config, num_layers=1))
    save_head(one, tmp_path / "old")
    flat = {k.removeprefix("layers.0."): v.contiguous() for k, v in one.state_dict().items()}
    assert len(flat) == len(one.state_dict()) and "self_attn.q_proj.weight" in flat
    save_file(flat, tmp_path / "old" / "model.safetensors")
    loaded = load_head(tmp_path / "old", base)
    assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in one.state_dict().items())


def tiny_setup(corpus, directory):
    """A tiny random base, its tokenizer (trained into directory) and a small corpus: head training in seconds."""
    from builder.data.tasks import load_tokenizer
    from builder.train.base import train_tokenizer

    small = Corpus(corpus.train[:200], corpus.validation[:20], corpus.files)
    directory.mkdir()
    train_tokenizer(small.train, 300).save(str(directory / "tokenizer.json"))
    tok = load_tokenizer(directory)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96, eos_token_id=0)
    tiny = Llama(cfg)
    tiny.init_weights(seed=0)
    return tiny.eval(), tok, small


def test_training_never_changes_the_base(corpus, tmp_path):
    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    head, log = train_head(tiny, tok, small, HeadTrainConfig(prompts_per_task=6, new_tokens=8, steps=3,
                                                             batch_size=4, k=3))
    assert all(torch.equal(state[k], v) for k, v in tiny.state_dict().items()), "the base's weights changed"
    assert not any(p.grad is not None for p in tiny.parameters()), "the base received gradients"
    assert head.config.base_fingerprint == base_fingerprint(tiny)
    scores = log["induction_scores"]
    assert len(scores) == 2 and head.config.kv_layer == max(range(2), key=scores.__getitem__)
    save_head(head, tmp_path / "head")
    assert load_head(tmp_path / "head", tiny).config.k_train == 3


def test_the_layer_the_head_reads_can_be_chosen(corpus, tmp_path):
    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    cfg = dict(prompts_per_task=3, new_tokens=4, steps=1, batch_size=4, k=2)
    head, _ = train_head(tiny, tok, small, HeadTrainConfig(kv_layer=0, **cfg))
    assert head.config.kv_layer == 0
    with pytest.raises(CheckpointError, match="layers 0..1"):
        train_head(tiny, tok, small, HeadTrainConfig(kv_layer=2, **cfg))


def test_a_second_stage_goes_on_from_a_trained_head(corpus, tmp_path):
    """--init: the head's own weights are where training starts (zero steps leave them as they were), it
    keeps its base layer, --task-prompts sets each task's share of the data, and a head of another base
    is refused."""
    from builder.train.distill import training_prompts

    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    cfg = dict(prompts_per_task=4, new_tokens=4, batch_size=4, k=2)
    first, _ = train_head(tiny, tok, small, HeadTrainConfig(steps=2, kv_layer=0, **cfg))
    save_head(first, tmp_path / "first")
    kept, _ = train_head(tiny, tok, small, HeadTrainConfig(steps=2, lr=0.0, seed=1, init=str(tmp_path / "first"), **cfg))
    assert kept.config.kv_layer == 0
    for name, t in first.state_dict().items():
        assert torch.equal(t, kept.state_dict()[name]), f"{name}: a stage at lr 0 changed the head it started from"
    moved, _ = train_head(tiny, tok, small, HeadTrainConfig(steps=2, seed=1, init=str(tmp_path / "first"), **cfg))
    assert any(not torch.equal(t, moved.state_dict()[n]) for n, t in first.state_dict().items())

    # --layers 2: a layer is added after the head's own and starts as the identity (at lr 0 the drafts
    # are the first stage's); a stage cannot take layers away
    deeper, _ = train_head(tiny, tok, small, HeadTrainConfig(steps=2, lr=0.0, seed=1, init=str(tmp_path / "first"),
                                                             layers=2, **cfg))
    assert deeper.config.num_layers == 2 and deeper.num_params() > first.num_params()
    _, hidden, cache = tiny(torch.tensor([[5, 17, 42, 8, 99]]))
    assert deeper.draft(tiny, hidden[0, -1], 7, cache, 2)[0] == first.draft(tiny, hidden[0, -1], 7, cache, 2)[0]
    save_head(deeper, tmp_path / "deeper")
    assert load_head(tmp_path / "deeper", tiny).config.num_layers == 2
    with pytest.raises(CheckpointError, match="add layers, not remove"):
        train_head(tiny, tok, small, HeadTrainConfig(steps=1, init=str(tmp_path / "deeper"), layers=1, **cfg))

    prompts = training_prompts(tok, small, 4, seed=1, per_task={"continue": 3, "proofread": 1})
    counts = {task: sum(p[: len(f["prefix"])] == f["prefix"] for p in prompts) for task, f in tok.tasks.items()}
    assert counts["continue"] == 3 and counts["proofread"] == 1, counts  # (this small corpus has no summaries)

    other = Llama(tiny.config)
    other.init_weights(seed=1)
    with pytest.raises(CheckpointError, match="another base"):
        train_head(other.eval(), tok, small, HeadTrainConfig(steps=1, init=str(tmp_path / "first"), **cfg))


def test_a_stage_can_replay_the_stages_before_it(corpus, tmp_path, monkeypatch):
    """--replay: a stage trains on the data of every stage of its --init head as well as its own prompts,
    each sequence once (with the features kept or the base run live), and its command line says so."""
    import builder.train.head as th

    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    seen = []
    real = th.make_batches
    monkeypatch.setattr(th, "make_batches", lambda data, *a: seen.append([tuple(s) for _, s in data]) or real(data, *a))
    for cached in (True, False):
        cfg = dict(prompts_per_task=4, new_tokens=6, batch_size=4, k=2, cache_features=cached)
        first, log = train_head(tiny, tok, small, HeadTrainConfig(steps=1, **cfg))
        save_head(first, tmp_path / f"first{cached}")
        (tmp_path / f"first{cached}" / "train_log.json").write_text(json.dumps(log))
        second = HeadTrainConfig(steps=1, seed=1, init=str(tmp_path / f"first{cached}"), **cfg)
        _, alone = train_head(tiny, tok, small, second)
        _, both = train_head(tiny, tok, small, HeadTrainConfig(**{**second.__dict__, "replay": True}))
        earlier, own, replayed = seen[-3:]
        assert replayed == list(dict.fromkeys(earlier + own)), "replay: the earlier stage's data, then this stage's, each once"
        assert both["sequences"] == len(replayed) > alone["sequences"] == len(own)
        assert "--replay" in th.stage_command(both) and "--replay" not in th.stage_command(alone)
        assert "every earlier stage's prompts" in th.stage_text({**both, "data_seconds": 0, "train_seconds": 0})
    chat = {**both, "train_config": {**both["train_config"], "chat_messages": 5}}  # --chat-messages: in the card's command
    assert "--chat-messages 5" in th.stage_command(chat) and "--chat-messages" not in th.stage_command(both)
    card = {**both, "train_config": {**both["train_config"], "eval_prompts": 12}}  # the card's own table: in its command
    assert "--eval-prompts 12" in th.stage_command(card) and "--eval-prompts" not in th.stage_command(both)
    smaller = {**both, "train_config": {**both["train_config"], "draft_vocab": 32}, "data_seconds": 0, "train_seconds": 0}
    assert "--draft-vocab 32" in th.stage_command(smaller) and "made smaller: the 32 of its tokens" in th.stage_text(smaller)
    assert "5 `reply` prompts that are real short messages" in th.stage_text(chat)
    with pytest.raises(CheckpointError, match="give --init"):
        train_head(tiny, tok, small, HeadTrainConfig(steps=1, replay=True, **cfg))
    save_head(first, tmp_path / "first")  # a head without its train_log.json
    with pytest.raises(CheckpointError, match="train_log.json is missing"):
        train_head(tiny, tok, small, HeadTrainConfig(steps=1, replay=True, init=str(tmp_path / "first"), **cfg))


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_cached_features_and_a_draft_vocabulary(corpus, tmp_path):
    """--cache-features trains as the base run at every step does (its features kept in fp16: the same
    loss to fp16's precision), from parts a second run reads back; --draft-vocab N drafts only the base's
    N most used tokens (and a later stage's --draft-vocab the most used of those), and MTP with such a head
    still writes the base's own tokens."""
    import builder.train.head as th

    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    cfg = HeadTrainConfig(prompts_per_task=8, new_tokens=8, steps=6, batch_size=4, k=3, draft_vocab=64)
    live, live_log = train_head(tiny, tok, small, cfg)
    cached, cached_log = train_head(tiny, tok, small, HeadTrainConfig(**{**cfg.__dict__, "cache_features": True}))
    assert cached_log["final_loss"] == pytest.approx(live_log["final_loss"], rel=1e-2)
    assert torch.equal(live.d2t, cached.d2t) and len(cached.d2t) == 64 and len(set(cached.d2t.tolist())) == 64
    import builder.train.distill as td

    assert list(td.DISTILL_CACHE.glob("*/*.pt")), "the data and features are kept in parts"
    again, _ = train_head(tiny, tok, small, HeadTrainConfig(**{**cfg.__dict__, "cache_features": True}))
    for name, t in cached.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), f"{name}: a run from the kept features differs"
    # the draft vocabulary: the most used tokens of the distilled data
    data = th.distilled(tiny, base_fingerprint(tiny), th.training_prompts(tok, small, 8, 0), 8)
    counts = torch.bincount(torch.tensor([t for _, s in data for t in s]), minlength=tiny.config.vocab_size)
    assert counts[cached.d2t].min() >= counts[[i for i in range(len(counts)) if i not in set(cached.d2t.tolist())]].max()
    # a stage from it with --draft-vocab 32 keeps the 32 of its tokens used most, and its weights at lr 0
    save_head(cached, tmp_path / "v64")
    stage = dict(cfg.__dict__, steps=1, lr=0.0, init=str(tmp_path / "v64"), cache_features=True)
    smaller, _ = train_head(tiny, tok, small, HeadTrainConfig(**{**stage, "draft_vocab": 32}))
    assert smaller.config.draft_vocab == len(smaller.d2t) == 32 and set(smaller.d2t.tolist()) <= set(cached.d2t.tolist())
    assert counts[smaller.d2t].min() >= counts[[t for t in cached.d2t.tolist() if t not in set(smaller.d2t.tolist())]].max()
    assert all(torch.equal(t, smaller.state_dict()[n]) for n, t in cached.state_dict().items() if n != "d2t")
    save_head(smaller, tmp_path / "v32")
    assert load_head(tmp_path / "v32", tiny).d2t.tolist() == smaller.d2t.tolist()
    with pytest.raises(CheckpointError, match="smaller, not larger"):
        train_head(tiny, tok, small, HeadTrainConfig(**{**stage, "draft_vocab": 64}))
    eos = tiny.config.eos_token_id
    for p in validation_prompts_of(small, tok)[:4]:
        ref = decode(TorchBackend(tiny), p, 12, eos)
        out = decode(TorchBackend(tiny, head=cached.eval()), p, 12, eos, 3)
        assert compare_to_reference(ref, out.ids)[0] != "mismatch"
        with torch.no_grad():
            drafted, _ = cached.draft_ids(cached.vocabulary(tiny), torch.randn(1, 1, 32), tiny.model.embed_tokens(torch.tensor([[p[-1]]])),
                                       *[torch.randn(1, 5, 2, 8) for _ in range(2)], 3)
        assert set(drafted[0].tolist()) <= set(cached.d2t.tolist())
    # exported, its graphs hold the draft vocabulary's rows of the embedding (nothing of the base's file)
    # and draft what the torch head drafts: the same steps and acceptances through the one loop
    from builder.decode.onnx_backend import OnnxBackend
    from builder.export.manifest import Checkpoints, export

    save_llama(tiny, tmp_path / "base")
    shutil.copyfile(tmp_path / "tokenizer" / "tokenizer.json", tmp_path / "base" / "tokenizer.json")
    save_head(cached, tmp_path / "mtp")
    m = export(Checkpoints(tmp_path / "base", tmp_path / "mtp", None), tmp_path / "onnx", ("fp32",))
    assert all("base.data" not in m["precisions"]["fp32"]["graphs"][f"head_k{k}"]["weights"] for k in range(1, 4))
    onnx_head = OnnxBackend(tmp_path / "onnx", "head", 3)
    for p in validation_prompts_of(small, tok)[:4]:
        out, there = (decode(b, p, 12, eos, 3) for b in (TorchBackend(tiny, head=cached), onnx_head))
        assert (out.ids, out.accepted) == (there.ids, there.accepted)
        # it drafts only after a token the base chose: it has no embedding of any other
        state = onnx_head.prefill(p[:-1])
        choice = state.choices[-1]
        assert len(onnx_head.draft(state, choice, 3)[0]) == 3
        assert onnx_head.draft(state, (choice + 1) % 300, 3) == ([], None)
        assert out.accepted[0] == 0 or p[-1] == choice


def test_batched_distillation_is_each_prompts_own_greedy_decoding(base, tokenizer, validation_prompts):
    """Prompts of different lengths share a left-padded batch: each row's continuation is the base's own
    plain greedy decoding of its prompt (docs/contract.md's rule), and the features kept with it are those of
    the base run on the sequence alone (hidden states, the read layer's keys at the sequence's own
    positions, values), to fp16's precision."""
    from builder.decode.torch_backend import decode_ar
    from builder.train.distill import greedy_continuations

    prompts = [encode_prompt(tokenizer, p["task"], p["prompt"]) for p in validation_prompts[:6]]
    assert len({len(p) for p in prompts}) > 2, "prompts of different lengths"
    eos = base.config.eos_token_id
    data, feats = greedy_continuations(base, prompts, 20, eos, batch=6, kv_layer=3)
    for p, (n, seq), (hidden, keys, values) in zip(prompts, data, feats):
        assert n == len(p) and seq[:n] == p
        assert compare_to_reference(decode_ar(base, p, 20, eos), seq[n:])[0] != "mismatch"
        with torch.no_grad():
            _, h, cache = base(torch.tensor([seq]))
        assert hidden.shape[0] == keys.shape[0] == len(seq)
        for got, want in ((hidden, h[0]), (keys, cache[3][0][0]), (values, cache[3][1][0])):
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def validation_prompts_of(corpus, tok):
    from builder.data.corpus import validation_prompts

    return [encode_prompt(tok, p["task"], p["prompt"]) for p in validation_prompts(corpus, 4, tasks=tuple(tok.tasks))]


def test_interrupted_training_resumes_to_the_same_weights(corpus, tmp_path, monkeypatch, caplog):
    """Ctrl-C at step 5 saves the run; the same run again (its tau table on another number of prompts or
    not) resumes there and ends with the weights of an uninterrupted run. A run with other training
    settings is refused, naming the checkpoint (loop.py's policy)."""
    import logging

    import builder.train.head as th
    from builder.errors import CheckpointError

    caplog.set_level(logging.INFO, logger="builder")
    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    cfg = HeadTrainConfig(prompts_per_task=8, new_tokens=8, steps=8, batch_size=4, k=3, checkpoint_every=3)
    straight, _ = train_head(tiny, tok, small, cfg)

    calls, real_loss = [], th.chain_loss

    def interrupt_at_fifth_step(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_loss(*args)

    monkeypatch.setattr(th, "chain_loss", interrupt_at_fifth_step)
    with pytest.raises(KeyboardInterrupt):
        train_head(tiny, tok, small, cfg, run_dir=tmp_path)
    monkeypatch.setattr(th, "chain_loss", real_loss)
    assert "saved the run after step 4" in caplog.text and (tmp_path / "state.pt").is_file()

    # another --eval-prompts (what the tau table measures, not what trains) resumes the same run
    resumed, log = train_head(tiny, tok, small, HeadTrainConfig(**{**cfg.__dict__, "eval_prompts": 5}), run_dir=tmp_path)
    assert log["resumed_at_step"] == 4 and "resuming from" in caplog.text
    for name, t in straight.state_dict().items():
        assert torch.equal(t, resumed.state_dict()[name]), f"{name} differs from the uninterrupted run"

    other = HeadTrainConfig(**{**cfg.__dict__, "lr": cfg.lr / 2})
    with pytest.raises(CheckpointError, match="other settings"):
        train_head(tiny, tok, small, other, run_dir=tmp_path)


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_cli_mtp_json_reports_steps_and_acceptance():
    a = run("generate", "--prompt", "Teh list is sortd in place.", "--task", "proofread", "--json", "--mode", "ar")
    m = run("generate", "--prompt", "Teh list is sortd in place.", "--task", "proofread", "--json",
            "--mode", "mtp", "--k", "4")
    assert a.returncode == 0 and m.returncode == 0, a.stderr + m.stderr
    ar, mtp = json.loads(a.stdout), json.loads(m.stdout)
    assert mtp["ids"] == ar["ids"] and mtp["mode"] == "mtp" and mtp["k"] == 4
    assert len(mtp["accepted"]) == mtp["steps"] < ar["steps"] == len(ar["ids"])
    check_steps(mtp["accepted"], len(mtp["ids"]), mtp["stopped"])


def test_a_stage_learns_the_production_models_answers(corpus, tmp_path):
    """--everyday: each feature's everyday training texts are decoded by its production model (the base plus
    the feature's adapter; continue and features without one: the base alone), the head learns that model's
    features, the adapter is gone afterwards, the base never changes, and without --cache-features (the base
    would run alone at every step) the stage is refused."""
    from dataclasses import asdict, replace

    import builder.train.head as th
    from builder.errors import UserError
    from builder.models.adapter import add_adapter, load_adapter, remove_adapter, save_adapter
    from builder.train.distill import greedy_continuations

    tiny, tok, small = tiny_setup(corpus, tmp_path / "tokenizer")
    fingerprint, eos = base_fingerprint(tiny), tiny.config.eos_token_id
    add_adapter(tiny, rank=2, alpha=4.0, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B is zero in a fresh adapter: the production model would be the base
        for name, p in tiny.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    save_adapter(tiny, tmp_path / "adapters" / "proofread", 2, 4.0, {"base_fingerprint": fingerprint})
    remove_adapter(tiny)
    cfg = HeadTrainConfig(new_tokens=6, steps=1, batch_size=4, k=2, everyday={"proofread": 3, "continue": 2},
                          adapters=str(tmp_path / "adapters"))
    with pytest.raises(UserError, match="--cache-features"):
        train_head(tiny, tok, small, cfg)

    parts = th.stage_parts(tok, small, asdict(cfg))
    assert [(len(ps), n, a) for ps, n, a in parts] == [(3, 6, str(tmp_path / "adapters" / "proofread")), (2, 6, None)]
    got = th.distil_parts(tiny, fingerprint, parts, kv_layer=0)
    assert base_fingerprint(tiny) == fingerprint and not any(".lora_" in n for n in tiny.state_dict())
    as_lists = lambda data: [(int(n), [int(t) for t in seq]) for n, seq in data]  # noqa: E731
    plain = greedy_continuations(tiny, parts[0][0], 6, eos)
    load_adapter(tiny, tmp_path / "adapters" / "proofread", fingerprint)
    production, feats = greedy_continuations(tiny, parts[0][0], 6, eos, kv_layer=0)
    remove_adapter(tiny)
    assert as_lists(got[0][0]) == as_lists(production) != as_lists(plain)
    for ours, theirs in zip(got[0][1], feats):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), "the features are not the production model's"
    assert as_lists(got[1][0]) == as_lists(greedy_continuations(tiny, parts[1][0], 6, eos))  # continue: the base

    head, log = train_head(tiny, tok, small, replace(cfg, cache_features=True))
    assert log["sequences"] == 5 and head.config.base_fingerprint == fingerprint == base_fingerprint(tiny)
    command = th.stage_command({"train_config": asdict(replace(cfg, cache_features=True))})
    assert "--everyday proofread=3,continue=2" in command and f"--adapters {tmp_path / 'adapters'}" in command
