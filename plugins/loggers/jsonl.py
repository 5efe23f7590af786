from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

import attrs

from grpo_core import hookimpl, option


@attrs.define
class JsonlLogger:
    """Append one JSON object per step (its metrics) to <run_dir>/metrics.jsonl, flushed at once."""

    filename: str = option("metrics.jsonl", help="file name inside the run directory")
    _file: IO[str] | None = attrs.field(default=None, init=False, repr=False)

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None) -> None:
        self._file = (run_dir / self.filename).open("a", encoding="utf-8")

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        assert self._file is not None, "on_run_start opens the file"
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
