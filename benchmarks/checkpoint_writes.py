"""Checkpoints written on the training thread against written in the background: the embedded
model's run on a CPU with a checkpoint after every step; prints the median step time (the step
and its checkpoint, from one step's end to the next) of each and their ratio.

The local trainer declares no ``state_snapshot`` yet (a follow-up in engine/trainer.py): here
:func:`copying_snapshot` gives it one, a copy of its model and optimizer state taken on the
training thread that its own ``save_state`` then writes from the background thread.

    python benchmarks/checkpoint_writes.py               # 12 steps of the embedded model, 1 thread
    python benchmarks/checkpoint_writes.py --steps 30 --model PATH
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from grpo_core.engine.trainer import LocalTrainer


def copying_snapshot(trainer: LocalTrainer) -> Callable[[str], None]:
    """What the local trainer's ``save_state`` writes, copied now (on a CPU, a clone); the
    function returned writes the copy with that same ``save_state``."""
    shadow = copy.copy(trainer)
    shadow.model = copy.deepcopy(trainer.model)
    if trainer.optimizer is not None:
        saved = copy.deepcopy(trainer.optimizer.state_dict())
        shadow.optimizer = SimpleNamespace(state_dict=lambda: saved)
    return lambda path: LocalTrainer.save_state(shadow, path)


@contextlib.contextmanager
def background_writes() -> Iterator[None]:
    """Local trainers made inside declare :func:`copying_snapshot` as their ``state_snapshot``."""
    LocalTrainer.state_snapshot = copying_snapshot
    try:
        yield
    finally:
        del LocalTrainer.state_snapshot


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
        on_thread = statistics.median(step_times(settings, Path(tmp) / "on-thread"))
        with background_writes():
            background = statistics.median(step_times(settings, Path(tmp) / "background"))
    print(f"median step with its checkpoint, {args.steps} steps, model {args.model}, {args.threads} thread(s):")
    print(f"  written on the training thread: {on_thread:.3f} s")
    print(f"  written in the background:      {background:.3f} s ({background / on_thread:.2f}x)")


if __name__ == "__main__":
    main()
