"""The one training loop (builder/train/loop.py): its schedules, resuming to the same weights, and its one
checkpoint policy (a checkpoint that cannot be used is an error naming it, never silently dropped)."""
import logging

import pytest
import torch

from builder.errors import CheckpointError
from builder.train.loop import Run, Schedule, train


def test_wsd_schedule_warms_up_holds_and_cools_down():
    s = Schedule(lr=1.0, warmup=10, kind="wsd", cooldown=0.2)
    assert s.at(0, 100) == pytest.approx(0.1) and s.at(50, 100) == 1.0
    assert s.at(80, 100) == 1.0 and s.at(99, 100) == pytest.approx(0.1 + 0.9 / 20)


def test_cosine_schedule_warms_up_then_decays_to_a_tenth():
    s = Schedule(lr=1.0, warmup=10)
    assert s.at(0, 1000) == pytest.approx(0.1) and s.at(9, 1000) == pytest.approx(1.0)
    assert s.at(999, 1000) == pytest.approx(0.1, abs=1e-4)
    assert s.at(0, 20) == pytest.approx(0.5), "the warm-up is at most a tenth of a short run"


def setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def regression(model):
    """A loss whose batch is a function of the step, as every trainer's."""
    def step_loss(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g)
        return ((model(x) - x.sum(1, keepdim=True)) ** 2).mean(), {}
    return step_loss


def test_an_interrupted_run_resumes_to_the_weights_of_one_never_stopped(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="builder")
    model, opt = setup()
    train(model, opt, regression(model), Schedule(0.1, 2), Run(None, {}), steps=10)

    cut, opt2 = setup()
    calls = []

    def interrupted(step):
        calls.append(step)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return regression(cut)(step)

    with pytest.raises(KeyboardInterrupt):
        train(cut, opt2, interrupted, Schedule(0.1, 2), Run(tmp_path, {"a": 1}), steps=10)
    assert "saved the run after step 5" in caplog.text
    resumed, opt3 = setup(seed=1)  # other initial weights: the checkpoint's must replace them
    state = train(resumed, opt3, regression(resumed), Schedule(0.1, 2), Run(tmp_path, {"a": 1}), steps=10)
    assert state.resumed_at == 5 and state.step == 10 and "resuming from" in caplog.text
    for name, t in model.state_dict().items():
        assert torch.equal(t, resumed.state_dict()[name]), f"{name} differs from the uninterrupted run"


def test_a_checkpoint_of_other_settings_is_an_error_that_says_what_to_do(tmp_path):
    model, opt = setup()
    train(model, opt, regression(model), Schedule(0.1, 2), Run(tmp_path, {"lr": 0.1}), steps=3)
    with pytest.raises(CheckpointError, match="other settings.*--restart"):
        train(model, opt, regression(model), Schedule(0.1, 2), Run(tmp_path, {"lr": 0.2}), steps=3)


def test_an_unreadable_checkpoint_is_an_error_naming_it(tmp_path):
    (tmp_path / "state.pt").write_bytes(b"not a checkpoint")
    model, opt = setup()
    with pytest.raises(CheckpointError, match=r"state\.pt is unreadable.*--restart") as err:
        train(model, opt, regression(model), Schedule(0.1, 2), Run(tmp_path, {}), steps=3)
    assert "\n" not in str(err.value), "the CLI prints errors as one line"


def test_a_minutes_budget_fixes_the_steps_after_timing_the_first_ones(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="builder")
    model, opt = setup()
    state = train(model, opt, regression(model), Schedule(0.1, 2), Run(tmp_path, {}), minutes=0.001)
    assert state.steps == state.step >= 14 and "steps fit in" in caplog.text
