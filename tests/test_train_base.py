"""train-base: seeded, resumable to the same weights, loss only on what the model writes (tiny runs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.data.corpus import Corpus
from builder.models.llama import LlamaConfig, load_llama, save_llama
from builder.data.tasks import EOS, TASKS, load_tokenizer
from builder.train.base import TrainConfig, bits_per_byte, build_stream, overlap_f1, train_base, train_tokenizer

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def small(corpus):
    train, validation = corpus.train_sections[:60], corpus.validation_sections[:4]
    flat = lambda sections: [p for _, paras in sections for p in paras]  # noqa: E731
    return Corpus(flat(train), flat(validation), corpus.files, train, validation, corpus.sources)


def tiny_cfg(**kw):
    return TrainConfig(**{"steps": 6, "batch_size": 2, "block_size": 32, "vocab_size": 400, "warmup": 2,
                          "sources": ("python3.11-doc",), **kw})


def test_training_is_seeded_and_writes_a_loadable_checkpoint(tmp_path, small):
    runs = []
    for name in ("a", "b"):
        model, tok, log = train_base(tmp_path / name, tiny_cfg(), LlamaConfig(**TINY), corpus=small)
        save_llama(model, tmp_path / name / "out")
        tok.save(str(tmp_path / name / "out" / "tokenizer.json"))
        runs.append(load_llama(tmp_path / name / "out"))
        assert set(load_tokenizer(tmp_path / name / "out").tasks) == set(TASKS)
    assert log["tokens_seen"] == 6 * 2 * 32 and log["steps"] == 6
    a, b = (m.state_dict() for m in runs)
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed must give the same weights"
    assert runs[0].config.max_position_embeddings == 32 and runs[0].config.eos_token_id == 0


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, small):
    whole, _, _ = train_base(tmp_path / "whole", tiny_cfg(), LlamaConfig(**TINY), corpus=small)
    train_base(tmp_path / "cut", tiny_cfg(), LlamaConfig(**TINY), corpus=small, stop_at=3)
    assert torch.load(tmp_path / "cut" / "state.pt", weights_only=True)["state"]["step"] == 3
    # the resumed run needs no corpus: the tokenizer and the stream are read back from the run directory
    resumed, _, log = train_base(tmp_path / "cut", tiny_cfg(), LlamaConfig(**TINY), corpus=None)
    assert log["steps"] == 6
    a, b = whole.state_dict(), resumed.state_dict()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst == 0.0, f"resumed weights differ from the uninterrupted run's by up to {worst}"


def test_a_run_with_other_settings_is_not_resumed(tmp_path, small):
    from builder.errors import CheckpointError

    train_base(tmp_path, tiny_cfg(), LlamaConfig(**TINY), corpus=small, stop_at=2)
    with pytest.raises(CheckpointError, match="other settings"):
        train_base(tmp_path, tiny_cfg(lr=1e-4), LlamaConfig(**TINY), corpus=small)


def test_loss_is_taken_only_on_what_the_model_writes(small):
    tok = train_tokenizer(small.train, 400)
    ids, weights, tokens = build_stream(tok, ["Some text."], {"summarize": [("A long passage.", "Its title")]}, seed=0)
    assert sum(tokens.values()) == len(ids)
    sid = {t: tok.token_to_id(t) for t in ("<|summarize|>", "<|summary|>", "<|continue|>", EOS)}
    start = int(np.flatnonzero(ids == sid["<|summarize|>"])[0])
    sep = int(np.flatnonzero(ids == sid["<|summary|>"])[0])
    end = start + int(np.flatnonzero(ids[start:] == sid[EOS])[0])
    assert weights[start:sep + 1].sum() == 0, "the passage is read, not trained on"
    assert weights[sep + 1:end + 1].all(), "the title and its end token are trained on"
    assert tok.decode(ids[sep + 1:end].tolist()) == "Its title"


def test_bits_per_byte_and_overlap(base, tokenizer, corpus):
    bpb = bits_per_byte(base, tokenizer, corpus.validation[:40])
    assert 0.5 < bpb < 3.0, f"the shipped base's bits per byte {bpb} is implausible"
    assert overlap_f1("Using the copy module", "using the copy module") == 1.0
    assert overlap_f1("a b", "c d") == 0.0 and 0 < overlap_f1("the copy module", "copy things") < 1


def test_missing_corpus_packages_are_named_with_their_install_line(tmp_path, monkeypatch):
    from builder.data import corpus as corpus_module
    from builder.data.corpus import Source
    from builder.errors import DataError
    from builder.train.base import train_and_report

    monkeypatch.setitem(corpus_module.SOURCES, "no-such-doc", Source("no-such-doc", str(tmp_path / "absent"), "*.html", "html", "-"))
    with pytest.raises(DataError, match="apt-get install no-such-doc"):
        train_and_report(tmp_path / "out", tiny_cfg(sources=("python3.11-doc", "no-such-doc")), tmp_path / "run")


def test_train_and_report_writes_a_checkpoint_with_its_card(tmp_path, small):
    from builder.train.base import train_and_report

    out = tmp_path / "base"
    log = train_and_report(out, tiny_cfg(block_size=64), tmp_path / "run",
                           model_cfg=LlamaConfig(**TINY), corpus=small, n_eval=3)
    v = log["validation"]
    assert 0 < v["bits_per_byte"] < 20 and v["python_validation_paragraphs"] == len(small.validation)
    assert v["proofread_evaluated"] == 3 and v["summarize_evaluated"] <= 3 and v["samples"]
    card = (out / "README.md").read_text()
    assert "bits per byte" in card and "summarize" in card and "python3.11-doc" in card
    assert load_tokenizer(out).tasks.keys() == TASKS.keys()


def test_the_card_compares_with_another_base_on_the_same_text(tmp_path, small):
    """--against: the base shipped before (here: the shipped one, whose tokenizer has no summarize task)
    is measured on the same validation text and sentences, and the card shows both."""
    from builder.train.base import train_and_report
    from tests.conftest import BASE_DIR

    out = tmp_path / "base"
    log = train_and_report(out, tiny_cfg(block_size=64), tmp_path / "run",
                           model_cfg=LlamaConfig(**TINY), corpus=small, n_eval=3, against=BASE_DIR)
    v, other = log["validation"], log["validation"]["against"]
    assert other["base"] == str(BASE_DIR) and other["proofread_evaluated"] == v["proofread_evaluated"] == 3
    assert 0 < other["bits_per_byte"] < v["bits_per_byte"], "the shipped base models this text better than a tiny one"
    card = (out / "README.md").read_text()
    assert f"`{BASE_DIR}`" in card and f"{other['bits_per_byte']:.3f}" in card
    assert f"{other['summarize_overlap_f1']:.3f}" in card, "the shipped base offers summarize: its figure is in the table"
