"""Bring your own model: a Llama and a Qwen2 checkpoint made with transformers here (random weights, a
tokenizer trained on the fly; nothing downloaded), a head trained for each with `train-head --data`,
the site built with `build --base --head`, and the page's output equal to the Python reference."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from builder.data.corpus import load_text_corpus, prompts_digest, validation_prompts
from builder.decode.loop import compare_to_reference
from builder.decode.torch_backend import decode_ar
from builder.models.llama import load_llama
from builder.models.head import base_fingerprint
from builder.data.tasks import encode_prompt, load_tokenizer
from tests.conftest import Page, run

pytestmark = pytest.mark.slow  # every test needs the fixture's two heads, trained (91 s each alone on 2 cores)

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
              initializer_range=0.2)
PROMPTS = [("continue", "The dictionary maps each key to"), ("proofread", "Teh list is sortd in place.")]


def make_checkpoint(kind: str, directory, texts: list[str]) -> None:
    """A randomly initialised transformers checkpoint with a byte-level BPE tokenizer trained on texts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"], special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    extra = {"llama": dict(tie_word_embeddings=False), "qwen2": dict(tie_word_embeddings=True, rope_theta=1e6)}[kind]
    torch.manual_seed(3)
    model = model_class(config(**CONFIG, **extra)).eval()
    with torch.no_grad():  # weak attention: the next token depends mostly on the last few, so a head trained
        for layer in model.model.layers:  # for seconds drafts some right and the page's accepting path runs
            layer.self_attn.o_proj.weight.mul_(0.05)
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def byo(request, corpus, tmp_path_factory):
    """(kind, base dir, head dir, site dir, train-head's stdout) for one kind of checkpoint."""
    root = tmp_path_factory.mktemp(request.param)
    base_dir, head_dir, site = root / "base", root / "head", root / "site"
    make_checkpoint(request.param, base_dir, corpus.train[:2000])
    data = root / "my_text.txt"
    data.write_text("\n\n".join(corpus.train[2000:2400]), encoding="utf-8")  # the user's own text
    trained = run("train-head", "--base", str(base_dir), "--head", str(head_dir), "--data", str(data),
                  "--steps", "40", "--prompts-per-task", "32", "--batch-size", "8", "--eval-prompts", "4",
                  timeout=900)  # 91 s alone on 2 cores; a busy machine takes several times that
    assert trained.returncode == 0, trained.stderr[-2000:]
    built = run("build", "--base", str(base_dir), "--head", str(head_dir), "--out", str(site),
                "--onnx-dir", str(root / "onnx"))
    assert built.returncode == 0, built.stderr[-2000:]
    return request.param, base_dir, head_dir, site, trained.stdout


def test_builder_logits_match_transformers(byo):
    kind, base_dir, *_ = byo
    hf = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    hf = hf.from_pretrained(base_dir, attn_implementation="eager").eval()
    ours = load_llama(base_dir)
    ids = torch.tensor([encode_prompt(load_tokenizer(base_dir), task, text) for task, text in PROMPTS[:1]])
    with torch.no_grad():
        diff = (ours(ids)[0] - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, f"{kind}: logits differ from transformers by {diff}"


def test_train_head_reports_tau_and_leaves_the_base_alone(byo):
    kind, base_dir, head_dir, _, stdout = byo
    assert "tau on held-back text" in stdout and "continue  k=4" in stdout and "proofread k=6" in stdout
    log = json.loads((head_dir / "train_log.json").read_text())
    assert log["device"] == "cpu" and log["data"].endswith("my_text.txt") and log["resumed_at_step"] == 0
    assert not (head_dir / "checkpoint").exists(), "the checkpoint is removed once the head is saved"
    # which held-back prompts the card's tau table was measured on: the user's text's, 4 per task (--eval-prompts)
    held_back = load_text_corpus(log["data"])
    prompts = validation_prompts(held_back, min(4, len(held_back.validation)), tasks=tuple(load_tokenizer(base_dir).tasks))
    digest = log["acceptance_prompts_sha256"]
    assert digest == prompts_digest(prompts), "the digest is not that of the prompts tau was measured on"
    assert f"(task, prompt) pairs `{digest}`" in (head_dir / "README.md").read_text()
    config = json.loads((head_dir / "config.json").read_text())
    assert config["base_fingerprint"] == base_fingerprint(load_llama(base_dir))  # the base file is unchanged


def test_the_prompt_format_is_plain_text_after_bos(byo):
    _, base_dir, _, site, _ = byo
    tok = load_tokenizer(base_dir)
    ids = encode_prompt(tok, "proofread", "Teh cat.")
    assert ids[0] == 0 and tok.decode(ids[1:]) == "Correct the spelling mistakes in this sentence.\nSentence: Teh cat.\nCorrected:"
    manifest = json.loads((site / "models" / "manifest.json").read_text())
    assert manifest["tasks"] == tok.tasks and manifest["special_tokens"] == {"<s>": 0, "</s>": 1}
    graphs = {name: set(p["graphs"]) for name, p in manifest["precisions"].items()}
    assert manifest["drafter"] is None and graphs["fp16"] == graphs["fp32"], graphs  # build's default: both


def test_page_equals_python_reference_on_wasm(byo, browser):
    kind, base_dir, head_dir, site, _ = byo
    from builder.site.browser import served

    base, tok = load_llama(base_dir), load_tokenizer(base_dir)
    with served(site) as url:
        page = Page(browser, url, "index.html?backend=wasm")
        try:
            assert page.info["backend"] == "wasm" and page.info["modes"] == ["ar", "mtp"], page.info
            accepted = []
            for task, text in PROMPTS:
                prompt_ids = encode_prompt(tok, task, text)
                ref = decode_ar(base, prompt_ids, 24, base.config.eos_token_id)
                for mode in ("ar", "mtp"):
                    # no draft cut: this test's briefly trained heads are rarely sure of a draft, and the
                    # accepting path is what it checks (the cut: test_speculative, test_site)
                    r = page.generate(prompt=text, task=task, mode=mode, k=3, maxNewTokens=24, draftCut=0)
                    assert r["promptIds"] == prompt_ids
                    verdict, where = compare_to_reference(ref, r["ids"])
                    assert verdict == "equal", f"{kind} {task} {mode}: {verdict} at {where}"
                    accepted += r["accepted"]
            assert sum(accepted) > 0, "no draft was accepted: the accepting path did not run"
            assert page.errors == [], page.errors
        finally:
            page.close()
