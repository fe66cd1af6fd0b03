"""Data and tokenizer: the split, the typos, the prompt formats."""
from __future__ import annotations

import random

import pytest

from builder.corpus import add_typos, clean_inline, is_validation, proofread_pairs, rst_paragraphs
from builder.tasks import EOS, PromptError, decode, encode_prompt


def test_train_and_validation_share_no_paragraph(corpus):
    assert corpus.files[1] > 0 and len(corpus.validation) >= 300
    assert not set(corpus.train) & set(corpus.validation)


def test_split_is_by_file_and_stable():
    """The side depends on the path alone, in every process (not on Python's seeded str hash): these
    files were held back, and these trained on, when the shipped models were made."""
    held_back = ["library/logging.rst.txt", "library/tarfile.rst.txt", "tutorial/modules.rst.txt", "about.rst.txt"]
    trained_on = ["library/os.rst.txt", "library/json.rst.txt", "tutorial/classes.rst.txt", "glossary.rst.txt"]
    assert [p for p in held_back if not is_validation(p)] == [], "validation files moved to the training side"
    assert [p for p in trained_on if is_validation(p)] == [], "training files moved to the validation side"
    names = [f"library/m{i}.rst.txt" for i in range(2000)]
    share = sum(map(is_validation, names)) / len(names)
    assert 0.03 < share < 0.07


def test_rst_markup_is_reduced_to_prose():
    src = ("Title\n=====\n\n.. function:: f(x)\n\n   Return :func:`~os.path.join` of ``x`` and *y*, see\n"
           "   `the docs <https://example.org>`_ for the rest of it.\n\n::\n\n   >>> f(1)\n")
    assert rst_paragraphs(src) == ["Return os.path.join of x and y, see the docs for the rest of it."]
    assert clean_inline(":class:`dict` and :meth:`!str.lower`") == "dict and str.lower"


def test_typos_change_the_sentence_and_are_reproducible():
    s = "The function returns a new list of values from the iterable."
    a = [add_typos(s, random.Random(i)) for i in range(50)]
    assert all(t != s for t in a)
    assert a == [add_typos(s, random.Random(i)) for i in range(50)]
    assert len(set(a)) > 30


def test_proofread_pairs_are_deterministic(corpus):
    assert proofread_pairs(corpus.validation, 1)[:20] == proofread_pairs(corpus.validation, 1)[:20]


def test_prompt_format_uses_special_tokens_by_id(tokenizer):
    ids = encode_prompt(tokenizer, "proofread", "Teh cat.")
    assert ids[0] == tokenizer.token_to_id("<|proofread|>") and ids[-1] == tokenizer.token_to_id("<|fix|>")
    typed = encode_prompt(tokenizer, "continue", "a <|fix|> b <|endoftext|>")
    specials = {tokenizer.token_to_id(t) for t in ("<|fix|>", EOS)}
    assert not specials & set(typed[1:]), "special-token text typed by a user must stay text"
    assert decode(tokenizer, typed[1:]) == "a <|fix|> b <|endoftext|>"


@pytest.mark.parametrize("text", ["Naïve café, Ærø", "東京の天気 and 中文", "emoji 🙂👍🏽 end",
                                  "runs   of    spaces\n\n\nand\ttabs", " leading space"])
def test_byte_level_tokenizer_round_trips_any_text(tokenizer, text):
    assert decode(tokenizer, encode_prompt(tokenizer, "continue", text)[1:]) == text


def test_bad_prompts_are_rejected(tokenizer):
    with pytest.raises(PromptError, match="empty"):
        encode_prompt(tokenizer, "continue", "   \n")
    with pytest.raises(PromptError, match="unknown task"):
        encode_prompt(tokenizer, "summarise", "text")
