"""Runs are never lost: exact resume, a checkpoint after a failure, the non-finite guard."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

from grpo_core import LossOutput, hookimpl, selection
from grpo_core.checkpoint import complete_checkpoints
from grpo_core.config import RunConfig
from grpo_core.engine.trainer import read_trainer_state
from grpo_core.lifecycle import NonFiniteSteps, RunFailed
from grpo_core.metrics import computed_only
from grpo_core.plugins_manager import PluginEntry
from grpo_core.train import run

BROKEN_AT_STEP: dict[str, int] = {}


@attrs.define
class LengthReward:
    """Longer completions score higher; at the step named in BROKEN_AT_STEP it returns too few scores."""

    calls: int = attrs.field(default=0, init=False)

    @hookimpl
    def reward(self, prompt, samples):
        self.calls += 1
        broken = BROKEN_AT_STEP.get("step")
        # Two prompt groups per step: calls 2k-1 and 2k belong to step k.
        if broken is not None and (self.calls + 1) // 2 == broken:
            return [0.0]
        return [len(s.text) / 10 for s in samples]


class NanGradient(torch.autograd.Function):
    """Sum in the forward pass, NaN in the backward pass: a finite loss with a NaN gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.size = x.shape
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.size, math.nan)


@attrs.define
class NanGradientLoss:
    """A loss whose value is finite and whose gradient is NaN."""

    @hookimpl
    def loss(self, inputs):
        total = NanGradient.apply(torch.cat([lp * m for lp, m in zip(inputs.logprobs, inputs.mask)]))
        return LossOutput(total, {})


@attrs.define
class FailingSync:
    """The in-process weight sync, failing at the step named in BROKEN_AT_STEP["sync"]."""

    @hookimpl
    def weight_sync(self, trainer, sampler, step):
        if BROKEN_AT_STEP.get("sync") == step:
            raise ConnectionError("the server is gone")
        sampler.load_weights_from(trainer)
        return sampler.version


TEST_PLUGINS = {
    ("reward", "length"): "LengthReward",
    ("loss", "nan_gradient"): "NanGradientLoss",
    ("weight_sync", "failing"): "FailingSync",
}


@pytest.fixture(autouse=True)
def test_plugins(monkeypatch):
    original = selection.find

    def find(name, kind=None):
        target = TEST_PLUGINS.get((kind, name))
        if target is None:
            return original(name, kind)
        return PluginEntry(kind=kind, name=name, target=f"{__name__}:{target}", distribution="tests", version="0")

    monkeypatch.setattr(selection, "find", find)
    BROKEN_AT_STEP.clear()


def config(tiny_model_dir, tiny_dataset, run_dir, **kw) -> RunConfig:
    base = dict(
        model=str(tiny_model_dir), dataset=str(tiny_dataset), prompt_template="Question: {prompt}\nAnswer:",
        max_steps=6, prompt_groups_per_step=2, completions_per_prompt=4, max_completion_tokens=6,
        learning_rate=1e-2, reward=["length"], logger=["jsonl"], run_dir=str(run_dir),
        drop_zero_variance_groups=False, checkpoint_every=2, seed=5,
    )  # fmt: skip
    base.update(kw)
    return RunConfig(**base)


def weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_time(records):
    return [computed_only(m) for m in records]


def assert_same_run(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["step"] for m in metrics(b)] == list(range(1, len(metrics(a)) + 1))
    assert without_time(metrics(a)) == without_time(metrics(b))


SETUPS = {
    "kl-reference": dict(loss=["grpo"], plugin_options={"loss": {"grpo": {"kl_beta": 0.05}}}),
    "sampling-ahead": dict(weight_sync_interval=2, checkpoint_every=3),
}
EXPECTED_CHECKPOINTS = {"kl-reference": ["step-000004", "step-000006"], "sampling-ahead": ["step-000003", "step-000006"]}


@pytest.mark.parametrize("setup", SETUPS)
def test_a_resumed_run_ends_bitwise_equal_to_one_that_never_stopped(tiny_model_dir, tiny_dataset, tmp_path, setup):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(config(tiny_model_dir, tiny_dataset, whole, **SETUPS[setup]))
    run(config(tiny_model_dir, tiny_dataset, resumed, **{**SETUPS[setup], "max_steps": 3}))
    summary = run(config(tiny_model_dir, tiny_dataset, resumed, **SETUPS[setup]), resume=True)
    assert summary["steps"] == 6
    # With KL on, equal weights also show the resumed reference is the initial policy, not the checkpoint's.
    assert_same_run(whole, resumed)
    assert [c.name for c in complete_checkpoints(resumed)] == EXPECTED_CHECKPOINTS[setup]


