from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from grpo_core import hookimpl, option
from grpo_core.loss import validate_non_negative, validate_positive
from grpo_core.types import Sample, prompt_text


@attrs.define
class SampleTableOptions:
    """The options of a logger that shows a table of samples every N steps."""

    samples_every: int = option(10, help="write a table of the step's samples every N steps (0 = never)", validator=validate_non_negative)
    samples_groups: int = option(4, help="prompt groups per table (each with all its samples)", validator=validate_positive)

    def wants_samples(self, step: int) -> bool:
        return self.samples_every > 0 and step % self.samples_every == 0


@attrs.define
class JsonlLogger(SampleTableOptions):
    """Append one JSON object per step (its metrics) to <run_dir>/metrics.jsonl, flushed at once.

    Every `samples_every` steps it also appends the samples of the step's first `samples_groups`
    prompt groups to <run_dir>/samples.jsonl, one object per sample: step, group, sample,
    prompt, completion, reward/total, reward/<name> per reward plugin, reward_detail/<name> where a
    reward explains its score (a judge's reply), advantage, tokens and finish_reason.

    Strict JSON: a non-finite value (NaN, inf) is written as null. A resumed run first drops the
    lines of steps after its checkpoint, so every step appears exactly once.
    """

    filename: str = option("metrics.jsonl", help="file name inside the run directory")
    samples_filename: str = option("samples.jsonl", help="file name of the sample table inside the run directory")
    _file: IO[str] | None = attrs.field(default=None, init=False, repr=False)
    _samples_file: IO[str] | None = attrs.field(default=None, init=False, repr=False)

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        path = run_dir / self.filename
        keep_lines_up_to(path, start_step)
        self._file = path.open("a", encoding="utf-8")
        samples = run_dir / self.samples_filename
        keep_lines_up_to(samples, start_step, key=sample_key)
        if self.samples_every:
            self._samples_file = samples.open("a", encoding="utf-8")

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any, groups: Sequence[Sequence[Sample]]) -> None:
        assert self._file is not None, "on_run_start opens the file"
        record = {"step": step, **{k: strict(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._samples_file is not None and self.wants_samples(step):
            rows = sample_rows(step, groups[: self.samples_groups])
            self._samples_file.write("".join(json.dumps(row, allow_nan=False) + "\n" for row in rows))
            self._samples_file.flush()

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        for file in (self._file, self._samples_file):
            if file is not None:
                file.close()
        self._file = self._samples_file = None


def sample_rows(step: int, groups: Sequence[Sequence[Sample]]) -> list[dict[str, Any]]:
    """One flat record per sample of ``groups``: what the sample tables of every logger show.

    Rewards are ``reward/total`` and ``reward/<name>`` per reward plugin, as in the metrics; a
    failed score, and the advantage of a group that was not trained on, are None.
    """
    rows = []
    for g, group in enumerate(groups):
        for i, sample in enumerate(group):
            rows.append(
                {
                    "step": step,
                    "group": g,
                    "sample": i,
                    "prompt": prompt_text(sample.prompt),
                    "completion": sample.text,
                    "reward/total": strict(sample.reward),
                    **{f"reward/{name}": strict(value) for name, value in sample.rewards.items()},
                    **{f"reward_detail/{name}": detail for name, detail in sample.reward_details.items()},
                    "advantage": advantage(sample),
                    "tokens": sample.num_completion_tokens,
                    "finish_reason": sample.finish_reason,
                }
            )
    return rows


def sample_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns of a sample table of ``rows`` (one table is one step: no step column)."""
    return [c for c in dict.fromkeys(k for row in rows for k in row) if c != "step"]


def advantage(sample: Sample) -> float | None:
    """The mean advantage over the sample's trained tokens (its advantage when it is one per sequence)."""
    if sample.advantages is None:
        return None
    trained = [a for a, m in zip(sample.advantages, sample.loss_mask) if m]
    return strict(sum(trained) / len(trained)) if trained else None


def sample_key(record: dict[str, Any]) -> tuple[int, int, int] | None:
    if not all(isinstance(record.get(k), int) for k in ("step", "group", "sample")):
        return None
    return record["step"], record["group"], record["sample"]


def strict(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def step_key(record: dict[str, Any]) -> int | None:
    return record["step"] if isinstance(record.get("step"), int) else None


def keep_lines_up_to(path: Path, step: int, key: Callable[[dict[str, Any]], Any] = step_key) -> None:
    """Rewrite ``path`` (atomically) with only the records of steps 1..step, each ``key`` once
    (the last written wins), in the order of their keys.

    ``key`` identifies a record (its step, by default); a record without one, and a line cut
    short by a kill, are dropped.
    """
    if not path.exists():
        return
    kept: dict[Any, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        record_key = key(record) if isinstance(record, dict) else None
        if record_key is not None and record["step"] <= step:
            kept[record_key] = line
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept[k] + "\n" for k in sorted(kept)), encoding="utf-8")
    os.replace(tmp, path)
