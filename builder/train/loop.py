"""One training loop for the base, the head and the drafter, with one checkpoint policy.

`train` runs AdamW steps: the learning rate of the step (`Schedule`), the caller's loss for the step
(`step_loss(step)`, whose batch is a function of the step, so that a resumed run sees the same data as
one never stopped), backward, gradient clipping at 1.0, a progress bar with the running loss.

A run lives in a run directory: `state.pt` holds the weights, the optimizer, the step, the steps planned,
the seconds of training so far (over every session) and the recent losses, with the settings key it was
made with. It is saved every `every_steps` steps or `every_minutes` minutes, at the end, and on Ctrl-C or
SIGTERM (a kill, a closing session), whole or not at all. The same command resumes it and ends with the
same weights as an uninterrupted run. One policy for a checkpoint that cannot be used: a file that does
not load, or one made with other settings (another base, other data), is an error that names it and
says what to do; nothing is discarded silently (`--restart` discards it).

The budget is `steps`, or `minutes` of training: the run then times steps 3-12 and fixes the number of
steps, saved with the run.
"""
from __future__ import annotations

import logging
import math
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass
class Schedule:
    """The learning rate by step: linear warm-up, then "cosine" decay to lr/10 at the last step, or "wsd"
    (warm-up, stable, decay): constant, then linear to lr/10 over the last `cooldown` share of the steps;
    unlike the cosine, a wsd plan can still be lengthened on a resume before its cooldown starts."""
    lr: float
    warmup: int
    kind: str = "cosine"
    cooldown: float = 0.2

    def at(self, step: int, steps: int) -> float:
        if self.kind == "wsd":
            if step < self.warmup:
                return self.lr * (step + 1) / self.warmup
            decay_from = steps * (1 - self.cooldown)
            return self.lr * (1 - 0.9 * min(1.0, max(0.0, step - decay_from) / max(1.0, steps - decay_from)))
        warmup = min(self.warmup, max(1, steps // 10))  # at most a tenth of the run
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class RunState:
    """What a checkpoint holds besides the weights and the optimizer."""
    step: int = 0                 # steps whose update the weights hold
    steps: int = 0                # steps planned (0 while the first steps are timed for a minutes budget)
    train_seconds: float = 0.0    # training time so far, over all sessions
    resumed_at: int = 0           # the step this session started from
    recent: list = field(default_factory=list)  # the last 200 (loss, stats) of the steps

    def mean_loss(self, last: int = 50) -> float:
        losses = [loss for loss, _ in self.recent[-last:]]
        return sum(losses) / max(1, len(losses))


class Run:
    """A run directory's checkpoint (directory None: a run that is never saved, as in tests and on the
    processes of a distributed run other than the first)."""

    def __init__(self, directory: Path | None, key: dict):
        self.directory, self.key = (Path(directory) if directory else None), key

    @property
    def path(self) -> Path | None:
        return self.directory / "state.pt" if self.directory else None

    def load(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> RunState:
        """The saved run's state, its weights and optimizer loaded into model and opt; a fresh state when
        there is none. A checkpoint that does not load or was made with other settings is an error."""
        if self.path is None or not self.path.is_file():
            return RunState()
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)  # tensors and plain data: no code runs
        except Exception as e:  # torch raises several kinds for a truncated or foreign file
            # torch's own message runs to several lines (a weights-only refusal explains itself at length)
            why = ("not tensors and plain data alone" if isinstance(e, pickle.UnpicklingError)
                   else (str(e).strip().splitlines() or [""])[0][:160])
            raise CheckpointError(f"{self.path} is unreadable ({type(e).__name__}: {why}): pass --restart to "
                                  "discard it and start over") from None
        if not isinstance(saved, dict) or saved.get("key") != self.key:
            raise CheckpointError(f"{self.path} holds a run with other settings, another base or other data: "
                                  "resume it with the command that started it, or pass --restart to discard it")
        model.load_state_dict(saved["weights"])
        opt.load_state_dict(saved["opt"])
        state = RunState(**saved["state"])
        state.resumed_at = state.step
        logger.info("resuming from %s at step %d", self.path, state.step)
        return state

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, state: RunState) -> None:
        if self.path is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".pt.tmp")
        torch.save({"key": self.key, "state": asdict(state), "weights": model.state_dict(), "opt": opt.state_dict()}, tmp)
        tmp.replace(self.path)  # whole or absent, even if this is interrupted


