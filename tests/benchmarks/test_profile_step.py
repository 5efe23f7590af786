"""benchmarks/profile_step.py: the training-phase torch.profiler tables and the refusals of its flags."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks are scripts whose siblings import each other by name

import profile_step  # noqa: E402


@pytest.mark.slow  # torch.profiler starts kineto: ~15 s on a loaded machine
def test_the_train_phase_profile_counts_operator_calls_and_self_time_per_step(capsys):
    profile = profile_step.TrainPhaseProfile("cpu")
    a = torch.randn(64, 64)
    for _ in range(2):  # two "steps", each profiled apart and summed
        with torch.profiler.profile(activities=profile.activities) as run:
            for _ in range(3):
                a @ a
        profile.collect(run)
    calls, self_us = profile.cpu_ops["aten::mm"]
    assert calls == 6 and self_us > 0
    assert not profile.kernels  # a CPU profile has no device kernels
    profile.report(steps=2, rows=5)
    out = capsys.readouterr().out
    assert "training phase, CPU operators:" in out and "device kernels" not in out
    mm_row = next(line for line in out.splitlines() if line.startswith("aten::mm"))
    assert mm_row.split()[-1] == "3.0"  # calls per step


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profiler", "torch", "--contender", "naive"], "--profiler torch profiles grpo-core's training phase"),
        (["--device", "cuda", "--contender", "naive"], "--device cuda runs grpo-core only"),
    ],
)
def test_flags_that_do_not_apply_to_the_naive_loop_are_refused_before_any_model_is_built(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("run.prepare", lambda *a, **k: pytest.fail("a model was built"), raising=False)
    with pytest.raises(SystemExit) as exit_info:
        profile_step.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
