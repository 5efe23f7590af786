"""metrics.jsonl: strict JSON, one record per step, trimmed to the checkpoint on resume."""

from __future__ import annotations

import json
import math

import pytest

from grpo_core import PluginError, make_plugin
from grpo_core.plugins.loggers.jsonl import JsonlLogger, keep_lines_up_to, sample_rows
from tests.plugins.loggers.scored_groups import EXPECTED_ROWS, two_groups


def strict_loads(line: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_written_as_null(tmp_path):
    logger = JsonlLogger()
    logger.on_run_start(config=None, run_dir=tmp_path, total_steps=2, start_step=0)
    logger.on_step(step=1, metrics={"reward/total": math.nan, "loss/total": math.inf, "optim/lr": 1e-3}, state=None, groups=[])
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
    logger.on_step(step=4, metrics={"v": 40}, state=None, groups=[])
    logger.on_run_end(summary={}, run_dir=tmp_path)
    assert [strict_loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "v": 1}, {"step": 2, "v": 2}, {"step": 3, "v": 3}, {"step": 4, "v": 40},
    ]  # fmt: skip


def test_keep_lines_up_to_without_a_file_does_nothing(tmp_path):
    keep_lines_up_to(tmp_path / "none.jsonl", 3)
    assert not (tmp_path / "none.jsonl").exists()


def run_steps(logger, run_dir, steps, start_step=0):
    logger.on_run_start(config=None, run_dir=run_dir, total_steps=max(steps), start_step=start_step)
    for step in steps:
        logger.on_step(step=step, metrics={"reward/total": float(step)}, state=None, groups=two_groups())
    logger.on_run_end(summary={}, run_dir=run_dir)


def read_jsonl(path):
    return [strict_loads(line) for line in path.read_text().splitlines()]


def test_sample_rows_hold_prompt_completion_and_each_reward():
    assert sample_rows(7, two_groups()) == [{"step": 7, **row} for row in EXPECTED_ROWS]


def test_samples_are_written_every_n_steps_for_the_first_groups(tmp_path):
    run_steps(make_plugin("jsonl", samples_every=2, samples_groups=1), tmp_path, range(1, 6))
    assert read_jsonl(tmp_path / "samples.jsonl") == [{"step": step, **row} for step in (2, 4) for row in EXPECTED_ROWS[:2]]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_samples_default_every_ten_steps_all_of_four_groups(tmp_path):
    run_steps(make_plugin("jsonl"), tmp_path, range(1, 21))
    assert read_jsonl(tmp_path / "samples.jsonl") == [{"step": step, **row} for step in (10, 20) for row in EXPECTED_ROWS]


def test_samples_every_zero_writes_no_sample_file(tmp_path):
    run_steps(make_plugin("jsonl", samples_every=0), tmp_path, [10])
    assert not (tmp_path / "samples.jsonl").exists() and len(read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_file_names_are_options(tmp_path):
    run_steps(make_plugin("jsonl", samples_every=1, filename="m.jsonl", samples_filename="s.jsonl"), tmp_path, [1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", "s.jsonl"]
    assert len(read_jsonl(tmp_path / "s.jsonl")) == 4 and read_jsonl(tmp_path / "m.jsonl") == [{"step": 1, "reward/total": 1.0}]


@pytest.mark.parametrize(("option", "value"), [("samples_every", -1), ("samples_groups", 0)])
def test_bad_sample_options_are_refused(option, value):
    with pytest.raises(PluginError, match=f"{option} must be"):
        make_plugin("jsonl", **{option: value})


def test_a_resumed_run_keeps_each_sample_once(tmp_path):
    run_steps(make_plugin("jsonl", samples_every=1, samples_groups=1), tmp_path, [1, 2, 3])
    with (tmp_path / "samples.jsonl").open("a") as f:
        f.write('{"step": 4, "group": 0, "sa')  # a line cut by a kill
    # The checkpoint was at step 2: step 3 runs again.
    run_steps(make_plugin("jsonl", samples_every=1, samples_groups=1), tmp_path, [3], start_step=2)
    assert [(r["step"], r["sample"]) for r in read_jsonl(tmp_path / "samples.jsonl")] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_rewards_details_show_beside_its_score():
    groups = two_groups()
    groups[0][1].reward_details["judge"] = "Score: 7"
    rows = sample_rows(3, groups)
    assert rows[1]["reward_detail/judge"] == "Score: 7"
    assert all("reward_detail/judge" not in row for i, row in enumerate(rows) if i != 1)
