"""train-base: seeded and reproducible, writes a loadable Hugging Face checkpoint (checked on a tiny run)."""
from __future__ import annotations

import torch

from builder.corpus import Corpus
from builder.model import LlamaConfig, load_llama
from builder.tasks import load_tokenizer
from builder.train_base import TrainConfig, train_base

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def test_training_is_seeded_and_writes_a_loadable_checkpoint(tmp_path, corpus):
    small = Corpus(corpus.train[:300], corpus.validation[:20], corpus.files)
    cfg = TrainConfig(steps=3, batch_size=2, block_size=32, vocab_size=400)
    runs = []
    for name in ("a", "b"):
        log = train_base(tmp_path / name, cfg, LlamaConfig(**TINY), corpus=small)
        runs.append(load_llama(tmp_path / name))
        assert load_tokenizer(tmp_path / name).get_vocab_size() == 400
    assert log["tokens_seen"] == 3 * 2 * 32
    a, b = (m.state_dict() for m in runs)
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed must give the same weights"
    assert runs[0].config.max_position_embeddings == 32 and runs[0].config.eos_token_id == 0
