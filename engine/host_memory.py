"""Giving freed host memory back to the operating system between the phases of a step.

PyTorch's CPU tensors come from the C allocator. glibc serves a large allocation with its own
mmap, returned on free, but raises that threshold to the size of each such block freed (up to 32
MiB), after which the weight-sized tensors of a step (gradients, the sampler's fused weights,
activations) come from the heap and stay in the process when freed (how much at the Qwen3-0.6B
shape: docs/performance.md, "The memory targets at the 0.6B shape"). The next phase reuses that
memory only when it asks for the same sizes; a phase that maps new memory instead (the offloaded
reference) or allocates other sizes adds to it, and the step's peak counts both.
``malloc_trim(0)`` returns every free page of the heap at once; called where a phase has just
freed its memory it costs the next phase page faults for what it touches again (measured in
docs/performance.md), where a fixed low mmap threshold would cost an mmap and munmap per tensor
all the time.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h)."""
TRAINING_MMAP_THRESHOLD = 1 << 20
"""Blocks from 1 MiB up get their own mapping on a CPU: every activation, gradient and weight
of a real-size model, while the many small tensors of the Python side stay in the heap."""
HOST_MEMORY_TIGHT = 4
"""The fixed threshold pays (``--backend-opt return_freed_memory=auto``) where a step's planned peak
exceeds 1/4 of the host's available memory: below that the memory it saves is not missed, and its
page faults slow a small model's multi-turn step (docs/performance.md)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    # Not glibc (macOS, musl): no such calls, and no such threshold to undo.
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def malloc_trim() -> Callable[[int], int] | None:
    libc = _libc()
    return libc.malloc_trim if libc is not None else None


def set_mmap_threshold(nbytes: int) -> bool:
    """From now on glibc serves every allocation of at least ``nbytes`` with its own mapping,
    returned to the operating system when freed, and no longer raises the threshold itself.
    False where the C library is not glibc (nothing done)."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))


def release_freed_memory(device: torch.device) -> None:
    """Return the free pages of the C heap to the operating system (glibc; a CPU device only:
    CUDA tensors live in the device's own caching allocator)."""
    trim = malloc_trim()
    if device.type == "cpu" and trim is not None:
        trim(0)
