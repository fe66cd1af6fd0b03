"""The command line as docs/contract.md writes it, and its errors: one line on stderr, non-zero, no traceback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from builder.contract import DEFAULT_K
from builder.data.tasks import ALL_TASKS, decode, encode_prompt, load_tokenizer
from tests.conftest import INHOUSE, BASE_DIR, CONTEXT, HEAD_DIR, ROOT, expect_error, run


def test_generate_json_has_the_contract_fields(base):
    r = run("generate", *INHOUSE, "--prompt", "The json module", "--max-new-tokens", "12", "--json", "--mode", "ar")
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    out = json.loads(line)
    # docs/contract.md's fields and those added since (commands.md), each with its value for plain decoding
    assert out.keys() == {"prompt", "task", "mode", "k", "backend", "prompt_ids", "ids", "text", "steps", "accepted",
                          "margins", "seconds", "lookup", "lookups", "draft_cut", "verified", "precision", "adapter",
                          "stopped"}
    assert (out["prompt"], out["task"], out["mode"], out["k"], out["backend"], out["precision"], out["adapter"]) == (
        "The json module", "continue", "ar", DEFAULT_K, "torch", "fp32", None)
    assert out["prompt_ids"] == encode_prompt(load_tokenizer(BASE_DIR), "continue", "The json module")
    assert 1 <= len(out["ids"]) <= 12 and out["steps"] == len(out["ids"]) == len(out["margins"])
    assert out["text"] == decode(load_tokenizer(BASE_DIR), out["ids"]) and out["text"]
    assert all(m >= 0 for m in out["margins"]) and out["seconds"] > 0
    assert out["stopped"] in ("end-of-sequence", "max-new-tokens") and (len(out["ids"]) == 12 or out["stopped"] == "end-of-sequence")
    # plain decoding: no drafts, one token verified a step
    assert out["accepted"] == [] and out["lookup"] is False and out["draft_cut"] == 0.0
    assert out["lookups"] == [] and out["verified"] == [1] * out["steps"]


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_generate_decodes_with_the_head_by_default_as_the_page_does():
    r = run("generate", *INHOUSE, "--prompt", "The json module", "--max-new-tokens", "12", "--json")
    ar = json.loads(run("generate", *INHOUSE, "--prompt", "The json module", "--max-new-tokens", "12", "--json", "--mode", "ar").stdout)
    out = json.loads(r.stdout)
    assert out["mode"] == "mtp" and out["k"] == 4 and out["ids"] == ar["ids"] and out["lookup"] is True
    assert len(out["accepted"]) == len(out["lookups"]) == out["steps"] < len(out["ids"]) == len(out["margins"])
    alone = json.loads(run("generate", *INHOUSE, "--prompt", "The json module", "--max-new-tokens", "12", "--json",
                           "--no-lookup").stdout)
    assert alone["ids"] == ar["ids"] and alone["lookup"] is False and not any(alone["lookups"])
    np.testing.assert_allclose(out["margins"], ar["margins"], atol=1e-4)  # the base's own, from its verify passes


def test_prompts_file_gives_one_object_per_prompt_in_order(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Lists are"}\n\n{"prompt": "Teh list is sorted.", "task": "proofread"}\n')
    r = run("generate", *INHOUSE, "--prompts-file", str(f), "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in r.stdout.splitlines()]
    assert [(o["prompt"], o["task"]) for o in rows] == [("Lists are", "continue"), ("Teh list is sorted.", "proofread")]


def test_empty_prompt_is_a_clear_error():
    expect_error(run("generate", *INHOUSE, "--prompt", "  "), "empty")


def test_prompt_too_long_for_the_context_window_is_a_clear_error():
    expect_error(run("generate", *INHOUSE, "--prompt", "word " * (CONTEXT + 40)), f"context window of {CONTEXT} tokens", "shorten it")


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_new_tokens_are_clamped_to_the_context_window_and_the_stop_says_so():
    r = run("generate", *INHOUSE, "--prompt", "word " * (CONTEXT - 6), "--max-new-tokens", "1000", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # the shipped base goes on repeating "word" here: it stops only where the window is full
    assert out["stopped"] == "context-window", out
    assert len(out["prompt_ids"]) + len(out["ids"]) == CONTEXT
    r = run("generate", *INHOUSE, "--prompt", "word " * (CONTEXT - 6), "--max-new-tokens", "1000")
    assert r.returncode == 0 and r.stderr.strip() in (
        f"[stopped: the prompt and the new tokens fill the context window of {CONTEXT} tokens]", "[the model ended the text]")


@pytest.mark.parametrize("args, fragments", [
    (["--max-new-tokens", "0"], ["--max-new-tokens: must be a whole number of at least 1, got '0'"]),
    (["--max-new-tokens", "-3"], ["--max-new-tokens"]),
    (["--max-new-tokens", "many"], ["'many'"]),
    (["--mode", "mtp", "--k", "0"], ["--k must be between 1 and", "got 0"]),
    (["--mode", "drafter", "--k", "17"], ["--k must be between 1 and 16", "got 17"]),
    (["--mode", "mtp", "--k", "7", "--backend", "onnx"], ["--k must be", " 6 ", "got 7"]),  # the head drafts 6
    (["--mode", "mtp", "--k", "7"], ["--k must be", " 6 ", "got 7"]),  # torch too: the head was trained for 6
    (["--mode", "fast"], ["invalid choice: 'fast'"]),
    (["--draft-cut", "1"], ["--draft-cut: must be a number from 0 (no cut) up to 1, got '1'"]),
    (["--draft-cut", "sure"], ["got 'sure'"]),
    (["--backend", "onnx", "--precision", "q4"], ["has no q4 graphs", "only a base imported from a GGUF"]),
    (["--precision", "q4"], ["--precision q4 needs --backend onnx"]),
])
def test_out_of_range_options_are_a_clear_error(args, fragments, onnx_dir):
    expect_error(run("generate", *INHOUSE, "--prompt", "hi", "--onnx-dir", str(onnx_dir), *args), *fragments)


def test_odd_text_is_decoded_as_text(tmp_path, tokenizer):
    """Emoji, CJK, right-to-left script, control characters, markup and a lone surrogate (documented
    clamp: replaced by U+FFFD, as the page does) all decode; the prompt ids are the text's own."""
    from builder.data.tasks import encode_prompt

    texts = ["Emoji 😀👍🏽 and 中文字符 and עברית and العربية", "tab\there\r\nbell\x07 nul\x00 end",
             "<script>alert(1)</script><img src=x onerror=alert(2)>", "half a pair \ud83d here",
             "<|fix|> is text"]
    f = tmp_path / "odd.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))  # JSON escapes keep the lone surrogate
    r = run("generate", *INHOUSE, "--prompts-file", str(f), "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == len(texts)
    for row, text in zip(rows, texts):
        assert row["prompt_ids"] == encode_prompt(tokenizer, "continue", text.replace("\ud83d", "\ufffd"))
        assert 1 <= len(row["ids"]) <= 4


def test_unknown_task_is_a_clear_error():
    r = run("generate", *INHOUSE, "--prompt", "hi", "--task", "summarise")
    expect_error(r, "--task", "'summarise'", *(repr(task) for task in ALL_TASKS))  # the tasks to choose from
    assert r.returncode == 2, "an unknown task is a usage error (exit 2)"
    # a task that exists but that this base does not offer (reply needs a chat base): refused, naming its tasks
    r = run("generate", *INHOUSE, "--prompt", "hi", "--task", "reply")
    expect_error(r, "does not offer the task 'reply'", "continue, proofread, summarize")
    assert r.returncode == 1 and r.stdout == "", "refused before decoding anything"


def test_bad_line_in_prompts_file_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "", "task": "continue"}\n')
    expect_error(run("generate", *INHOUSE, "--prompts-file", str(f)), "prompt 2", "empty")
    f.write_text('{"prompt": "ok"}\nnot json\n')
    expect_error(run("generate", *INHOUSE, "--prompts-file", str(f)), "p.jsonl:2")


