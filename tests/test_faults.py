"""Faults a user meets: a kill -9 mid-build and mid-save, a full disk, a truncated cache, two writers at once,
an --out that build must not delete. After each, nothing made earlier is lost and the next run recovers."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from builder.atomic import locked, sibling
from builder.errors import CheckpointError
from builder.models.llama import Llama, LlamaConfig, load_llama, load_state, save_llama
from tests.conftest import INHOUSE, ROOT, expect_error, run

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under directory -> the sha256 of its bytes."""
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.glob(f".{target.name}.*-*"))


def killed_mid_way(script: str, *args: str, flag: Path) -> None:
    """Runs script in a new Python, waits until it writes flag (it is then inside the write), and kills it -9."""
    p = subprocess.Popen([sys.executable, "-c", script, str(flag), *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not flag.exists():
            assert p.poll() is None, f"the process ended before the kill: {p.stderr.read()}"
            assert time.monotonic() < deadline, "the process never reached the write"
            time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL


def model(seed: int) -> Llama:
    m = Llama(TINY)
    m.init_weights(seed)
    return m


def same_weights(a: Llama, b: Llama) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ------------------------------------------------------------------ build never deletes what it did not make

@pytest.mark.parametrize("case", ["export", "checkout", "home", "foreign"])
def test_build_refuses_an_out_that_it_would_wrongly_delete(tmp_path, case):
    onnx = tmp_path / "build" / "onnx"
    onnx.mkdir(parents=True)
    (onnx / "keep.txt").write_text("hours of work")
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("mine")
    out, fragment = {"export": (tmp_path / "build", "holds the ONNX export"), "checkout": (ROOT, "holds the checkout"),
                     "home": (tmp_path / "home", "holds your home folder"),
                     "foreign": (tmp_path / "mine", "is not a site `build` made")}[case]
    before = snapshot(tmp_path)
    r = run("build", *INHOUSE, "--out", str(out), "--onnx-dir", str(onnx), env=env)
    expect_error(r, f"--out {out}", fragment)
    assert snapshot(tmp_path) == before and (ROOT / ".git").exists(), "build touched a folder it refused to replace"


def build_script(tiny, tiny_onnx) -> str:
    ckpts = json.dumps([str(tiny.base), str(tiny.head), str(tiny.drafter)])
    return f"""
import sys, time
from pathlib import Path
import builder.site.build as b
from builder.export.manifest import Checkpoints
render = b.render
def slow(out, manifest):  # the site half written: then the kill
    render(out, manifest)
    Path(sys.argv[1]).write_text("rendered")
    time.sleep(600)
b.render = slow
b.build(Checkpoints(*map(Path, {ckpts})), Path(sys.argv[2]), Path({str(tiny_onnx)!r}))
"""


def test_a_build_killed_mid_way_leaves_the_previous_site_and_the_next_build_recovers(tmp_path, tiny, tiny_onnx):
    from builder.site.build import SITE_MARKER, build

    site = tmp_path / "site"
    build(tiny, site, tiny_onnx)
    before = snapshot(site)
    assert SITE_MARKER in before and "index.html" in before
    killed_mid_way(build_script(tiny, tiny_onnx), str(site), flag=tmp_path / "flag")
    assert snapshot(site) == before, "the kill changed the previous site"
    assert leftovers(site), "the kill did not happen mid-build (no half-written site beside it)"
    build(tiny, site, tiny_onnx)  # a site build made: replaced; the killed build's folder cleared
    assert snapshot(site) == before and leftovers(site) == []


def test_a_full_disk_mid_build_leaves_the_previous_site(tmp_path, tiny, tiny_onnx, monkeypatch):
    import builder.site.build as b

    site = tmp_path / "site"
    b.build(tiny, site, tiny_onnx)
    before = snapshot(site)
    copies = []

    def copyfile(src, dst, *a, **kw):
        if len(copies) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        copies.append(dst)
        return shutil.copy(src, dst)

    monkeypatch.setattr(b.shutil, "copyfile", copyfile)
    with pytest.raises(OSError) as e:
        b.build(tiny, site, tiny_onnx)
    assert e.value.errno == errno.ENOSPC
    assert snapshot(site) == before and leftovers(site) == []


# ------------------------------------------------------------------ model saves: whole or not at all

SLOW_SAVE = """
import sys, time
from pathlib import Path
import safetensors.torch
from builder.models.llama import Llama, LlamaConfig, save_llama
save_file = safetensors.torch.save_file
def slow(state, path, metadata=None):  # the weights written, config.json too: then the kill
    save_file(state, path, metadata=metadata)
    Path(sys.argv[1]).write_text("saved")
    time.sleep(600)
safetensors.torch.save_file = slow
m = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1))
m.init_weights(2)
save_llama(m, Path(sys.argv[2]))
"""


def test_a_save_killed_mid_way_leaves_the_old_model_and_its_other_files(tmp_path):
    d = tmp_path / "base"
    save_llama(model(1), d)
    (d / "README.md").write_text("card")
    (d / "checkpoint").mkdir()
    (d / "checkpoint" / "state.pt").write_text("a resumable run")
    before = snapshot(d)
    killed_mid_way(SLOW_SAVE, str(d), flag=tmp_path / "flag")
    assert snapshot(d) == before and same_weights(load_llama(d), model(1))
    assert leftovers(d), "the kill did not happen mid-save"
    save_llama(model(2), d)  # the next save clears what the killed one left, and keeps the folder's other files
    assert same_weights(load_llama(d), model(2)) and leftovers(d) == []
    assert (d / "README.md").read_text() == "card" and (d / "checkpoint" / "state.pt").read_text() == "a resumable run"


def test_a_full_disk_mid_save_leaves_the_old_model(tmp_path, monkeypatch):
    import safetensors.torch

    d = tmp_path / "base"
    save_llama(model(1), d)
    before = snapshot(d)

    def full(state, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError):
        save_llama(model(2), d)
    assert snapshot(d) == before and leftovers(d) == []


def test_a_kill_between_the_two_renames_is_undone_by_the_next_writer(tmp_path):
    d = tmp_path / "export"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    d.rename(sibling(d, "old"))  # killed here: the old folder aside, the new one not yet in place
    sibling(d, "new").mkdir()
    with locked(d):
        assert (d / "manifest.json").read_text() == "{}" and leftovers(d) == []


def test_a_second_writer_of_an_export_waits_for_the_first(tmp_path, tiny, tiny_onnx):
    script = f"""
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from builder.export.manifest import Checkpoints, ensure_export
ensure_export(Checkpoints(Path({str(tiny.base)!r}), Path({str(tiny.head)!r}), Path({str(tiny.drafter)!r})), Path({str(tiny_onnx)!r}))
print("exported")
"""
    with locked(tiny_onnx):
        p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(8)
        assert p.poll() is None, f"the second writer did not wait: {p.communicate()}"
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == "exported", err
    assert f"waiting for another process writing {tiny_onnx}" in err


# ------------------------------------------------------------------ caches and checkpoints: damaged, then recovered

@pytest.fixture
def gguf_base(tmp_path, monkeypatch):
    """A checkpoint folder of an imported base whose import (materialize) writes a tiny model, counted."""
    import builder.models.gguf as gguf

    d = tmp_path / "base"
    d.mkdir()
    shutil.copyfile(ROOT / "models" / "base" / "gguf.json", d / "gguf.json")
    imports = []

    def materialize(directory):
        imports.append(directory)
        gguf.save_state({k: v for k, v in model(1).state_dict().items() if k != "lm_head.weight"}, directory)  # tied

    monkeypatch.setattr(gguf, "materialize", materialize)
    return d, imports


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "no check"])
def test_a_damaged_weights_cache_is_imported_again(gguf_base, damage):
    d, imports = gguf_base
    want = {k: v.clone() for k, v in load_state(d).items()}  # load_state may map the file
    load_state(d)
    assert len(imports) == 1, "an intact cache was imported again"
    w = d / "model.safetensors"
    if damage == "truncate":
        w.write_bytes(w.read_bytes()[:-1000])
    elif damage == "flip a byte":  # in the header (any byte there is checked)
        data = bytearray(w.read_bytes())
        data[20] ^= 0x01
        w.write_bytes(bytes(data))
    else:
        (d / "model.safetensors.check").unlink()
    got = load_state(d)
    assert len(imports) == 2 and all(torch.equal(got[k], want[k]) for k in want)


def test_a_full_disk_writing_the_weights_cache_leaves_no_half_file(tmp_path, monkeypatch):
    import safetensors.torch

    from builder.models.gguf import save_state

    def full(state, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(CheckpointError, match=r"cannot write .*model.safetensors \(No space left on device\): the imported "
                                              r"weights need \d+ MB free"):
        save_state({"w": torch.zeros(3)}, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_run_checkpoint_is_named_and_a_foreign_pickle_never_runs(tmp_path):
    from builder.train.loop import Run

    m = model(1)
    opt = torch.optim.AdamW(m.parameters())
    run_ = Run(tmp_path, {"seed": 0})
    run_.save(m, opt, run_.load(m, opt))
    state = tmp_path / "state.pt"
    state.write_bytes(state.read_bytes()[:-2000])
    with pytest.raises(CheckpointError, match="state.pt is unreadable .*--restart"):
        run_.load(m, opt)
    torch.save({"key": {"seed": 0}, "state": Exploit(tmp_path / "ran")}, state)  # a pickled call: refused
    with pytest.raises(CheckpointError, match="unreadable"):
        run_.load(m, opt)
    assert not (tmp_path / "ran").exists(), "loading the checkpoint ran its code"


class Exploit:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))
