"""End-to-end: ``grpo-core run --loop async``, in this process or (signals, kills) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers import grpo_core, grpo_core_in_process, signal_after_two_steps, small_run_args


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_async_run_trains_within_the_bound_and_reports_the_async_metrics(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(
            tiny_model_dir,
            tiny_dataset,
            run_dir,
            "--loop",
            "async",
            "--max-head-offpolicy-versions",
            "1",
            "--max-steps",
            "4",
            "--no-drop-zero-variance-groups",
        )
    )
    assert out.returncode == 0, out.stderr
    metrics = metrics_of(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and [m["policy/version"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        for key in (
            "perf/trainer_idle_frac",
            "perf/sampler_busy_frac",
            "perf/samples_per_s",
            "staleness/mean",
            "queue/in_flight",
            "queue/ready",
            "async/requeued_stale",
            "async/dropped_samples",
        ):
            assert key in m, key
        assert 0 <= m["staleness/max"] <= 1 and 0 <= m["perf/trainer_idle_frac"] <= 1 and m["groups/kept"] == 2
    assert json.loads((run_dir / "config.json").read_text())["loop"] == "async"
    ledger = [json.loads(line) for line in (run_dir / "async" / "groups.jsonl").read_text().splitlines()]
    assert sorted(line["index"] for line in ledger if line["outcome"] == "trained") == sorted(
        {line["index"] for line in ledger if line["outcome"] == "trained"}
    )
    assert (run_dir / "async" / "step-000004.json").is_file() and (run_dir / "final" / "model.safetensors").is_file()


def test_the_async_flags_have_a_section_in_help():
    out = grpo_core_in_process("run", "--help")
    assert "Asynchronous loop" in out.stdout
    for flag in (
        "--loop",
        "--max-head-offpolicy-versions",
        "--max-concurrent",
        "--synchronous-training",
        "--minibatches-per-step",
        "--rollout-retries",
    ):
        assert flag in out.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--weight-sync-interval", "3", "--max-head-offpolicy-versions", "1"], "--max-head-offpolicy-versions must be at least 2"),
        (["--minibatches-per-step", "3"], "cannot exceed --prompt-groups-per-step 2"),
        (["--max-head-offpolicy-versions", "-1"], "max_head_offpolicy_versions must be >= 0"),
        (["--loop", "asynch"], "'asynch' is not one of 'sync', 'async'"),
    ],
)
def test_bad_async_settings_are_one_clear_line(tiny_model_dir, tiny_dataset, tmp_path, extra, message):
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / "r", "--loop", "async", *extra))
    assert out.returncode in (1, 2), out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_an_async_run_resumes_and_only_scheduling_settings_may_change(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    assert (
        grpo_core_in_process(
            *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--loop", "async", "--no-drop-zero-variance-groups")
        ).returncode
        == 0
    )
    refused = grpo_core_in_process("run", "--resume", str(run_dir), "--max-head-offpolicy-versions", "3", "--max-steps", "4")
    assert refused.returncode == 1 and "--max-head-offpolicy-versions" in refused.stderr
    out = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "4", "--max-concurrent", "1", "--rollout-retries", "0")
    assert out.returncode == 0, out.stderr
    assert [m["step"] for m in metrics_of(run_dir)] == [1, 2, 3, 4]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["max_concurrent"] == 1 and config["rollout_retries"] == 0 and config["max_head_offpolicy_versions"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_ends_an_async_run_with_a_checkpoint_and_its_async_state(tiny_model_dir, tiny_dataset, tmp_path, signum, code):
    run_dir = tmp_path / "run"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--loop", "async", "--no-drop-zero-variance-groups")
    steps = signal_after_two_steps(args, run_dir, signum, code)
    assert json.loads((run_dir / "checkpoints" / f"step-{steps:06d}" / "state.json").read_text())["step"] == steps
    state = json.loads((run_dir / "async" / f"step-{steps:06d}.json").read_text())
    assert state["cursor"] >= steps * 2
    # It goes on from there.
    out = grpo_core("run", "--resume", str(run_dir), "--max-steps", str(steps + 1))
    assert out.returncode == 0, out.stderr
    assert [m["step"] for m in metrics_of(run_dir)] == list(range(1, steps + 2))


def test_the_async_preset_in_the_docs_runs_async_with_tis(tiny_model_dir, tiny_dataset, tmp_path):
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "async.md").read_text()
    preset = docs.split("# async.toml", 1)[1].split("```", 1)[0].split("\n", 1)[1]
    (tmp_path / "async.toml").write_text(preset)
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--config", str(tmp_path / "async.toml"), "--no-drop-zero-variance-groups")
    )
    assert out.returncode == 0, out.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert config["loop"] == "async" and config["max_head_offpolicy_versions"] == 1 and config["loss"] == ["grpo", "tis"]
    assert config["plugin_options"]["loss"]["tis"] == {"cap": 2.0}
    assert all("tis/weight_mean" in m and "staleness/max" in m for m in metrics_of(run_dir))


@pytest.mark.slow
def test_an_async_run_killed_mid_run_resumes_and_trains_every_prompt_exactly_once(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    # Three epochs of 36 prompts: every (epoch, prompt) place in the order must be trained once.
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--loop", "async", "--no-drop-zero-variance-groups")
    args += ["--max-steps", "54", "--epochs", "3", "--checkpoint-every", "1", "--max-head-offpolicy-versions", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "grpo_core.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 4):
        time.sleep(0.02)
    proc.kill()
    proc.communicate(timeout=60)
    assert not (run_dir / "final").exists(), "the run ended before it was killed"
    out = grpo_core("run", "--resume", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert [m["step"] for m in metrics_of(run_dir)] == list(range(1, 55))
    ledger = [json.loads(line) for line in (run_dir / "async" / "groups.jsonl").read_text().splitlines()]
    assert sorted(line["index"] for line in ledger if line["outcome"] == "trained") == list(range(108))
    assert all(line["trainer_version"] - line["sampled_version"] <= 2 for line in ledger if line["outcome"] == "trained")
