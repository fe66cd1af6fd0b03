"""The command line as CONTRACT.md writes it, and its errors: one line on stderr, non-zero, no traceback."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import BASE_DIR, ROOT


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_generate_json_has_the_contract_fields(base):
    r = run("generate", "--prompt", "The json module", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    out = json.loads(line)
    assert {"prompt", "task", "mode", "k", "backend", "prompt_ids", "ids", "text", "steps", "accepted",
            "margins", "seconds"} <= out.keys()
    assert out["mode"] == "ar" and out["backend"] == "torch" and out["task"] == "continue"
    assert 1 <= len(out["ids"]) <= 12 and out["steps"] == len(out["ids"]) == len(out["margins"])
    assert out["accepted"] == [] and out["text"]


def test_prompts_file_gives_one_object_per_prompt_in_order(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Lists are"}\n\n{"prompt": "Teh list is sorted.", "task": "proofread"}\n')
    r = run("generate", "--prompts-file", str(f), "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in r.stdout.splitlines()]
    assert [(o["prompt"], o["task"]) for o in rows] == [("Lists are", "continue"), ("Teh list is sorted.", "proofread")]


def expect_error(r, *fragments):
    assert r.returncode != 0, f"expected failure, got success: {r.stdout}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{r.stderr}"
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"


def test_empty_prompt_is_a_clear_error():
    expect_error(run("generate", "--prompt", "  "), "empty")


def test_prompt_that_leaves_no_room_is_a_clear_error():
    expect_error(run("generate", "--prompt", "word " * 300), "context window")
    expect_error(run("generate", "--prompt", "hi", "--max-new-tokens", "1000"), "context window")


def test_unknown_task_is_a_clear_error():
    expect_error(run("generate", "--prompt", "hi", "--task", "summarise"), "summarise")


def test_bad_line_in_prompts_file_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "", "task": "continue"}\n')
    expect_error(run("generate", "--prompts-file", str(f)), "prompt 2", "empty")
    f.write_text('{"prompt": "ok"}\nnot json\n')
    expect_error(run("generate", "--prompts-file", str(f)), "p.jsonl:2")


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


def test_corrupt_tokenizer_is_a_clear_error(tmp_path):
    d = tmp_path / "base"
    shutil.copytree(BASE_DIR, d)
    (d / "tokenizer.json").write_text("{ not json")
    expect_error(run("generate", "--prompt", "hi", "--base", str(d)), "tokenizer.json")
