"""What a trainer's perf metrics are measured against (docs/performance.md, Metrics of a run):
the device's peak matmul rate (a table of known GPUs, else a probe measured once per process)
and the memory at its peak since the last look.
"""

from __future__ import annotations

import functools
import re
import resource
import sys
import time
from pathlib import Path

import torch

GIB = 2**30

DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H100 NVL", 835.0),
    (r"H200 NVL", 835.0),
    (r"H100|H200|GH200", 989.0),
    (r"B200", 2250.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"L4\b", 121.0),
    (r"RTX 4090", 165.0),
    (r"A10\b", 125.0),
)
"""The vendors' dense (no sparsity) bf16 tensor-core rates, in TFLOP/s, by a pattern of
``torch.cuda.get_device_name``; the first that matches wins, so the more specific come first."""

CPU_PROBE_SIZE, CUDA_PROBE_SIZE, PROBE_REPEATS = 1024, 4096, 5
"""The probe's n×n×n products: best of PROBE_REPEATS after one warm-up. 4096 fills a GPU's
tensor cores; on a CPU the size grows from 128 up to 1024 while one product takes under
CPU_PROBE_SECONDS, so a dtype the CPU has no fast kernel for (bfloat16 without AMX: ~100 times
slower than float32) costs a fraction of a second, not half a minute."""
CPU_PROBE_SECONDS = 0.05


def table_tflops(device_name: str) -> float | None:
    """The dense bf16 rate of a known GPU, in TFLOP/s (None: not in :data:`DENSE_BF16_TFLOPS`)."""
    return next((tflops for pattern, tflops in DENSE_BF16_TFLOPS if re.search(pattern, device_name)), None)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = PROBE_REPEATS) -> float:
    """FLOP/s of the best of ``repeats`` n×n×n products of ``dtype`` on ``device``."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty_like(a)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b, out=c)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - began)
    return 2.0 * n**3 / best


@functools.cache
def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The rate perf/mfu is a fraction of, in FLOP/s, and where it comes from, in words.

    On CUDA the device's dense bf16 rate from the vendors' table (a probe where the device is not
    in it); on a CPU a probe in the weights' dtype. Measured once per process and device.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = table_tflops(name)
        if tflops is not None:
            return tflops * 1e12, f"{name}'s dense bf16 peak, {tflops:g} TFLOP/s (vendor's figure)"
        rate = matmul_rate(device, torch.bfloat16, CUDA_PROBE_SIZE)
        return rate, f"{name} (not in the table): a bf16 {CUDA_PROBE_SIZE}³ matmul probe, {rate / 1e12:.4g} TFLOP/s"
    n = 128
    while True:
        rate = matmul_rate(device, dtype, n)
        if n >= CPU_PROBE_SIZE or 2.0 * n**3 / rate > CPU_PROBE_SECONDS:
            break
        n *= 2
    what = str(dtype).removeprefix("torch.")
    return rate, f"this CPU's {what} {n}³ matmul probe, best of {PROBE_REPEATS}: {rate / 1e9:.4g} GFLOP/s"


def peak_memory_gib(device: torch.device) -> float:
    """On CUDA the memory allocated at its peak since the last call (which starts a new window);
    on a CPU the process's peak resident memory since it began (the OS keeps no window)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / GIB
    peak = linux_peak_rss()
    if peak is not None:
        return peak / GIB
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB


def linux_peak_rss() -> int | None:
    """The process's peak resident bytes (VmHWM), or None where /proc has none (not Linux).

    Not ``ru_maxrss``: Linux keeps that across ``execve``, so a run started from a larger process
    (a test runner, a notebook) would report its parent's peak."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def memory_line(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated over each step (reset at its end; step 1: since the process began)"
    return "the process's peak resident memory since it began (VmHWM, else getrusage's ru_maxrss: no per-step peak on a CPU)"
