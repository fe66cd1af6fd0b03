"""The parity file (tests/reference.py) is what it stands for: the PyTorch base's own greedy decoding."""
import json

import numpy as np
import pytest

from builder.data.tasks import encode_prompt
from builder.decode.torch_backend import decode_ar
from builder.models.head import base_fingerprint
from tests.reference import PER_TASK, TOKENS, path_for


@pytest.mark.slow
def test_the_parity_file_holds_the_torch_reference_of_the_shipped_base(base, tokenizer, validation_prompts):
    data = json.loads(path_for(base_fingerprint(base)).read_text())
    assert data["tokens"] == TOKENS and len(data["prompts"]) == len(validation_prompts) == PER_TASK * len(tokenizer.tasks)
    for entry, p in zip(data["prompts"], validation_prompts):
        assert (entry["task"], entry["prompt"]) == (p["task"], p["prompt"]), "the file's prompts are the tests' prompts"
        out = decode_ar(base, entry["prompt_ids"], len(entry["ids"]) if entry["stopped"] != "end-of-sequence" else TOKENS,
                        base.config.eos_token_id)
        assert out.ids == entry["ids"], f"{p['task']} {p['prompt'][:40]!r}: the base no longer decodes the file's ids"
        # margins to 1e-4 (a few ulps of logits near 10: the matmul kernels may differ by alignment); the
        # near-tie rule reads them at 1e-3
        np.testing.assert_allclose(out.margins, entry["margins"], atol=1e-4)


def test_reference_serves_any_length_up_to_the_files(reference, tokenizer, validation_prompts):
    p = validation_prompts[0]
    ids = encode_prompt(tokenizer, p["task"], p["prompt"])
    full, short = reference.decoded(ids, TOKENS), reference.decoded(ids, 5)
    assert short.ids == full.ids[:5] and short.margins == full.margins[:5]
    with pytest.raises(KeyError, match="no reference for this prompt"):
        reference.decoded(ids[:-1], 5)