def test_missing_checkpoint_directory_is_a_clear_error(tmp_path):
    expect_error(run("generate", "--prompt", "hi", "--base", str(tmp_path / "nope")), "not found")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "remove"])
def test_corrupt_or_missing_weights_are_a_clear_error(tmp_path, damage):
    d = tmp_path / "base"
    shutil.copytree(BASE_DIR, d)
    w = d / "model.safetensors"
    if damage == "truncate":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "garbage":
        w.write_bytes(b"\x00" * 4096)
    else:
        w.unlink()
    expect_error(run("generate", "--prompt", "hi", "--base", str(d)), "model.safetensors")


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_a_head_trained_for_another_base_is_refused(tmp_path):
    """The same architecture with one weight changed is another base: the head's fingerprint check fails."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "base"
    shutil.copytree(BASE_DIR, d)
    weights = load_file(d / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 0.01
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    expect_error(run("generate", "--prompt", "hi", "--base", str(d), "--mode", "mtp"), "trained for another base")
    assert run("generate", "--prompt", "hi", "--base", str(d), "--max-new-tokens", "2", "--mode", "ar").returncode == 0


@pytest.mark.parametrize("damage", ["alter", "remove"])
def test_an_onnx_file_that_does_not_match_the_manifest_is_a_clear_error(tmp_path, onnx_dir, damage):
    d = tmp_path / "onnx"
    shutil.copytree(onnx_dir, d)
    f = d / "head_k4.onnx"
    if damage == "alter":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        f.unlink()
    expect_error(run("generate", *INHOUSE, "--prompt", "hi", "--mode", "mtp", "--backend", "onnx", "--onnx-dir", str(d)),
                 "head_k4.onnx", "sha256 mismatch" if damage == "alter" else "missing")


def test_corrupt_tokenizer_is_a_clear_error(tmp_path):
    d = tmp_path / "base"
    shutil.copytree(BASE_DIR, d)
    (d / "tokenizer.json").write_text("{ not json")
    expect_error(run("generate", "--prompt", "hi", "--base", str(d), "--head", str(HEAD_DIR)), "tokenizer.json")


def test_a_prompts_file_that_is_not_utf8_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    expect_error(run("generate", *INHOUSE, "--prompts-file", str(f)), "p.jsonl:2:", "not UTF-8", "0xe9")


def base_with(tmp_path, files: dict[str, str]) -> str:
    """A copy of the shipped base (its files linked) with some files replaced: name -> text."""
    d = tmp_path / "base"
    d.mkdir()
    for f in BASE_DIR.iterdir():
        (d / f.name).symlink_to(f)
    for name, text in files.items():
        (d / name).unlink(missing_ok=True)
        (d / name).write_text(text)
    return str(d)


@pytest.mark.parametrize("change, fragments", [
    ({"vocab_size": None}, ["config.json lacks vocab_size"]),
    ({"hidden_size": "256"}, ["config.json: hidden_size is '256', not a whole number above 0"]),
    ({"num_attention_heads": 0}, ["num_attention_heads is 0"]),
    ({"tie_word_embeddings": "yes"}, ["tie_word_embeddings is 'yes', not true or false"]),
    ({"rms_norm_eps": [1e-5]}, ["rms_norm_eps is [1e-05], not a number above 0"]),
])
def test_a_config_with_a_missing_key_or_a_wrong_type_is_a_clear_error(tmp_path, change, fragments):
    cfg = json.loads((BASE_DIR / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **change}.items() if v is not None}
    d = base_with(tmp_path, {"config.json": json.dumps(cfg)})
    expect_error(run("generate", "--prompt", "hi", "--base", d, "--mode", "ar"), str(tmp_path), *fragments)


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_a_gguf_json_that_is_not_json_is_a_clear_error(tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    shutil.copyfile(ROOT / "models" / "base" / "config.json", d / "config.json")
    (d / "gguf.json").write_text('{"file": "x.gguf", ')
    expect_error(run("generate", "--prompt", "hi", "--base", str(d), "--mode", "ar"), "gguf.json is not valid JSON")
    (d / "gguf.json").write_text('{"file": "x.gguf"}')
    expect_error(run("generate", "--prompt", "hi", "--base", str(d), "--mode", "ar"), "gguf.json lacks sha256, fingerprint")


@pytest.mark.parametrize("template, fragments", [
    ("{{ raise_exception('no system role') }}", ["chat template fails", "UndefinedError"]),
    ("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools.names }}", ["chat template fails", "'tools' is undefined"]),
    ("{% for m in messages %}{{ m.content - 1 }}{% endfor %}", ["chat template fails", "TypeError"]),
    ("<|im_start|>assistant\n", ["leaves out the user's message"]),
])
def test_a_chat_template_that_fails_is_a_clear_error(tmp_path, template, fragments):
    d = base_with(tmp_path, {"tokenizer_config.json": json.dumps({"chat_template": template})})
    expect_error(run("generate", "--prompt", "hi", "--base", d, "--mode", "ar", "--max-new-tokens", "2"), *fragments)


def test_a_full_disk_on_the_output_is_one_line():
    """stdout on a full disk: /dev/full fails every write with ENOSPC."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "builder", "generate", *INHOUSE, "--prompt", "The json module",
                            "--max-new-tokens", "4", "--json"], cwd=ROOT, stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=300)
    expect_error(r, "no space left on the device writing the output")


