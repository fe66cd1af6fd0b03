"""Data and tokenizer: the split, the typos, the prompt formats."""
from __future__ import annotations

import json
import random

import pytest

from builder.data.corpus import add_typos, clean_inline, is_validation, proofread_pairs, rst_paragraphs
from builder.data.tasks import EOS, decode, encode_prompt
from builder.errors import PromptError


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


def test_proofread_pairs_are_the_same_in_every_process_and_differ_by_seed(corpus):
    """Training data must not depend on the process (Python salts str hashes per process: a set's order
    differs): another interpreter with another hash seed makes the very same pairs."""
    import subprocess
    import sys

    code = ("import json; from builder.data.corpus import load_corpus, proofread_pairs; "
            "print(json.dumps(proofread_pairs(load_corpus().validation, 1)[:20]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": "12345"})
    here = proofread_pairs(corpus.validation, 1)[:20]
    assert [list(p) for p in here] == json.loads(other.stdout)
    assert here != proofread_pairs(corpus.validation, 2)[:20], "the seed chooses the typos"


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


def test_html_keeps_prose_and_headings_and_drops_code_tables_and_navigation():
    from builder.data.corpus import html_sections

    page = """<html><body><div class="sphinxsidebar"><p>Navigation text that is long enough to look like a paragraph.</p></div>
    <h1>9.7. Pattern Matching<a class="headerlink" href="#x">¶</a></h1>
    <p>There are three separate approaches to pattern matching provided by the <code>LIKE</code> operator.</p>
    <pre>SELECT 'abc' LIKE 'abc';    -- a code block that ends with a period.</pre>
    <table><tr><td>A table cell that is long enough to look like a paragraph of prose.</td></tr></table>
    <h2>Second &amp; last</h2><div class="para">Publican writes its paragraphs as divisions, and they are prose too.</div>
    </body></html>"""
    assert html_sections(page) == [
        ("Pattern Matching", ["There are three separate approaches to pattern matching provided by the LIKE operator."]),
        ("Second & last", ["Publican writes its paragraphs as divisions, and they are prose too."])]


def test_pod_keeps_prose_and_reduces_formatting_codes():
    from builder.data.corpus import pod_sections

    pod = ("package Foo;\nuse strict;\n\n=head1 NAME\n\nFoo - a module\n\n=head2 How do I sort a hash by value?\n\n"
           "Use the B<sort> function with C<< $a <=> $b >> and see L<perlfunc/sort> for the details of it.\n\n"
           "    my @keys = sort { $h{$a} <=> $h{$b} } keys %h;\n\n=cut\n\nsub foo { 1 }\n\n"
           "This code paragraph comes after the cut and is not documentation at all.\n")
    assert pod_sections(pod) == [("How do I sort a hash by value?",
                                  ["Use the sort function with $a <=> $b and see perlfunc sort for the details of it."])]


def test_rst_sections_keep_their_headings(corpus):
    from builder.data.corpus import rst_sections

    src = ("Title of it\n===========\n\nThe first paragraph is long enough to count as prose, it ends here.\n\n"
           "Another one\n-----------\n\nThe second section also has a paragraph long enough to be prose.\n")
    assert [h for h, _ in rst_sections(src)] == ["Title of it", "Another one"]
    assert corpus.train_sections and sum(len(p) for _, p in corpus.validation_sections) == len(corpus.validation)


def test_summary_pairs_are_a_passage_and_its_heading(corpus):
    from builder.data.corpus import PASSAGE_CHARS, summary_pairs

    pairs = summary_pairs(corpus.train_sections)
    assert len(pairs) > 300
    for passage, title in pairs[:200]:
        assert PASSAGE_CHARS[0] <= len(passage) <= PASSAGE_CHARS[1] and len(title.split()) >= 3
    repeated = [("Return values of it", ["x" * 500]), ("Return values of it", ["y" * 500])]
    assert summary_pairs(repeated) == [], "a heading used by several sections summarizes none of them"