def test_an_error_mid_run_leaves_a_checkpoint_of_the_last_step_that_resumes_exactly(tiny_model_dir, tiny_dataset, tmp_path):
    whole, failed = tmp_path / "whole", tmp_path / "failed"
    run(config(tiny_model_dir, tiny_dataset, whole))
    BROKEN_AT_STEP["step"] = 4
    with pytest.raises(RunFailed) as caught:
        run(config(tiny_model_dir, tiny_dataset, failed))
    assert "returned 1 scores for 4 samples" in str(caught.value.cause)
    assert caught.value.saved == f"steps 1-3 are saved in {failed}/checkpoints/step-000003; continue with: grpo-core run --resume {failed}"
    assert [m["step"] for m in metrics(failed)] == [1, 2, 3]
    assert not (failed / "final").exists()
    BROKEN_AT_STEP.clear()
    run(config(tiny_model_dir, tiny_dataset, failed), resume=True)
    assert_same_run(whole, failed)


def test_a_failed_weight_sync_leaves_the_checkpoint_of_its_whole_step(tiny_model_dir, tiny_dataset, tmp_path):
    whole, failed = tmp_path / "whole", tmp_path / "failed"
    run(config(tiny_model_dir, tiny_dataset, whole, weight_sync="failing"))
    BROKEN_AT_STEP["sync"] = 3
    with pytest.raises(RunFailed) as caught:
        run(config(tiny_model_dir, tiny_dataset, failed, weight_sync="failing"))
    assert "the server is gone" in str(caught.value.cause)
    # The step had trained and is counted: its weights and RNGs are kept; it was never observed.
    assert caught.value.saved == f"steps 1-3 are saved in {failed}/checkpoints/step-000003; continue with: grpo-core run --resume {failed}"
    assert [m["step"] for m in metrics(failed)] == [1, 2]
    BROKEN_AT_STEP.clear()
    run(config(tiny_model_dir, tiny_dataset, failed, weight_sync="failing"), resume=True)
    # The sampler shares the trainer's weights: the run goes on as if the sync had not failed.
    wa, wb = weights(whole), weights(failed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Step 3 is recorded once, by the resumed run, with what it had recorded before the sync failed.
    assert [m["step"] for m in metrics(failed)] == [m["step"] for m in metrics(whole)]
    step3 = without_time(metrics(failed))[2]
    assert step3 == {k: v for k, v in without_time(metrics(whole))[2].items() if not k.startswith("sync/")}
    assert without_time(metrics(whole))[3:] == without_time(metrics(failed))[3:]


def test_a_nan_gradient_skips_the_step_and_stops_the_run_after_k_in_a_row(tiny_model_dir, tiny_dataset, tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "r"
    with pytest.raises(RunFailed) as caught:
        run(config(tiny_model_dir, tiny_dataset, run_dir, loss=["nan_gradient"], max_nonfinite_steps_in_a_row=3))
    assert isinstance(caught.value.cause, NonFiniteSteps)
    assert "non-finite in 3 steps in a row" in str(caught.value.cause)
    records = metrics(run_dir)
    assert [m["optim/skipped_nonfinite"] for m in records] == [1.0, 1.0]
    assert [m["policy/version"] for m in records] == [0, 0]
    assert all(m["optim/grad_norm"] is None for m in records)  # NaN, written as null
    # The weights were never touched: the checkpoint holds the initial model exactly.
    state = read_trainer_state(complete_checkpoints(run_dir)[-1] / "trainer")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert all(torch.equal(state["model"][k], initial[k]) for k in initial)


def test_a_skipped_step_leaves_weights_and_optimizer_state_untouched(tiny_model_dir, tiny_dataset, tmp_path):
    """One NaN step between good ones: the run goes on and counts it; later steps still train."""
    calls = {"n": 0}
    real = NanGradient.backward

    def nan_once(ctx, grad):
        calls["n"] += 1
        return real(ctx, grad) if calls["n"] == 2 else torch.ones(ctx.size)

    NanGradient.backward = staticmethod(nan_once)
    try:
        summary = run(config(tiny_model_dir, tiny_dataset, tmp_path / "r", loss=["nan_gradient"], max_steps=3))
    finally:
        NanGradient.backward = staticmethod(real)
    records = metrics(tmp_path / "r")
    assert summary["steps"] == 3
    assert [m["optim/skipped_nonfinite"] for m in records] == [0.0, 1.0, 0.0]
    assert [m["policy/version"] for m in records] == [1, 1, 2]


def test_resume_refuses_a_finished_run_and_a_directory_without_checkpoints(tiny_model_dir, tiny_dataset, tmp_path):
    from grpo_core.errors import PluginError

    run(config(tiny_model_dir, tiny_dataset, tmp_path / "done", max_steps=2))
    with pytest.raises(PluginError, match=r"complete at step 2 of 2; pass --max-steps > 2"):
        run(config(tiny_model_dir, tiny_dataset, tmp_path / "done", max_steps=2), resume=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PluginError, match="no complete checkpoint there"):
        run(config(tiny_model_dir, tiny_dataset, tmp_path / "empty"), resume=True)


def test_a_run_directory_holding_a_run_is_refused_unless_overwrite(tiny_model_dir, tiny_dataset, tmp_path):
    from grpo_core.errors import PluginError

    run_dir = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, run_dir, max_steps=2))
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(PluginError, match="is not empty: continue that run with --resume"):
        run(config(tiny_model_dir, tiny_dataset, run_dir, max_steps=1))
    assert (run_dir / "metrics.jsonl").read_text() == before
    run(config(tiny_model_dir, tiny_dataset, run_dir, max_steps=1), overwrite=True)
    assert [m["step"] for m in metrics(run_dir)] == [1]
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step-000001"]


