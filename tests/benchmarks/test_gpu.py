"""benchmarks/gpu.py: grpo-core beside TRL at Qwen3 shapes on a GPU, and its tiny run on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks are scripts whose siblings import each other by name

import gpu  # noqa: E402

L, B = 16, 8


def fake_spec(work: Path) -> dict:
    """What ``run.prepare`` returns for the tiny shape and workload (2 prompts x G=4, 16 + 16 tokens)."""
    return {
        "config": "gpu-tiny",
        "model_dir": str(work / "model"),
        "dataset": str(work / "prompts.jsonl"),
        "prompts": [],
        "prompt_tokens": 16,
        "completion_tokens": L,
        "prompts_per_step": 2,
        "group_size": 4,
        "steps": 3,
        "learning_rate": 1e-5,
        "seed": 0,
        "work_dir": str(work),
        "params": {"all": 1_000_000, "non_embedding": 900_000},
    }


def fake_result(sample: float, train: float, gpu_gib: float | None = None, lengths: list[int] | None = None) -> dict:
    """A worker's result: 1 warmup + 3 timed steps; the timed ones take 1, 2 and 3 extra seconds of 'other'."""
    steps = []
    for i in range(4):
        steps.append(
            {
                "period": sample + train + i,
                "cpu": 1.0,
                "sample": sample,
                "reward": 0.0,
                "train": train,
                "completion_lengths": lengths or [L] * B,
                "peak_rss_mb": 1024.0 * (i + 1),
                "peak_gpu_gib": None if gpu_gib is None else gpu_gib - 3 + i,
            }
        )
    return {"steps": steps, "peak_rss_mb": 4096.0, "versions": {"torch": "x"}}


def test_jsonl_leaves_out_a_half_written_last_line(tmp_path):
    path = tmp_path / "records.jsonl"
    assert gpu.jsonl(path) == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lengths": [16, 1')
    assert gpu.jsonl(path) == [{"step": 1}, {"step": 2}]


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def test_launch_kills_a_contender_and_its_children_over_its_limit(tmp_path):
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    child += "print(p.pid, flush=True); time.sleep(60)"
    log = tmp_path / "log.txt"
    t = time.monotonic()
    assert gpu.launch([sys.executable, "-c", child], dict(os.environ), tmp_path, log, limit=3.0) == ("timed out", None)
    assert time.monotonic() - t < 15
    grandchild = int(log.read_text().split()[0])
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(grandchild)


