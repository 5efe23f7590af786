from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from grpo_core import hookimpl, option


@attrs.define
class ConsoleLogger:
    """Progress bar with reward and loss while training, and a summary at the end.

    Without a terminal (CI, pipes) it prints one line every `every` steps instead.
    """

    every: int = option(1, help="print a line every N steps when not on a terminal")
    _console: Console = attrs.field(factory=Console, init=False, repr=False)
    _progress: Progress | None = attrs.field(default=None, init=False, repr=False)
    _task: Any = attrs.field(default=None, init=False, repr=False)
    _total: int | None = attrs.field(default=None, init=False, repr=False)

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        self._total = total_steps
        resumed = f" (resuming after step {start_step})" if start_step else ""
        self._console.print(f"grpo-core: training {config.model} on {config.dataset} -> {run_dir}{resumed}")
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self._progress.start()

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        stats = format_stats(metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
        elif step % self.every == 0 or step == self._total:
            total = f"/{self._total}" if self._total else ""
            self._console.print(f"step {step}{total}  {stats}  {metrics.get('time/step', 0.0):.2f}s", highlight=False)

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        if self._progress is not None:
            self._progress.stop()
        n = summary["window"]
        # The metric the run compares: an RL run's reward, an sft run's loss.
        tracked = next((name for name in ("reward", "loss") if f"{name}_first" in summary), None)
        if n and tracked:
            first, last = ("first step", "last step") if n == 1 else (f"first {n} steps", f"last {n} steps")
            start, end = summary[f"{tracked}_first"], summary[f"{tracked}_last"]
            self._console.print(f"{tracked}: {first} {start:.3f} -> {last} {end:.3f} ({end - start:+.3f})", highlight=False)
        skipped = {k.removeprefix("data/skipped_"): v for k, v in summary.items() if k.startswith("data/skipped_") and v}
        if skipped:
            self._console.print("skipped " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in skipped.items()), highlight=False)
        stop = f", stopped: {summary['stop_reason']}" if summary.get("stop_reason") else ""
        self._console.print(
            f"{summary['steps']} steps in {summary['seconds']:.1f}s{stop}; run directory: {run_dir} "
            f"(final policy: {summary['final_policy']})",
            highlight=False,
            soft_wrap=True,
        )


def format_stats(metrics: dict[str, float]) -> str:
    parts = []
    for key, label in (("reward/total", "reward"), ("loss/total", "loss"), ("loss/kl", "kl")):
        value = metrics.get(key)
        if value is not None and not math.isnan(value):
            parts.append(f"{label} {value:.3f}" if key != "loss/kl" else f"{label} {value:.2e}")
    return "  ".join(parts + format_perf(metrics))


PERF_SHOWN = (
    ("perf/sample_tokens_per_s", "sample {:,.0f} tok/s"),
    ("perf/train_tokens_per_s", "train {:,.0f} tok/s"),
    ("perf/mfu", "mfu {:.1%}"),
    ("perf/peak_memory_gib", "peak {:.2f} GiB"),
)
"""The perf metrics a step's line shows (those the run logs: a trainer without counters has no MFU)."""


def format_perf(metrics: dict[str, float]) -> list[str]:
    return [form.format(metrics[key]) for key, form in PERF_SHOWN if key in metrics and not math.isnan(metrics[key])]
