from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

import attrs

from grpo_core import hookimpl, option


@attrs.define
class JsonlLogger:
    """Append one JSON object per step (its metrics) to <run_dir>/metrics.jsonl, flushed at once.

    Strict JSON: a non-finite value (NaN, inf) is written as null. A resumed run first drops the
    lines of steps after its checkpoint, so every step appears exactly once.
    """

    filename: str = option("metrics.jsonl", help="file name inside the run directory")
    _file: IO[str] | None = attrs.field(default=None, init=False, repr=False)

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        path = run_dir / self.filename
        keep_lines_up_to(path, start_step)
        self._file = path.open("a", encoding="utf-8")

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        assert self._file is not None, "on_run_start opens the file"
        record = {"step": step, **{k: strict(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def strict(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def keep_lines_up_to(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) with only the records of steps 1..step, each once.

    A line cut short by a kill is dropped too.
    """
    if not path.exists():
        return
    kept: dict[int, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept[record["step"]] = line
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept[s] + "\n" for s in sorted(kept)), encoding="utf-8")
    os.replace(tmp, path)
