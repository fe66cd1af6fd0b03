"""Folders written whole or not at all, and a lock per folder.

`replacing(target)` yields a temporary sibling folder to write into; when the block ends it is renamed into
place (the old folder renamed aside first, then removed), and when the block fails or the process is
killed, target is what it was. `locked(target)` holds `.<name>.lock` beside target (fcntl.flock: the lock
goes with the process, a kill -9 included), so two writers of one folder take turns; under it, the
leftovers of a killed writer are cleared: a half-written new folder removed, an old folder renamed aside
but not yet replaced put back.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

_held: dict[Path, int] = {}  # the locks this process holds -> how deep: locked() nests in one process


@contextmanager
def locked(target: Path) -> Iterator[None]:
    """Holds target's lock file for the block, waiting (and saying so) while another process holds it."""
    target = Path(target).absolute()
    if target in _held:
        _held[target] += 1
        try:
            yield
        finally:
            _held[target] -= 1
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process writing %s (it holds %s)", target, lock)
            fcntl.flock(f, fcntl.LOCK_EX)
        _held[target] = 1
        try:
            recover(target)
            yield
        finally:
            del _held[target]  # closing the file releases the lock


def recover(target: Path) -> None:
    """Clears what a killed writer of target left (called under its lock)."""
    for new in target.parent.glob(f".{target.name}.new-*"):
        shutil.rmtree(new)
    for old in target.parent.glob(f".{target.name}.old-*"):
        if target.exists():
            shutil.rmtree(old)
        else:  # killed between its two renames: the old folder is still the folder
            old.rename(target)
            logger.info("restored %s, which an interrupted write had moved aside", target)


@contextmanager
def replacing(target: Path, keep: bool = False, fresh: tuple[str, ...] = ()) -> Iterator[Path]:
    """A temporary sibling of target to write into, renamed into target when the block succeeds. keep: the
    new folder starts with hard links to the old one's files (what the block does not write stays), except
    the names in fresh, which the block writes (a hard link would be written through into the old file)."""
    target = Path(target).absolute()
    with locked(target):
        new = sibling(target, "new")
        new.mkdir()  # with the umask's permissions, as target's own mkdir would have
        try:
            if keep and target.is_dir():
                shutil.copytree(target, new, copy_function=os.link, dirs_exist_ok=True,
                                ignore=lambda d, names: [n for n in names if Path(d) == target and n in fresh])
            yield new
            swap(new, target)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise


def swap(new: Path, target: Path) -> None:
    if target.exists():
        old = sibling(target, "old")
        target.rename(old)
        new.rename(target)
        shutil.rmtree(old)
    else:
        new.rename(target)


def sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