@pytest.mark.slow
def test_checkpoints_written_in_the_background_resume_bitwise(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    import shutil
    import threading

    from grpo_core.engine.trainer import SavedState

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(config(tiny_model_dir, tiny_dataset, whole, checkpoint_every=1))
    writers, write = [], SavedState.write
    monkeypatch.setattr(SavedState, "write", lambda self, path: (writers.append(threading.current_thread().name), write(self, path)))
    run(config(tiny_model_dir, tiny_dataset, resumed, checkpoint_every=1, max_steps=4))
    assert [c.name for c in complete_checkpoints(resumed)] == ["step-000003", "step-000004"]
    # Steps 1-3 in the background; the last step's by the run's end, in place.
    assert writers == ["checkpoint-write"] * 3 + ["MainThread"]
    # Step 3's checkpoint was written while step 4 trained: resumed from it, the run is the same.
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    shutil.rmtree(resumed / "final")
    run(config(tiny_model_dir, tiny_dataset, resumed, checkpoint_every=1), resume=True)
    assert_same_run(whole, resumed)


KILLED_MID_WRITE = """
import json, sys, threading, time
from pathlib import Path
from grpo_core.config import RunConfig
from grpo_core.engine.trainer import SavedState
from grpo_core.train import run

write = SavedState.write

def hanging_at_step_2(self, path):
    write(self, path)
    if "step-000002" in path:  # its files are written, the checkpoint is not complete yet
        Path(sys.argv[2]).write_text(threading.current_thread().name)
        time.sleep(600)

SavedState.write = hanging_at_step_2
run(RunConfig(**json.loads(sys.argv[1])))
"""


@pytest.mark.slow
def test_a_process_killed_during_a_background_write_leaves_the_previous_checkpoint_whole(tiny_model_dir, tiny_dataset, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    run_dir, marker = tmp_path / "r", tmp_path / "writing"
    built_in = dict(checkpoint_every=1, max_steps=3, reward=["format"], plugin_options={"reward": {"format": {"pattern": r"\d"}}})
    settings = config(tiny_model_dir, tiny_dataset, run_dir, **built_in).to_dict()  # the subprocess knows no test plugin
    args = [sys.executable, "-c", KILLED_MID_WRITE, json.dumps(settings), str(marker)]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), process.stderr.read().decode()[-3000:]
    assert marker.read_text() == "checkpoint-write"  # training went on meanwhile
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step-000001"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-step-000002")]  # the half-written one
    summary = run(config(tiny_model_dir, tiny_dataset, run_dir, **built_in), resume=True)
    assert summary["steps"] == 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
