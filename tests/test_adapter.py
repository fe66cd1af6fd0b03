"""Feature adapters (LoRA on the frozen base) and the everyday data they learn from."""
from __future__ import annotations

import json
import random

import pytest
import torch

from builder.data import everyday
from builder.errors import CheckpointError
from builder.models.adapter import PREFIX, add_adapter, adapter_state, load_adapter, projections, remove_adapter, save_adapter
from builder.models.head import base_fingerprint
from builder.models.llama import PROJECTIONS, load_llama, save_llama
from tests.conftest import BASE_DIR, expect_error, run


@pytest.fixture
def fresh_base():
    return load_llama(BASE_DIR)


def logits(model, ids):
    with torch.no_grad():
        return model(ids)[0]


def randomise(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in projections(model):
            p.lora_B.weight.copy_(torch.randn(p.lora_B.weight.shape, generator=g) * 0.02)


IDS = torch.tensor([[5, 17, 300, 42, 9, 11, 250, 3]])


def test_a_fresh_adapter_leaves_the_base_unchanged(fresh_base):
    before = logits(fresh_base, IDS)
    params = add_adapter(fresh_base, rank=4, alpha=8)
    assert torch.equal(logits(fresh_base, IDS), before), "B starts at zero: base + fresh adapter must be the base"
    assert all(p.requires_grad for p in params)
    assert not any(p.requires_grad for n, p in fresh_base.named_parameters() if ".lora_" not in n), "the base is frozen"
    n_proj = len(list(projections(fresh_base)))
    assert n_proj == len(PROJECTIONS) * fresh_base.config.num_hidden_layers
    assert len(params) == 2 * n_proj


def test_an_adapter_changes_the_answers_but_not_the_base(fresh_base, tmp_path):
    fingerprint, before = base_fingerprint(fresh_base), logits(fresh_base, IDS)
    add_adapter(fresh_base, rank=4, alpha=8)
    randomise(fresh_base)
    assert (logits(fresh_base, IDS) - before).abs().max() > 1e-3, "a trained adapter must change the logits"
    assert base_fingerprint(fresh_base) == fingerprint, "an attached adapter is not part of the base's fingerprint"
    save_llama(fresh_base, tmp_path / "base")
    again = load_llama(tmp_path / "base")  # save_llama writes the base alone: it loads as a plain base
    assert torch.equal(logits(again, IDS), before)
    remove_adapter(fresh_base)
    assert torch.equal(logits(fresh_base, IDS), before)


def test_saved_adapters_load_as_their_fp16_values_under_peft_names(fresh_base, tmp_path):
    from safetensors.torch import load_file

    fingerprint = base_fingerprint(fresh_base)
    add_adapter(fresh_base, rank=4, alpha=8)
    randomise(fresh_base)
    save_adapter(fresh_base, tmp_path, rank=4, alpha=8, extra={"task": "proofread", "base_fingerprint": fingerprint})
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == list(PROJECTIONS)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight" in saved
    assert all(t.dtype == torch.float16 for t in saved.values())
    # the production model computes on the shipped (fp16) values
    with torch.no_grad():
        for name, t in adapter_state(fresh_base).items():
            t.copy_(t.to(torch.float16).to(torch.float32))
    expected = logits(fresh_base, IDS)
    other = load_llama(BASE_DIR)
    load_adapter(other, tmp_path, fingerprint)
    assert torch.equal(logits(other, IDS), expected)


def test_an_adapter_for_another_base_or_a_broken_file_is_refused(fresh_base, tmp_path):
    add_adapter(fresh_base, rank=2, alpha=2)
    save_adapter(fresh_base, tmp_path, rank=2, alpha=2, extra={"base_fingerprint": "0" * 64})
    with pytest.raises(CheckpointError, match="another base"):
        load_adapter(load_llama(BASE_DIR), tmp_path, base_fingerprint(load_llama(BASE_DIR)))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_adapter(load_llama(BASE_DIR), tmp_path)
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_adapter(load_llama(BASE_DIR), tmp_path)
    with pytest.raises(CheckpointError, match="not an adapter directory"):
        load_adapter(load_llama(BASE_DIR), tmp_path / "nowhere")


# --- the everyday data -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, clean", [
    ("I'm home on Saturday.", True), ("Are you coming to the party?", True),
    ("i'm home.", False), ("Im home on Saturday.", False), ("I'm home on saturday.", False),
    ("I recieved it today.", False), ("I am home", False), ("I am home. see you", False)])