@pytest.mark.slow  # over 5 s on the 2-core machine (the quick run stays under 3 minutes)
def test_undecodable_command_line_bytes_are_replaced_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "builder", "generate", "--prompt", b"caf\xe9 ok", "--max-new-tokens", "2",
                        "--json"], cwd=ROOT, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["prompt"] == "caf\ufffd ok"


def test_a_reader_that_closes_the_output_gets_no_traceback():
    """`generate --json | head -c 100`: the reader goes away before the output is written. The pipe's read end
    is closed before the command starts, so every write to it fails (EPIPE), deterministically."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "builder", "generate", *INHOUSE, "--prompt", "The json module",
                            "--max-new-tokens", "4", "--json"], cwd=ROOT, stdout=write, stderr=subprocess.PIPE,
                           text=True, timeout=300)
    finally:
        os.close(write)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr


@pytest.mark.parametrize("port", ["65536", "-1", "http"])
def test_a_bad_port_is_a_usage_error(tmp_path, port):
    r = run("serve", "--dir", str(tmp_path), "--port", port)
    expect_error(r, "--port", f"between 0 and 65535, got {port!r}")
    assert r.returncode == 2, "a bad option value is a usage error (exit 2)"


def test_a_missing_chromium_is_a_clear_error_before_any_measurement(tmp_path):
    r = run("bench", *INHOUSE, "--runtimes", "torch,browser-wasm", "--json", str(tmp_path / "bench.json"),
            env={"PATH": str(tmp_path), "HOME": str(tmp_path)})
    expect_error(r, "chromium is not installed")
    assert not (tmp_path / "bench.json").exists()


def test_bench_peers_need_a_gguf_base_and_known_names():
    expect_error(run("bench", *INHOUSE, "--peers", "llamacpp"), "--peers", "gguf.json")
    expect_error(run("bench", "--peers", "ollama"), "unknown peer ollama", "wllama")
