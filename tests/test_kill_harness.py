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

from tests.test_cli import grpo_core, small_run_args

STEPS = 30  # the tiny dataset has 18 steps an epoch: resumes cross into the second


def run_args(tiny_model_dir, tiny_dataset, run_dir):
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--checkpoint-every", "1", "--keep-checkpoints", "2", "--seed", "3")
    return [*args, "--max-steps", str(STEPS), "--epochs", "2", "--logger", "jsonl", "--loss-opt", "kl_beta=0.05", "--learning-rate", "1e-2"]


def start(args):
    return subprocess.Popen([sys.executable, "-m", "grpo_core.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_inside_a_checkpoint_write(proc, checkpoints, deadline):
    """SIGKILL the moment a temporary checkpoint folder appears; True if it was caught mid-write."""
    while time.time() < deadline and proc.poll() is None:
        if checkpoints.is_dir() and any(e.name.startswith(".tmp-") for e in os.scandir(checkpoints)):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return any(e.name.startswith(".tmp-") for e in os.scandir(checkpoints))
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
            assert kill_inside_a_checkpoint_write(proc, killed / "checkpoints", time.time() + 60)
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
        return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in ms]

    assert drop_time(records) == drop_time(reference)
    assert not any(p.name.startswith(".tmp-") for p in (killed / "checkpoints").iterdir())
