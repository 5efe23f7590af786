"""engine/perf.py: what perf/mfu and perf/peak_memory_gib are measured against."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys

import pytest
import torch

from grpo_core.engine import perf
from tests.helpers import grpo_core, small_run_args


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", 165.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA B200", 2250.0),
        ("Tesla T4", None),  # no bf16 tensor cores: probed
        ("NVIDIA A10G", None),
    ],
)
def test_known_gpus_get_their_dense_bf16_peak_and_others_none(name, tflops):
    assert perf.table_tflops(name) == tflops


def test_the_cpu_peak_is_a_probe_in_the_weights_dtype_measured_once_per_process(monkeypatch):
    perf.peak_flops.cache_clear()
    rate, what = perf.peak_flops(torch.device("cpu"), torch.float32)
    assert 1e8 < rate < 1e14
    assert re.fullmatch(rf"this CPU's float32 (128|256|512|1024)³ matmul probe, best of 5: {re.escape(f'{rate / 1e9:.4g}')} GFLOP/s", what)
    monkeypatch.setattr(perf, "matmul_rate", lambda *a, **k: pytest.fail("probed twice"))
    assert perf.peak_flops(torch.device("cpu"), torch.float32) == (rate, what)


def test_the_cpu_probe_grows_while_a_product_is_quick_and_stops_at_the_first_slow_one(monkeypatch):
    """A dtype the CPU is slow at (bfloat16 without AMX) must not cost a 1024³ probe at start."""
    perf.peak_flops.cache_clear()
    sizes = []

    def rate_of(device, dtype, n):
        sizes.append(n)
        return 2.0 * n**3 / (perf.CPU_PROBE_SECONDS * (n / 200))  # a 128³ product takes 0.64 of the budget, 256³ 1.28

    monkeypatch.setattr(perf, "matmul_rate", rate_of)
    rate, what = perf.peak_flops(torch.device("cpu"), torch.bfloat16)
    assert sizes == [128, 256] and what.startswith("this CPU's bfloat16 256³ matmul probe")
    perf.peak_flops.cache_clear()
    sizes.clear()
    monkeypatch.setattr(perf, "matmul_rate", lambda device, dtype, n: sizes.append(n) or 1e15)
    perf.peak_flops(torch.device("cpu"), torch.float32)
    assert sizes == [128, 256, 512, 1024]
    perf.peak_flops.cache_clear()


def test_the_matmul_probe_counts_two_flops_per_multiply_add(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(perf.time, "perf_counter", lambda: float(next(clock)))
    # Every product "takes" 1 s of the fake clock: the rate is 2·n³ per second.
    assert perf.matmul_rate(torch.device("cpu"), torch.float32, 8, repeats=3) == 2.0 * 8**3


def test_cpu_peak_memory_is_the_processes_peak_rss(monkeypatch):
    peak = perf.peak_memory_gib(torch.device("cpu"))
    # The kernel counts the two from per-thread RSS counters it folds in lazily: they may differ by a
    # few hundred KiB (a fresh clone's quick suite saw VmHWM 0.013 % above ru_maxrss).
    assert 0 < peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / perf.GIB * 1.01
    assert peak == perf.linux_peak_rss() / perf.GIB  # VmHWM (the project runs and is tested on Linux)
    assert perf.memory_line(torch.device("cpu")).startswith("the process's peak resident memory since it began")
    # Without /proc (macOS): getrusage's figure.
    real_path = perf.Path
    monkeypatch.setattr(perf, "Path", lambda path: real_path("/nonexistent-proc") / path.lstrip("/"))
    assert perf.linux_peak_rss() is None
    monkeypatch.setattr(perf.sys, "platform", "linux")
    assert perf.peak_memory_gib(torch.device("cpu")) == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / perf.GIB


EXECED_AFTER_A_LARGE_PEAK = """
import os, sys
held = bytearray(1536 << 20)
held[::4096] = b"x" * len(held[::4096])  # resident: 1.5 GiB of peak before the exec
del held
os.execv(sys.executable, [sys.executable, "-c",
    "import torch; from grpo_core.engine import perf; print(perf.peak_memory_gib(torch.device('cpu')))"])
"""


@pytest.mark.slow  # 4-6 s: the quick suite stays under its 5 minutes
def test_a_run_started_from_a_larger_process_reports_its_own_peak():
    """Linux keeps ru_maxrss across execve: a run started by a test runner or a notebook that had
    grown reported the parent's peak (two models of 16x the size measured the same 1.74 GiB)."""
    out = subprocess.run([sys.executable, "-c", EXECED_AFTER_A_LARGE_PEAK], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 1.0


def build_model(path, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_peak_memory_rises_with_a_larger_model(tiny_dataset, tmp_path):
    """Peak RSS is the process's: each model trains in a process of its own."""
    peaks = {}
    # ~63 M parameters: ~1 GB of weights, gradients and Adam moments, above any start-up peak (one CI
    # machine's small run peaked at 0.83 GiB, this machine's at 0.39 GiB).
    for label, hidden, layers in (("small", 64, 2), ("large", 1024, 4)):
        model = build_model(tmp_path / label, hidden, layers)
        out = grpo_core(*small_run_args(model, tiny_dataset, tmp_path / f"run-{label}", "--logger", "jsonl"))
        assert out.returncode == 0, out.stderr
        metrics = [json.loads(line) for line in (tmp_path / f"run-{label}" / "metrics.jsonl").read_text().splitlines()]
        assert all(0 < m["perf/mfu"] <= 1 for m in metrics)
        peaks[label] = max(m["perf/peak_memory_gib"] for m in metrics)
    assert peaks["large"] > peaks["small"] + 0.3, peaks
