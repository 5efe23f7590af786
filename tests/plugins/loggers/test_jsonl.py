"""metrics.jsonl: strict JSON, one record per step, trimmed to the checkpoint on resume."""

from __future__ import annotations

import json
import math

from grpo_core.plugins.loggers.jsonl import JsonlLogger, keep_lines_up_to


def strict_loads(line: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_written_as_null(tmp_path):
    logger = JsonlLogger()
    logger.on_run_start(config=None, run_dir=tmp_path, total_steps=2, start_step=0)
    logger.on_step(step=1, metrics={"reward/total": math.nan, "loss/total": math.inf, "optim/lr": 1e-3}, state=None)
    logger.on_run_end(summary={}, run_dir=tmp_path)
    assert [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "reward/total": None, "loss/total": None, "optim/lr": 1e-3}
    ]


def test_a_resumed_run_keeps_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "v": s}) for s in (1, 2, 3, 4, 3)] + ['{"step": 5, "v"']  # a line cut by a kill
    path.write_text("\n".join(lines))
    logger = JsonlLogger()
    logger.on_run_start(config=None, run_dir=tmp_path, total_steps=6, start_step=3)
    logger.on_step(step=4, metrics={"v": 40}, state=None)
    logger.on_run_end(summary={}, run_dir=tmp_path)
    assert [strict_loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "v": 1}, {"step": 2, "v": 2}, {"step": 3, "v": 3}, {"step": 4, "v": 40},
    ]  # fmt: skip


def test_keep_lines_up_to_without_a_file_does_nothing(tmp_path):
    keep_lines_up_to(tmp_path / "none.jsonl", 3)
    assert not (tmp_path / "none.jsonl").exists()