def interrupt(signum, frame):
    """SIGTERM (kill, a closing session) ends a run as Ctrl-C does: saved, resumable."""
    raise KeyboardInterrupt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step_loss: Callable[[int], tuple[torch.Tensor, dict]],
          schedule: Schedule, run: Run, *, steps: int = 0, minutes: float | None = None, every_steps: int = 0,
          every_minutes: float = 5.0, stop_at: int | None = None, desc: str = "train", quiet: bool = False,
          postfix: Callable[[RunState], dict] | None = None) -> RunState:
    """Trains model (resuming run's checkpoint) for `steps` steps, or `minutes` of training when steps is 0.

    step_loss(step) -> (loss to backpropagate, stats): stats may hold "loss", the figure the bar and the
    state record (default: the loss's value). stop_at: save and return after that many steps, as an
    interrupted run would (tests). quiet: no progress bar (the other processes of a distributed run)."""
    state = run.load(model, opt)
    state.steps = steps or state.steps  # a new --steps lengthens or shortens the plan
    if not state.steps and not minutes:
        raise ValueError("a training run needs steps or minutes")
    timing = None if state.steps else (state.step, time.time())
    previous = signal.signal(signal.SIGTERM, interrupt)
    bar = tqdm(total=state.steps or None, initial=state.step, desc=desc, unit="step", dynamic_ncols=True, disable=quiet)
    last_save, started, spent = time.time(), time.time(), state.train_seconds
    model.train()
    try:
        while not state.steps or state.step < state.steps:
            if stop_at is not None and state.step >= stop_at:
                break
            for group in opt.param_groups:
                group["lr"] = schedule.at(state.step, state.steps or 10**9)
            loss, stats = step_loss(state.step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            state.step += 1
            state.recent = (state.recent + [(float(stats.get("loss", loss.item())), stats)])[-200:]
            state.train_seconds = spent + time.time() - started
            bar.update(1)
            if state.step % 5 == 0:
                bar.set_postfix(loss=f"{state.mean_loss():.3f}", **(postfix(state) if postfix else {}))
            if timing and state.step == timing[0] + 3:
                timing = (timing[0], time.time())  # the first 3 steps warm up: time the next 10
            elif timing and state.step == timing[0] + 13:
                per_step = (time.time() - timing[1]) / 10
                state.steps = max(state.step + 1, int((minutes * 60 - state.train_seconds) / per_step) + state.step)
                bar.total = state.steps
                bar.refresh()
                logger.info("%.2f s per step: %d steps fit in %g minutes", per_step, state.steps, minutes)
                timing = None
            if ((every_steps and state.step % every_steps == 0)
                    or (every_minutes and time.time() - last_save > every_minutes * 60)):
                run.save(model, opt, state)
                last_save = time.time()
    except KeyboardInterrupt:
        bar.close()
        run.save(model, opt, state)
        if run.path:
            logger.info("interrupted: saved the run after step %d in %s; run the same command to resume", state.step, run.directory)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    bar.close()
    run.save(model, opt, state)
    model.eval()
    return state


def sequential(batches):
    """batch(step) over an endless generator whose batches come in a fixed order: steps are asked in
    order, and a resumed run skips the batches of the steps it has done."""
    at = 0

    def batch(step: int):
        nonlocal at
        while at < step:
            next(batches)
            at += 1
        at += 1
        return next(batches)

    return batch
