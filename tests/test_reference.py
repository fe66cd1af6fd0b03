"""The parity file (tests/reference.py) is what it stands for: the PyTorch base's own greedy decoding."""
import json

import numpy as np
import pytest

from builder.data.tasks import encode_prompt
from builder.decode.torch_backend import decode_ar
from builder.models.head import base_fingerprint
from tests.reference import INHOUSE, PER_TASK, SMOLLM2, SMOLLM2_PROMPTS, TOKENS, path_for, prompts_for


def check_file(base, tok, prompts):
    """The base's parity file holds these prompts, and the PyTorch base still decodes each to the file's ids."""
    data = json.loads(path_for(base_fingerprint(base)).read_text())
    assert data["tokens"] == TOKENS and len(data["prompts"]) == len(prompts)
    for entry, p in zip(data["prompts"], prompts):
        assert (entry["task"], entry["prompt"]) == (p["task"], p["prompt"]), "the file's prompts are the tests' prompts"
        assert entry["prompt_ids"] == encode_prompt(tok, p["task"], p["prompt"])
        out = decode_ar(base, entry["prompt_ids"], len(entry["ids"]) if entry["stopped"] != "end-of-sequence" else TOKENS,
                        base.config.eos_token_id)
        assert out.ids == entry["ids"], f"{p['task']} {p['prompt'][:40]!r}: the base no longer decodes the file's ids"
        # margins to 1e-4 (a few ulps of logits near 10: the matmul kernels may differ by alignment); the
        # near-tie rule reads them at 1e-3
        np.testing.assert_allclose(out.margins, entry["margins"], atol=1e-4)


@pytest.mark.slow
def test_the_parity_file_holds_the_torch_reference_of_the_shipped_base(base, tokenizer, validation_prompts):
    assert len(validation_prompts) == PER_TASK * len(tokenizer.tasks)
    assert prompts_for(INHOUSE) == validation_prompts
    check_file(base, tokenizer, validation_prompts)


@pytest.mark.slow
def test_smollm2s_parity_file_holds_its_torch_reference():
    """SmolLM2's file (everyday text of every task, what test_gguf.py checks the head, the drafter and the
    exports against) is the imported base's own greedy decoding."""
    from builder.data.tasks import load_tokenizer
    from builder.models.llama import load_llama

    smol = load_llama(SMOLLM2).eval()
    tok = load_tokenizer(SMOLLM2)
    assert {p["task"] for p in SMOLLM2_PROMPTS} == set(tok.tasks)
    check_file(smol, tok, SMOLLM2_PROMPTS)


def test_reference_serves_any_length_up_to_the_files(reference, tokenizer, validation_prompts):
    p = validation_prompts[0]
    ids = encode_prompt(tokenizer, p["task"], p["prompt"])
    full, short = reference.decoded(ids, TOKENS), reference.decoded(ids, 5)
    assert short.ids == full.ids[:5] and short.margins == full.margins[:5]
    with pytest.raises(KeyError, match="no reference for this prompt"):
        reference.decoded(ids[:-1], 5)
