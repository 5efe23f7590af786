"""The kill harness: a CPU run killed with SIGKILL at random points (one of them inside a
checkpoint write), resumed each time, ends bitwise equal to a run that was never killed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from grpo_core.metrics import computed_only
from tests.helpers import grpo_core, grpo_core_in_process, make_plugin_package, small_run_args

STEPS = 30  # the tiny dataset has 18 steps an epoch: resumes cross into the second


def run_args(tiny_model_dir, tiny_dataset, run_dir):
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--checkpoint-every", "1", "--keep-checkpoints", "2", "--seed", "3")
    return [*args, "--max-steps", str(STEPS), "--epochs", "2", "--logger", "jsonl", "--loss-opt", "kl_beta=0.05", "--learning-rate", "1e-2"]


def start(args):
    return subprocess.Popen([sys.executable, "-m", "grpo_core.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def signal_inside_a_write(proc, folder, prefix, signum=signal.SIGKILL, deadline_s=60):
    """Send ``signum`` the moment a temporary folder named ``prefix...`` appears in ``folder``
    (a checkpoint, final/); True if it was caught mid-write."""
    deadline = time.time() + deadline_s
    while time.time() < deadline and proc.poll() is None:
        if folder.is_dir() and any(e.name.startswith(prefix) for e in os.scandir(folder)):
            proc.send_signal(signum)
            if signum == signal.SIGKILL:
                proc.wait()
                return any(e.name.startswith(prefix) for e in os.scandir(folder))
            return True
        time.sleep(0.0005)
    return False


def steps_done(run_dir):
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_ends_bitwise_equal(tiny_model_dir, tiny_dataset, tmp_path):
    from safetensors.torch import load_file

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    out = grpo_core(*run_args(tiny_model_dir, tiny_dataset, whole))
    assert out.returncode == 0, out.stderr

    rng = random.Random(0)
    args = run_args(tiny_model_dir, tiny_dataset, killed)
    schedule = ["during a step", "inside a checkpoint write", "while loading", "during a step", "during a step"]
    for when in [*schedule, "never"]:
        fresh = not any((killed / "checkpoints").glob("step-*"))
        proc = start([*args, "--overwrite"] if fresh else ["run", "--resume", str(killed)])
        if when == "inside a checkpoint write":
            assert signal_inside_a_write(proc, killed / "checkpoints", ".tmp-")
        elif when == "while loading":
            time.sleep(rng.uniform(0.5, 2.0))
            proc.send_signal(signal.SIGKILL)
        elif when == "during a step":
            target = steps_done(killed) + rng.randint(1, 5)
            while proc.poll() is None and steps_done(killed) < target:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=120)
        assert code == (0 if when == "never" else -signal.SIGKILL), (when, proc.stderr.read())
    assert steps_done(killed) == STEPS

    a, b = load_file(whole / "final" / "model.safetensors"), load_file(killed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    records = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))
    reference = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]

    def drop_time(ms):
        return [computed_only(m) for m in ms]

    assert drop_time(records) == drop_time(reference)
    assert not any(p.name.startswith(".tmp-") for p in (killed / "checkpoints").iterdir())


def assert_same_final(a, b):
    from safetensors.torch import load_file

    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def leftovers(run_dir):
    return [p.name for p in [*run_dir.iterdir(), *(run_dir / "checkpoints").iterdir()] if p.name.startswith(".tmp-")]


@pytest.mark.slow
def test_a_signal_while_final_is_written_lets_it_finish_and_a_kill_there_resumes_to_the_same_policy(tiny_model_dir, tiny_dataset, tmp_path):
    def args(run_dir):
        return small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--checkpoint-every", "1", "--logger", "jsonl", "--max-steps", "3")

    whole, stopped, killed = tmp_path / "whole", tmp_path / "stopped", tmp_path / "killed"
    assert grpo_core(*args(whole)).returncode == 0

    proc = start(args(stopped))
    assert signal_inside_a_write(proc, stopped, ".tmp-final-", signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, proc.stderr.read()
    assert_same_final(whole, stopped)
    assert json.loads((stopped / "summary.json").read_text())["exit_code"] == 143
    assert leftovers(stopped) == []

    proc = start(args(killed))
    assert signal_inside_a_write(proc, killed, ".tmp-final-")
    assert not (killed / "final").exists() and leftovers(killed) != []
    resumed = grpo_core("run", "--resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr
    assert leftovers(killed) == []
    assert_same_final(whole, killed)
    assert [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


RAISING_LOGGER = """
import os
import attrs
from grpo_core import hookimpl


@attrs.define
class RaisingLogger:
    \"\"\"Raises in on_step at the step given by the environment variable RAISE_AT_STEP.\"\"\"

    @hookimpl
    def on_step(self, step, metrics, state, groups):
        if str(step) == os.environ.get("RAISE_AT_STEP"):
            raise RuntimeError(f"the dashboard is gone at step {step}")
"""


@pytest.fixture(scope="module")
def raising_logger_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkg")
    pkg = make_plugin_package(root, "grpo-raising-logger", RAISING_LOGGER, {"logger.raising": "grpo_raising_logger:RaisingLogger"})
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(pkg)],
        check=True,
        capture_output=True,
    )
    return str(target)


@pytest.mark.slow
@pytest.mark.parametrize("loggers", [("jsonl", "raising"), ("raising", "jsonl")])
@pytest.mark.parametrize("checkpoint_every", ["1", "50"])
def test_a_logger_that_raises_loses_no_step_and_the_resumed_run_ends_bitwise_equal(
    raising_logger_site, tiny_model_dir, tiny_dataset, tmp_path, loggers, checkpoint_every
):
    def args(run_dir):
        extra = ["--checkpoint-every", checkpoint_every, "--max-steps", "4", *(a for name in loggers for a in ("--logger", name))]
        return small_run_args(tiny_model_dir, tiny_dataset, run_dir, *extra)

    whole, failed = tmp_path / "whole", tmp_path / "failed"
    assert grpo_core_in_process(*args(whole), env={"PYTHONPATH": raising_logger_site}).returncode == 0
    out = grpo_core_in_process(*args(failed), env={"PYTHONPATH": raising_logger_site, "RAISE_AT_STEP": "2"})
    assert out.returncode == 1
    assert "logger plugin 'raising' from grpo-raising-logger 1.2.3 raised RuntimeError: the dashboard is gone at step 2" in out.stderr
    assert f"steps 1-2 are saved in {failed}/checkpoints/step-000002" in out.stderr
    resumed = grpo_core_in_process("run", "--resume", str(failed), env={"PYTHONPATH": raising_logger_site})
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in (failed / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in records] == [1, 2, 3, 4]

    def drop_time(ms):
        return [computed_only(m) for m in ms]

    assert drop_time(records) == drop_time(reference)
    assert_same_final(whole, failed)
