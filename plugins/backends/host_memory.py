"""Giving freed host memory back to the operating system between the phases of a step.

PyTorch's CPU tensors come from the C allocator. glibc serves a large allocation with its own
mmap, returned on free, but raises that threshold to the size of each such block freed (up to
32 MiB), after which the weight-sized tensors of a step (gradients, the sampler's fused
weights, activations; 4-25 MiB each at the Qwen3-0.6B shape) come from the heap and stay in
the process when freed: at that shape 2.5-3 GB between steps in float32, beside 5.2 GB of live
weights and Adam moments. The next phase reuses that memory only when it asks for the same
sizes; a phase that maps new memory instead (the offloaded reference) or allocates other
sizes adds to it, and the step's peak counts both. ``malloc_trim(0)`` returns every free page
of the heap at once; called where a phase has just freed its memory it costs the next phase
page faults for what it touches again (measured in docs/performance.md), where a fixed low
mmap threshold would cost an mmap and munmap per tensor all the time.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        # Not glibc (macOS, musl): no such call, and no such threshold to undo.
        return None


def release_freed_memory(device: torch.device) -> None:
    """Return the free pages of the C heap to the operating system (glibc; a CPU device only:
    CUDA tensors live in the device's own caching allocator)."""
    trim = _malloc_trim()
    if device.type == "cpu" and trim is not None:
        trim(0)
