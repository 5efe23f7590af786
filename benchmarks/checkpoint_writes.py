"""Checkpoints written on the training thread against written in the background: the embedded
model's run on a CPU with a checkpoint after every step; prints the median step time (the step
and its checkpoint, from one step's end to the next) of each and their ratio.

The local trainer writes its periodic checkpoints in the background (its ``state_snapshot``);
:func:`on_thread_writes` hides that snapshot, so they are written between steps as before.

    python benchmarks/checkpoint_writes.py               # 12 steps of the embedded model, 1 thread
    python benchmarks/checkpoint_writes.py --steps 30 --model PATH
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_core.engine.trainer import LocalTrainer


@contextlib.contextmanager
def on_thread_writes() -> Iterator[None]:
    """Local trainers inside declare no ``state_snapshot``: core writes their checkpoints between steps."""
    snapshot = LocalTrainer.state_snapshot
    LocalTrainer.state_snapshot = None
    try:
        yield
    finally:
        LocalTrainer.state_snapshot = snapshot


def step_times(settings: dict[str, Any], run_dir: Path) -> list[float]:
    """Seconds from each step's end (its checkpoint begun or written) to the next one's."""
    from grpo_core import loop
    from grpo_core.config import RunConfig
    from grpo_core.train import run

    ends: list[float] = []
    end_step = loop.end_step

    def timed_end_step(*args: Any, **kwargs: Any) -> bool:
        stop = end_step(*args, **kwargs)
        ends.append(time.perf_counter())
        return stop

    loop.end_step = timed_end_step
    try:
        run(RunConfig(**settings, run_dir=str(run_dir), checkpoint_every=1, keep_checkpoints=2, logger=["jsonl"]))
    finally:
        loop.end_step = end_step
    return [b - a for a, b in zip(ends, ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    settings = dict(model=args.model, max_steps=args.steps, threads=args.threads, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        with on_thread_writes():
            on_thread = statistics.median(step_times(settings, Path(tmp) / "on-thread"))
        background = statistics.median(step_times(settings, Path(tmp) / "background"))
    print(f"median step with its checkpoint, {args.steps} steps, model {args.model}, {args.threads} thread(s):")
    print(f"  written on the training thread: {on_thread:.3f} s")
    print(f"  written in the background:      {background:.3f} s ({background / on_thread:.2f}x)")


if __name__ == "__main__":
    main()