def test_a_clean_sentence_is_capitalised_ended_and_spelled_right(text, clean):
    assert everyday.is_clean_sentence(text) is clean, text


def test_injected_mistakes_are_real_ones_and_each_kind_occurs():
    rng, kinds_seen = random.Random(0), set()
    for sentence in everyday.clean_sentences("train")[:400]:
        wrong = everyday.inject_errors(sentence, rng, 1)
        if wrong == sentence:
            continue
        old, new = [w for w in sentence.split()], [w for w in wrong.split()]
        assert len(old) == len(new), f"one word changed in place: {sentence!r} -> {wrong!r}"
        changed = [(a, b) for a, b in zip(old, new) if a != b]
        assert len(changed) == 1, (sentence, wrong)
        a, b = changed[0]
        word = everyday.WORD.search(a).group()
        wrong_word = everyday.WORD.search(b).group()
        kinds = [k for k, ways in everyday.word_errors(word).items() if wrong_word in ways]
        assert kinds, f"{word!r} -> {wrong_word!r} is none of the kinds"
        kinds_seen.update(kinds)
    assert kinds_seen == set(everyday.KINDS), f"kinds never injected: {set(everyday.KINDS) - kinds_seen}"


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_held_out_texts_never_reach_training():
    train, held = set(everyday.clean_sentences("train")), set(everyday.clean_sentences("eval"))
    assert len(held) > 1000 and not held & train
    evaluation = {g for _, g in everyday.proofread_pairs("eval", 200, seed=12345)}
    assert evaluation <= held
    replies_eval = {m for m, _ in everyday.reply_pairs("eval", 10**6, seed=0)}
    replies_train = {m for m, _ in everyday.reply_pairs("train", 10**6, seed=0)}
    assert len(replies_eval) > 500 and len(replies_train) > 5000
    assert not replies_eval & replies_train, f"held-out messages in training: {sorted(replies_eval & replies_train)[:3]}"


def test_replies_are_short_and_spelled_right():
    for message, reply in everyday.reply_pairs("train", 500, seed=0):
        assert 1 <= len(reply.split()) <= 15 and "?" in message
        assert everyday.spelled_right(reply, sentence=False), reply
        assert not everyday.BLOCKED.search(message + reply)