def test_other_sources_leave_pythons_validation_text_in_validation(tmp_path, monkeypatch, corpus):
    from builder.data import corpus as corpus_module

    (tmp_path / "a.html").write_text("<p>" + " ".join(["Some other documentation prose."] * 3) + "</p>")
    (tmp_path / "b.html").write_text("<p>" + corpus.validation[0] + "</p>")  # Python's text in another source
    monkeypatch.setitem(corpus_module.SOURCES, "other-doc", corpus_module.Source("other-doc", str(tmp_path), "*.html", "html", "test"))
    both = corpus_module.load_corpus(("python3.11-doc", "other-doc"))
    assert set(corpus.validation) <= set(both.validation) | set(both.train)
    assert set(corpus.validation) - {corpus.validation[0]} <= set(both.validation), "Python's validation files moved"
    assert not set(both.train) & set(both.validation)
    assert both.sources["other-doc"]["train_files"] + both.sources["other-doc"]["validation_files"] == 2


def test_summarize_prompt_format(tokenizer, tmp_path):
    from builder.data.tasks import prompt_formats
    from builder.train.base import train_tokenizer

    from tokenizers import Tokenizer

    from builder.data.tasks import TaskTokenizer

    ids = encode_prompt(tokenizer, "summarize", "A passage.")  # the shipped base offers the task
    assert ids[0] == tokenizer.token_to_id("<|summarize|>") and ids[-1] == tokenizer.token_to_id("<|summary|>")
    # a tokenizer of builder's kind without the summarize markers (as the first base had) does not
    old = Tokenizer.from_str(tokenizer.to_str().replace("<|summarize|>", "<|a|>").replace("<|summary|>", "<|b|>"))
    old = TaskTokenizer(old, prompt_formats(old, None))
    assert set(old.tasks) == {"continue", "proofread"}
    with pytest.raises(PromptError, match="does not offer"):
        encode_prompt(old, "summarize", "A passage.")
    tok = train_tokenizer(["Some text to learn a few merges from."] * 5, 300)
    tok.tasks = prompt_formats(tok, None)
    ids = encode_prompt(tok, "summarize", "A passage.")
    assert ids[0] == tok.token_to_id("<|summarize|>") and ids[-1] == tok.token_to_id("<|summary|>")


def test_real_messages_are_split_into_held_back_and_training():
    """data/messages.py: the 48 held-back messages are the ones results.md's reply-on-messages numbers were measured
    on (their digest), and training never draws one of them; a base without a reply task gets a clear error."""
    from builder.data.corpus import Corpus, prompts_digest
    from builder.data.messages import held_back, messages, training_messages
    from builder.data.tasks import load_tokenizer
    from builder.errors import CheckpointError
    from builder.train.distill import training_prompts

    held, train = held_back(), training_messages()
    assert len(held) == len(set(held)) == 48 and all(len(m.split()) >= 4 for m in held)
    assert not set(held) & set(train) and len(held) + len(train) == len(messages()) > 1000
    assert prompts_digest([{"task": "reply", "prompt": m} for m in held]) == "85629800c90f9b4e"
    assert held_back(5) == held[:5]

    tok = load_tokenizer("models/base")  # SmolLM2's: it offers reply
    none = Corpus(train=[], validation=[], files=(0, 0), train_sections=[], validation_sections=[])
    prompts = training_prompts(tok, none, 0, seed=3, chat=20)
    encoded = {tuple(encode_prompt(tok, "reply", m)): m for m in messages()}
    drawn = [encoded[tuple(p)] for p in prompts]  # every prompt is a message in the reply format
    assert len(set(drawn)) == 20 and not set(drawn) & set(held)
    assert prompts == training_prompts(tok, none, 0, seed=3, chat=20) != training_prompts(tok, none, 0, seed=4, chat=20)
    with pytest.raises(CheckpointError, match="no reply task"):
        training_prompts(load_tokenizer("models/inhouse/base"), none, 0, seed=3, chat=1)