def test_launch_ends_a_contender_once_it_is_done_and_returns_an_exit_code(tmp_path):
    marker = tmp_path / "done"
    script = f"import pathlib, time; pathlib.Path({str(marker)!r}).write_text('x'); time.sleep(60)"
    t = time.monotonic()
    how = gpu.launch([sys.executable, "-c", script], dict(os.environ), tmp_path, tmp_path / "log", limit=60, done=marker.exists)
    assert how == ("finished", None)
    assert time.monotonic() - t < 30
    assert gpu.launch([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path, tmp_path / "log", limit=60) == (
        "exited",
        3,
    )


def test_step_probe_records_the_runs_own_peak_not_what_the_engine_left_after_its_reset(tmp_path, monkeypatch):
    import torch

    # The engine resets the peak at each step's end: read here, max_memory_allocated is resident memory.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 5.6 * 2**30)
    probe = gpu.StepProbe(path=str(tmp_path / "probe.jsonl"))
    probe.on_step(step=1, metrics={"perf/peak_memory_gib": 10.3}, state=None, groups=[])
    probe.on_step(step=2, metrics={}, state=None, groups=[])
    records = gpu.jsonl(tmp_path / "probe.jsonl")
    assert [r["peak_gpu_gib"] for r in records] == [10.3, None]


def test_row_of_reports_the_median_step_and_the_gpu_columns(tmp_path):
    spec = fake_spec(tmp_path)
    row = gpu.row_of(spec, "grpo-core", fake_result(sample=0.4, train=0.5, gpu_gib=9.0), flops=1e12, device="cuda")
    assert row["step_s"] == pytest.approx(0.9 + 2)  # timed steps 0.9 + 1, 2, 3: the median
    assert row["sample_s"] == pytest.approx(0.4)
    assert row["decode_ms_per_step"] == pytest.approx(1000 * 0.4 / L)
    # 6 N per position, prompt + completion - 1 positions per sequence, over the training phase and the probe
    assert row["train_mfu"] == pytest.approx(6 * 1_000_000 * B * (16 + L - 1) / 0.5 / 1e12)
    assert row["peak_gib"] == pytest.approx(9.0)  # the last step's, the largest
    on_cpu = gpu.row_of(spec, "grpo-core", fake_result(sample=0.4, train=0.5), flops=1e12, device="cpu")
    assert on_cpu["peak_gib"] == pytest.approx(4.0)  # the process's peak RSS


def test_row_of_and_the_report_give_the_decode_attentions_width_where_the_run_recorded_it(tmp_path):
    spec = {**fake_spec(tmp_path), "shape": "Qwen3-0.6b", "workload": "long"}
    result = fake_result(sample=0.4, train=0.5)
    for width, step in zip([2080, 600, 900, 300], result["steps"]):  # the warmup's is left out
        step["metrics"] = {"perf/decode_attended_per_step": width}
    row = gpu.row_of(spec, "grpo-core", result, flops=1e12, device="cpu")
    assert row["attended_per_step"] == 600
    assert gpu.row_of(spec, "TRL", fake_result(0.4, 0.5), flops=1e12, device="cpu")["attended_per_step"] is None
    saved = saved_run(tmp_path)
    saved["runs"][1]["row"] = row
    lines = gpu.format_report(saved).splitlines()
    assert "grpo-core: decode attention read 600 cache slots per step (median step's mean)" in lines
    assert not any(line.startswith("TRL: decode attention") for line in lines)


def test_row_of_refuses_a_completion_shorter_than_forced(tmp_path):
    with pytest.raises(RuntimeError, match="expected 8 of 16"):
        gpu.row_of(fake_spec(tmp_path), "TRL", fake_result(0.4, 0.5, lengths=[L] * 7 + [3]), flops=1e12, device="cpu")


def saved_run(tmp_path, complete: bool = True) -> dict:
    spec = {**fake_spec(tmp_path), "shape": "Qwen3-0.6b", "workload": "short"}
    rows = {
        "TRL": gpu.row_of(spec, "TRL", fake_result(sample=1.0, train=1.0, gpu_gib=10.0), 1e10, "cuda"),
        "grpo-core": gpu.row_of(spec, "grpo-core", fake_result(sample=0.5, train=0.25, gpu_gib=5.0), 1e10, "cuda"),
    }
    runs = [{"key": "0.6b/short", "contender": c, "status": "ok", "row": r} for c, r in rows.items()]
    runs.append({"key": "0.6b/short", "contender": "TRL-vllm", "status": "skipped", "reason": "vllm is not importable by python"})
    return {
        "device": "cuda",
        "device_name": "NVIDIA H200",
        "date": "2026-11-27",
        "probe": {"flops": 790e12, "what": "bf16 8192^3 torch.mm, best of 10"},
        "specs": {"0.6b/short": spec},
        "runs": runs,
        "complete": complete,
    }


def test_format_report_gives_ratios_to_trl_and_says_why_a_row_is_missing(tmp_path):
    lines = gpu.format_report(saved_run(tmp_path)).splitlines()
    assert "NVIDIA H200" in lines[0] and "790 TFLOP/s (bf16 8192^3" in lines[0]
    assert lines[1] == "versions: torch x"
    assert any("Qwen3-0.6b shape (1.0M params), short: 2 prompts x G=4, prompt 16 + forced 16 tokens" in line for line in lines)
    trl = next(line for line in lines if line.startswith("TRL "))
    core = next(line for line in lines if line.startswith("grpo-core "))
    # TRL: step 2 + 2 = 4 s, sampling 1, training 1, 10 GiB; grpo-core: 0.75 + 2 s, 0.5, 0.25, 5 GiB;
    # MFU: 6 N B (P + L - 1) = 1.488 GFLOP per step against 10 GFLOP/s
    assert trl.split()[1:] == ["4.00", "1.00", "62.5", "1.00", "14.9%", "10.00", "1.00x", "1.00x", "1.00x", "1.00x"]
    assert core.split()[1:] == ["2.75", "0.50", "31.2", "0.25", "59.5%", "5.00", "0.69x", "0.50x", "0.25x", "0.50x"]
    assert "TRL-vllm         skipped: vllm is not importable by python" in lines
    assert "interrupted" not in "\n".join(lines)
    assert "(an interrupted run: the contenders that finished)" in gpu.format_report(saved_run(tmp_path, complete=False))


@pytest.fixture
def fake_contenders(monkeypatch, tmp_path):
    """gpu.main with every slow part replaced: no model build, no probe, contenders that return at once."""
    calls = []
    monkeypatch.setattr(gpu, "build", lambda shape, workload, steps, device, work: fake_spec(tmp_path))
    monkeypatch.setattr(gpu, "matmul_probe", lambda device: {"flops": 1e12, "what": "fake"})
    monkeypatch.setattr(gpu, "trl_interpreter", lambda device: (sys.executable, None))

    def grpo_core(spec, name, flags, device, threads, limit, profile=False):
        calls.append((name, flags, limit))
        return fake_result(0.5, 0.25)

    def trl(spec, name, flags, device, threads, limit, python):
        calls.append((name, flags, limit))
        raise KeyboardInterrupt  # the benchmark stopped while TRL ran

    monkeypatch.setattr(gpu, "run_grpo_core", grpo_core)
    monkeypatch.setattr(gpu, "run_trl", trl)
    return calls


def test_an_interrupted_run_keeps_the_contenders_that_finished(fake_contenders, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--device", "cpu", "--shape", "tiny", "--contenders", "grpo-core-gc,TRL", "--out", str(out), "--timeout", "77"])
    assert fake_contenders == [("grpo-core-gc", ["--gradient-checkpointing"], 77.0), ("TRL", ["--bf16", "--gradient-checkpointing"], 77.0)]
    saved = json.loads(out.read_text())
    assert saved["complete"] is False
    assert [(r["contender"], r["status"]) for r in saved["runs"]] == [("grpo-core-gc", "ok")]
    assert saved["runs"][0]["row"]["sample_s"] == pytest.approx(0.5)
    capsys.readouterr()
    assert gpu.main(["--report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "grpo-core-gc" in printed and "(an interrupted run: the contenders that finished)" in printed


def test_contenders_past_the_budget_are_not_run_and_vllm_needs_cuda(fake_contenders, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--shape", "tiny", "--contenders", "grpo-core,TRL-vllm", "--budget", "20", "--out", str(out)]) == 0
    assert fake_contenders == []
    saved = json.loads(out.read_text())
    assert saved["complete"] is True
    assert [(r["contender"], r["status"], r["reason"]) for r in saved["runs"]] == [
        ("grpo-core", "not run", "the --budget of 20 s was spent"),
        ("TRL-vllm", "skipped", "vLLM colocate needs --device cuda"),
    ]
    assert "grpo-core        not run: the --budget of 20 s was spent" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shape", "0.5b"], "--shape '0.5b': unknown ['0.5b']; choose from 0.6b, 1.7b, 4b, 8b, tiny"),
        (["--workload", "medium"], "--workload 'medium': unknown ['medium']"),
        (["--contenders", "grpo-core,verl"], "--contenders 'grpo-core,verl': unknown ['verl']"),
        (["--steps", "0"], "--steps and --timeout must be positive"),
    ],
)
def test_bad_command_lines_are_refused_naming_the_bad_value(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--device", "cpu", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused_before_anything_runs(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a machine with a GPU
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--shape", "tiny"])
    assert exc.value.code == 2
    assert "sees no CUDA device; on a CPU run --device cpu --shape tiny" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_run_on_a_cpu_runs_grpo_core_and_trl_and_prints_the_table(tmp_path):
    out = tmp_path / "gpu.json"
    # TRL comes from benchmarks/.venv-trl where this interpreter has no trl (built on first use, ~2 minutes)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--shape", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["complete"] is True
    assert [(r["contender"], r["status"]) for r in saved["runs"]] == [("grpo-core", "ok"), ("TRL", "ok")]
    for run in saved["runs"]:
        steps = run["result"]["steps"]
        assert len(steps) == 4  # 1 warmup + 3 timed
        assert all(step["completion_lengths"] == [16] * 8 for step in steps)  # forced to full length
        row = run["row"]
        assert 0 < row["sample_s"] < row["step_s"] and 0 < row["train_s"] < row["step_s"]
        assert row["decode_ms_per_step"] == pytest.approx(1000 * row["sample_s"] / 16)
        assert 0 < row["train_mfu"] and 0 < row["peak_gib"]
    # grpo-core's times are its own metrics.jsonl's
    core = saved["runs"][0]["result"]["steps"]
    assert [s["sample"] for s in core] == [s["metrics"]["time/sample"] for s in core]
    assert all(s["metrics"]["tokens/completion"] == 16 * 8 for s in core)
    table = proc.stdout
    assert "tiny Qwen3 shape (0.9M params), tiny: 2 prompts x G=4, prompt 16 + forced 16 tokens" in table
    assert "versions: grpo_core " in table and ", trl 1.16.0" in table
    trl_line = next(line for line in table.splitlines() if line.startswith("TRL "))
    assert trl_line.split()[-4:] == ["1.00x"] * 4
    assert next(line for line in table.splitlines() if line.startswith("grpo-core "))


def test_the_unforced_model_links_the_files_and_lists_about_ln2_over_length_of_the_vocabulary_as_eos(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000, "eos_token_id": 1000}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 1000, "do_sample": True}))
    (model / "model.safetensors").write_text("weights")
    out = gpu.unforced_model(model, tmp_path / "unforced", length=16)
    assert (out / "model.safetensors").is_symlink() and (out / "config.json").read_text() == (model / "config.json").read_text()
    generation = json.loads((out / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert eos[0] == 1000 and len(eos) == 1 + round(1000 * 0.6931 / 16) and all(0 < t < 1000 for t in eos[1:])
    assert len(set(eos)) == len(eos) and generation["do_sample"] is True
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == 1000  # the original untouched


def test_an_unforced_row_counts_decode_steps_to_the_longest_completion_and_checks_its_lengths(tmp_path):
    spec = {**fake_spec(tmp_path), "unforced": True}
    lengths = [3, 5, 16, 2, 9, 16, 1, 4]
    row = gpu.row_of(spec, "grpo-core", fake_result(sample=0.4, train=0.5, lengths=lengths), flops=1e12, device="cpu")
    assert row["decode_ms_per_step"] == pytest.approx(1000 * 0.4 / 16)
    mean = sum(lengths) / 8
    assert row["train_mfu"] == pytest.approx(6 * 1_000_000 * B * (16 + mean - 1) / 0.5 / 1e12)
    gpu.check_unforced_lengths({**fake_result(0.4, 0.5, lengths=lengths), "contender": "grpo-core"}, spec)
    with pytest.raises(RuntimeError, match="step 1: 7 completions"):
        gpu.check_unforced_lengths({**fake_result(0.4, 0.5, lengths=lengths[:7]), "contender": "grpo-core"}, spec)
    with pytest.raises(RuntimeError, match=r"lengths \[0, 1, 2"):
        gpu.check_unforced_lengths({**fake_result(0.4, 0.5, lengths=[0, *lengths[1:]]), "contender": "TRL"}, spec)


def test_a_profile_table_counts_each_operator_and_lists_the_costliest(tmp_path):
    import torch

    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(5):
            a = torch.mm(a, a).tanh()
    table = gpu.kernel_table(profile)
    assert table["kind"] == "CPU operators"
    counts = {row["name"]: row["count"] for row in table["top"]}
    assert counts["aten::mm"] == 5 and counts["aten::tanh"] == 5
    assert table["count"] >= 10 and table["ms"] >= sum(row["ms"] for row in table["top"]) - 1e-9
    lines = gpu.format_profile("grpo-core", {"step": 4, "sampling": {**table, "decode_steps": 5}})
    assert lines[0] == "profile of grpo-core, step 4:"
    assert f"per decode step {table['count'] / 5:.0f} CPU operators" in lines[1] and "(5 decode steps)" in lines[1]
    assert any(line.endswith("aten::mm") for line in lines) and lines[-1] == "  training: not profiled"