# --- training --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_an_interrupted_adapter_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """train-adapter on the in-house base (its proofread task): stopped after 2 of 3 steps and resumed, the
    adapter equals one trained 3 steps in one go; the base is unchanged, the card and log are written."""
    from safetensors.torch import load_file

    from builder.train import adapter as train_adapter_module
    from builder.train.adapter import AdapterTrainConfig, train_adapter

    cfg = AdapterTrainConfig(task="proofread", examples=64, steps=3, batch_size=4, eval_examples=4)
    assert train_adapter(BASE_DIR, tmp_path / "a", tmp_path / "run-a", cfg, stop_at=2) == {"stopped_at": 2}
    log = train_adapter(BASE_DIR, tmp_path / "a", tmp_path / "run-a", cfg)
    train_adapter(BASE_DIR, tmp_path / "b", tmp_path / "run-b", cfg)
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(t.abs().max() > 0 for k, t in a.items() if "lora_B" in k), "the adapter learned nothing"
    assert log["steps"] == 3 and log["held_out"] == 4 and set(log["adapter"]["counts"]) <= {"fix", "clean"}
    card = (tmp_path / "a" / "README.md").read_text()
    assert "| fix |" in card or "| clean |" in card
    assert train_adapter_module.digest(everyday.proofread_pairs("eval", 4, seed=12345)) == log["held_out_digest"]


def test_train_adapter_refuses_a_task_the_base_lacks(tmp_path):
    expect_error(run("train-adapter", "--task", "reply", "--base", str(BASE_DIR), "--out", str(tmp_path / "a"),
                     "--run-dir", str(tmp_path / "r"), "--steps", "1"), "does not offer the task 'reply'")


# --- summarize: stacks, the checks, the few-shot prompt ------------------------------------------------

STACK = "Mom: Dinner is at 7 on Sunday, don't be late\nMom: Can you bring the salad?\nDad: And pick up Grandma on the way please"


@pytest.mark.parametrize("summary, fault", [
    ("Mom says dinner is at 7 on Sunday and asks you to bring the salad, and Dad asks you to pick up Grandma.", None),
    ("Mom says dinner is at 8 on Sunday.", "number 8 not in the stack"),
    ("Mom says dinner is at 7 on Monday.", "name Monday not in the stack"),
    ("Dinner is at 7 on Sunday. Bring the salad.", "more than one sentence"),
    ("Can you bring the salad?", "a copy of one message"),
    ("Mom asks for a refund because the product arrived broken.", "words not in the stack"),
    ("As an AI assistant I can summarize: dinner is at 7.", "assistant talk"),
    ("Mom " + "says dinner is at 7 " * 6, "words"),
    ("Dad says dinner is at 7 on Sunday.", "Dad did not say that (dinner)"),
    ("Mom asks if Dad is late, and Dad says no.", "Dad neither agrees nor denies"),
    ("Dad asks whether the salad is ready.", "Dad asks, but asked nothing"),
    ("Mom has the salad and Dad picks up Grandma.", "Mom's own question as a fact (salad)"),
    ("Mom says my dinner is at 7.", "speaks as a sender"),
    ("Mom says I should bring the salad.", "speaks as a sender (I, my, me)"),
    ("Mom: Can you bring the salad?", "a copy of one message"),
    ("Dad: pick up Grandma, and Mom says dinner is at 7.", "a message, not a summary"),
    ("Mom says dinner is at 7, and Mom says dinner is at 7 on Sunday.", "says the same thing twice"),
    ("Mom says dinner is at 7 on Sunday and to bring the salda.", "not a word (salda)"),
    ("Mom says dinner is at 7 on Sunday, so Max brings the salad.", "name Max not in the stack"),
    ("Mom asks Mom to bring the salad.", "Mom talks to themselves"),
    ("Mom says dinner is at 7 on Sunday and asks for the salad, a big salad.", "more often than the stack (salad)"),
    # a sender named twice is no repeat
    ("Mom says dinner is at 7 on Sunday, and Mom asks you to bring the salad.", None),
    # another form of a word the stack holds is that word ("picking up", "is asking"); a reporting verb frames
    ("Mom is asking you to bring the salad, and Dad is telling you about picking up Grandma.", None),
])
def test_summary_checks_find_what_a_summary_invents_or_drops(summary, fault):
    faults = everyday.summary_faults(STACK, summary)
    if fault is None:
        assert faults == [], faults
    else:
        assert any(fault in f for f in faults), f"{fault!r} not among {faults}"


def test_notification_stacks_are_people_or_notices_from_their_split():
    stacks = everyday.summary_inputs("eval", 100, seed=1)
    assert len(stacks) == 100 and len(set(stacks)) == 100
    people = [s for s in stacks if ": " in s.splitlines()[0] and s.split(": ")[0] in everyday.NAMES]
    assert 0.4 * len(stacks) < len(people) < len(stacks), "both message stacks and notices"
    senders = [len({line.split(": ")[0] for line in s.splitlines()}) for s in people]
    assert all(2 <= len(s.splitlines()) <= 5 for s in people)
    assert 0.5 * len(people) < senders.count(1) < len(people) and senders.count(1) + senders.count(2) == len(people), \
        "mostly one person writing to the reader, some group chats of two"
    texts = {m for conv in everyday.conversations("eval") for turn in conv for m in turn}
    assert all(line.split(": ", 1)[1] in texts for s in people for line in s.splitlines())
    assert all(everyday.senders(s) for s in people) and not any(everyday.senders(s) for s in stacks if s not in people)


def test_a_notice_copied_whole_is_a_copy_and_its_label_is_no_sender():
    notice = "Card alert: a payment of $95.32 to Green Market was made with your card ending 9596 on Sep 23."
    assert "a copy of one message" in everyday.summary_faults(notice, notice)
    assert "a message, not a summary (Name: ...)" in everyday.summary_faults(
        notice + "\nYour order #12 has shipped.", "Card alert: a payment of $95.32 to Green Market, and order #12 has shipped.")
    assert not everyday.summary_faults(notice, "You paid $95.32 to Green Market with your card ending 9596 on Sep 23.")
    assert everyday.summary_faults("Mia: say hi to Leo for me\nJon: will do", "Leo says hi to Jon.") == \
        ["Leo says something but sent nothing"]
    assert everyday.senders(notice) == {} and everyday.senders("Reminder: dentist\nYour order has shipped.") == {}


def test_few_shot_candidates_are_the_greedy_answer_then_seeded_samples(fresh_base):
    from builder.train.adapter import SAMPLES, few_shot_candidates
    from builder.train.distill import greedy_continuations

    fresh_base.eval()
    g = torch.Generator().manual_seed(3)
    head = torch.randint(5, 400, (24,), generator=g).tolist()  # the worked examples every prompt shares
    prompts = [head + torch.randint(5, 400, (n,), generator=g).tolist() for n in (3, 5, 3, 4)]
    eos = fresh_base.config.eos_token_id
    got = few_shot_candidates(fresh_base, prompts, eos, seed=7)
    assert got == few_shot_candidates(fresh_base, prompts, eos, seed=7), "a seed gives the same candidates"
    greedy = greedy_continuations(fresh_base, prompts, 48, eos)
    for prompt, cands, (n, seq) in zip(prompts, got, greedy):
        assert len(cands) == SAMPLES and all(lp <= 0 for _, lp in cands)
        assert cands[0][0] == [t for t in seq[n:] if t != eos], "the first candidate is the prompt's greedy answer"
        assert len({tuple(c) for c, _ in cands}) > 1, "the others are samples"


def test_the_few_shot_prompt_is_the_chat_template_with_worked_examples():
    from pathlib import Path

    from builder.data.tasks import load_tokenizer
    from builder.train.adapter import FEW_SHOT, few_shot_prompt

    tok = load_tokenizer(Path(__file__).resolve().parent.parent / "models" / "base")
    ids = few_shot_prompt(tok, "Sam: lunch at 1?")
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.count("<|im_start|>user") == len(FEW_SHOT) + 1 and text.count("<|im_start|>assistant") == len(FEW_SHOT) + 1
    assert text.endswith("Sam: lunch at 1?<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tok.token_to_id("<|im_start|>")) == 2 * len(FEW_SHOT) + 3, "the markers are single tokens"
    for example, summary in FEW_SHOT:
        assert not everyday.summary_faults(example, summary), f"a worked example fails the checks: {summary!r}"


# ---------------------------------------------------------------- the adapters in the ONNX export

def random_adapter(base_dir, out, task: str, seed: int):
    """A random adapter of rank 4 for task, saved as train-adapter saves one (fp16, PEFT's layout)."""
    model = load_llama(base_dir)
    add_adapter(model, rank=4, alpha=8, seed=seed)
    randomise(model, seed)
    save_adapter(model, out, 4, 8, {"task": task, "base_fingerprint": base_fingerprint(model)})
    return out


@pytest.fixture(scope="module")
def adapted_export(tiny, tmp_path_factory):
    """The tiny models exported with adapters for two features (fp32 and fp16 graphs)."""
    from builder.export.manifest import Checkpoints, export

    root = tmp_path_factory.mktemp("adapted")
    adapters = tuple(random_adapter(tiny.base, root / task, task, seed) for seed, task in enumerate(("proofread", "reply"), 1))
    ckpts = Checkpoints(tiny.base, tiny.head, None, adapters)
    out = root / "onnx"
    export(ckpts, out, ("fp32", "fp16"))
    return ckpts, out


def test_the_export_feeds_each_features_adapter_to_one_base_graph(adapted_export):
    ckpts, out = adapted_export
    m = json.loads((out / "manifest.json").read_text())
    spec = m["adapters"]
    assert spec["by_task"] == {"proofread": "adapter.proofread.safetensors", "reply": "adapter.reply.safetensors"}
    assert (spec["rank"], spec["alpha"]) == (4, 8)
    base = load_llama(ckpts.base)
    n_proj = len(PROJECTIONS) * base.config.num_hidden_layers
    for precision, dtype in (("fp32", "float32"), ("fp16", "float16")):
        inputs = {i["name"]: i for i in m["precisions"][precision]["graphs"]["base"]["inputs"]}
        lora = {n: i for n, i in inputs.items() if ".lora_" in n}
        assert set(lora) == set(spec["inputs"]) and len(lora) == 2 * n_proj
        for name, (key, scale) in spec["inputs"].items():
            assert key == PREFIX + name.removesuffix(".T") + ".weight"
            assert scale == (2.0 if ".lora_B." in name else 1.0)  # alpha / rank, on B
            assert lora[name]["dtype"] == dtype
        assert "drafter" not in m["precisions"][precision]["graphs"]
        for name, g in m["precisions"][precision]["graphs"].items():  # the heads read the base's outputs: no adapter
            if name != "base":
                assert not any(".lora_" in i["name"] for i in g["inputs"]), name
    for task, file in spec["by_task"].items():  # the file as train-adapter wrote it, listed and checked
        source = next(d for d in ckpts.adapters if d.name == task)
        assert (out / file).read_bytes() == (source / "adapter_model.safetensors").read_bytes()
        assert m["files"][file]["bytes"] == (out / file).stat().st_size


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_onnx_production_models_give_the_torch_production_models_ids(adapted_export, tokenizer_prompts, precision):
    from builder.decode.loop import compare_to_reference, decode
    from builder.decode.onnx_backend import OnnxBackend
    from builder.decode.torch_backend import decode_ar

    ckpts, out = adapted_export
    for task in (None, "proofread", "reply"):
        model = load_llama(ckpts.base)
        if task:
            load_adapter(model, next(d for d in ckpts.adapters if d.name == task))
        for source, k in ((None, 0), ("head", 3)):
            backend = OnnxBackend(out, source, k, precision, adapter=task)
            for prompt in tokenizer_prompts:
                with torch.no_grad():
                    want = decode_ar(model, prompt, 12, None)
                got = decode(backend, prompt, 12, None, k).ids
                if precision == "fp32":
                    verdict, where = compare_to_reference(want, got)
                    assert verdict != "mismatch", (task, source, where, want.ids, got)
                else:  # fp16 graphs compute in half: they need not equal fp32 torch, only differ from the base
                    assert len(got) == 12
        if task:  # the production model is not the base: the test would pass on adapters fed as zeros
            plain = load_llama(ckpts.base)
            with torch.no_grad():
                assert any(decode_ar(model, p, 12, None).ids != decode_ar(plain, p, 12, None).ids
                           for p in tokenizer_prompts), f"the {task} adapter changed nothing"
    with pytest.raises(CheckpointError, match="no adapter for 'summarize'"):
        OnnxBackend(out, adapter="summarize")


@pytest.fixture(scope="module")
def tokenizer_prompts(tiny):
    from builder.data.tasks import encode_prompt, load_tokenizer

    tok = load_tokenizer(tiny.base)
    return [encode_prompt(tok, "continue", t) for t in ("The weather today is", "Can you pick up some milk")]


def test_adapters_of_another_base_or_rank_are_refused_by_the_export(tiny, adapted_export, tmp_path):
    from builder.export.manifest import Checkpoints, export

    ckpts, _ = adapted_export
    other = load_llama(tiny.base)
    add_adapter(other, rank=2, alpha=8)
    save_adapter(other, tmp_path / "rank2", 2, 8, {"task": "summarize", "base_fingerprint": base_fingerprint(other)})
    with pytest.raises(CheckpointError, match="differ in rank or alpha"):
        export(Checkpoints(tiny.base, None, None, (*ckpts.adapters, tmp_path / "rank2")), tmp_path / "x", ("fp32",))
    save_adapter(other, tmp_path / "wrong", 2, 8, {"task": "summarize", "base_fingerprint": "0" * 64})
    with pytest.raises(CheckpointError, match="trained for another base"):
        export(Checkpoints(tiny.base, None, None, (tmp_path / "wrong",)), tmp_path / "y", ("fp32",))


def test_the_bench_decodes_each_feature_by_its_production_model(adapted_export, tmp_path):
    """bench on everyday text: each feature's held-out texts, in torch and in onnxruntime, decoded by the base
    plus the feature's adapter (a feature without one, and continue: the base alone) to that model's greedy
    output, not the base's; the JSON names the text and the adapters and gives their bytes, and with no
    drafter the bench measures plain decoding and MTP."""
    from builder.bench.measure import Plan, adapter_params
    from builder.bench.run import BenchConfig, bench, bench_texts
    from builder.bench.runners import python_runner
    from builder.data.tasks import encode_prompt, load_tokenizer
    from builder.decode.loop import compare_to_reference
    from builder.decode.torch_backend import decode_ar
    from builder.models.adapter import production_models

    ckpts, out = adapted_export
    tok = load_tokenizer(ckpts.base)
    models = production_models(ckpts.base, ckpts.adapters)
    assert set(models) == {None, "proofread", "reply"}
    eos = models[None].config.eos_token_id
    texts = bench_texts("everyday", ("proofread", "summarize"), 2)  # summarize: no adapter here (this base has no reply)
    changed = 0
    for runtime in ("torch", "onnx-cpu"):
        run, _ = python_runner(runtime, ckpts, out, models)
        for task, items in texts.items():
            for text in items:
                ids = encode_prompt(tok, task, text)
                with torch.no_grad():
                    want, plain = decode_ar(models.get(task, models[None]), ids, 10, eos), decode_ar(models[None], ids, 10, eos)
                for mode, k in (("ar", 0), ("mtp", 3)):
                    got = run(ids, text, task, mode, k, 10)[0].ids
                    assert compare_to_reference(want, got)[0] != "mismatch", (runtime, task, mode, text)
                changed += (task in models) * (want.ids != plain.ids)
    assert changed, "the proofread adapter changed no answer: the test would pass on the base alone"

    plan = Plan(2, 8, (2,), 1)
    data = bench(BenchConfig(runtimes=("torch", "onnx-cpu"), plans={"torch": plan, "onnx-cpu": plan, "peers": plan},
                             text="everyday"), ckpts, out, tmp_path / "site")
    assert data["text"] == "everyday" and set(data["adapters"]) == {"proofread", "reply"}
    rows = data["results"]
    assert {r["mode"] for r in rows} == {"ar", "mtp"} and all(r["mismatches"] == 0 for r in rows), rows
    assert {r["task"] for r in rows} == set(tok.tasks)
    for d in ckpts.adapters:
        assert data["memory"]["adapter_bytes"][d.name] == {"download": (d / "adapter_model.safetensors").stat().st_size,
                                                           "fp32": 4 * adapter_params(d)}
        assert adapter_params(d) == sum(p.numel() for n, p in models[d.name].named_parameters() if ".lora_" in n)
