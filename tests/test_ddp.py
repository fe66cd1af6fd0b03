"""train-head under torchrun: two CPU processes (gloo) train what one process trains with the same batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from builder.models.llama import save_llama
from tests.conftest import ROOT, run
from tests.test_mtp import tiny_setup

pytestmark = pytest.mark.slow  # two trainings of a head, one of them under torchrun


def test_two_processes_train_the_head_one_process_trains(corpus, tmp_path):
    tiny, _, small = tiny_setup(corpus, tmp_path / "base")
    save_llama(tiny, tmp_path / "base")
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(small.train + small.validation), encoding="utf-8")
    args = ["train-head", "--base", str(tmp_path / "base"), "--data", str(data), "--steps", "12",
            "--prompts-per-task", "13", "--batch-size", "4", "--eval-prompts", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = run(*args, "--head", str(tmp_path / "one"), env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "builder", *args, "--head", str(tmp_path / "two")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "x 2 processes" in two.stderr and two.stdout.count("wrote") == 1, "rank 0 alone reports"
    logs = [json.loads((tmp_path / d / "train_log.json").read_text()) for d in ("one", "two")]
    assert [g["processes"] for g in logs] == [1, 2] and logs[0]["sequences"] == logs[1]["sequences"]
    assert abs(logs[0]["final_loss"] - logs[1]["final_loss"]) < 1e-3 * logs[0]["final_loss"]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-4, rtol=1e-3), \
            f"{name}: two processes differ from one by {(a[name] - b[name]).abs().max():.2e}"
