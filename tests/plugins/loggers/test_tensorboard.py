"""--logger tensorboard: event files that TensorBoard's own reader parses, sample tables, resume."""

from __future__ import annotations

import json
import sys

import pytest
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from grpo_core import PluginError, make_plugin
from grpo_core.plugins.loggers.tensorboard import cell
from tests.plugins.loggers.scored_groups import EXPECTED_ROWS, two_groups


def read_events(log_dir) -> EventAccumulator:
    """The log folder as TensorBoard's own server reads it (its data ingester's accumulator)."""
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return events


def tags(events: EventAccumulator, plugin: str) -> list[str]:
    return sorted(tag for tag in events.Tags()["tensors"] if events.SummaryMetadata(tag).plugin_data.plugin_name == plugin)


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    assert events.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
    return [(e.step, make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]


def run_steps(logger, run_dir, steps, start_step=0, offset=0.0):
    logger.on_run_start(config=None, run_dir=run_dir, total_steps=max(steps), start_step=start_step)
    for step in steps:
        metrics = {"reward/total": step + offset, "loss/total": -0.5 * step, "time/step": 0.25, "optim/skipped_nonfinite": 0}
        logger.on_step(step=step, metrics=metrics, state=None, groups=two_groups())
    logger.on_run_end(summary={}, run_dir=run_dir)


def test_metrics_are_scalars_that_tensorboard_reads(tmp_path):
    run_steps(make_plugin("tensorboard", samples_every=0), tmp_path, [1, 2, 3])
    events = read_events(tmp_path / "tensorboard")
    assert tags(events, "scalars") == ["loss/total", "optim/skipped_nonfinite", "reward/total", "time/step"]
    assert scalars(events, "reward/total") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert scalars(events, "loss/total") == [(1, -0.5), (2, -1.0), (3, -1.5)]
    assert tags(events, "text") == []


def table(events: EventAccumulator) -> dict[int, list[list[str]]]:
    return {e.step: [[c.decode() for c in row] for row in make_ndarray(e.tensor_proto)] for e in events.Tensors("samples")}


def test_samples_are_a_text_table_every_n_steps(tmp_path):
    run_steps(make_plugin("tensorboard", samples_every=2, samples_groups=1), tmp_path, [1, 2, 3, 4])
    events = read_events(tmp_path / "tensorboard")
    tables = table(events)
    assert sorted(tables) == [2, 4]
    columns = [c for c in EXPECTED_ROWS[0] if c != "step"]
    assert tables[2][0] == [f"**{c}**" for c in columns]
    assert tables[2][1:] == [[cell(row[c]) for c in columns] for row in EXPECTED_ROWS[:2]]
    # Text is fenced as code so that GSM8K's "####" is not a heading; a backtick inside needs no escape.
    assert tables[2][1][3] == "```\n 4\n#### 4\n```" and tables[2][2][3] == "```\n five `x`\n```"
    assert events.SummaryMetadata("samples").plugin_data.plugin_name == "text"


def test_samples_default_every_ten_steps_four_groups(tmp_path):
    run_steps(make_plugin("tensorboard"), tmp_path, range(1, 11))
    tables = table(read_events(tmp_path / "tensorboard"))
    assert sorted(tables) == [10] and len(tables[10]) == 1 + len(EXPECTED_ROWS)


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, ""), (0.123456, "0.1235"), (3, "3"), ("a", "```\na\n```"), ("x ```` y", "`````\nx ```` y\n`````")],
)
def test_cells(value, text):
    assert cell(value) == text


def test_log_dir_is_an_option(tmp_path):
    run_steps(make_plugin("tensorboard", log_dir="tb/run1"), tmp_path, [1])
    assert scalars(read_events(tmp_path / "tb" / "run1"), "reward/total") == [(1, 1.0)]
    assert not (tmp_path / "tensorboard").exists()


def test_a_resumed_run_hides_the_steps_after_its_checkpoint(tmp_path):
    run_steps(make_plugin("tensorboard", samples_every=1), tmp_path, [1, 2, 3, 4])
    # Resumed from the checkpoint of step 2: steps 3 and 4 run again, with other values.
    run_steps(make_plugin("tensorboard", samples_every=1), tmp_path, [3, 4], start_step=2, offset=10.0)
    events = read_events(tmp_path / "tensorboard")
    assert scalars(events, "reward/total") == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    assert [e.step for e in events.Tensors("samples")] == [1, 2, 3, 4]


def test_without_the_extra_the_message_names_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(
        PluginError, match=r"^--logger tensorboard needs the optional extra 'tensorboard': pip install 'grpo-core\[tensorboard\]'$"
    ):
        make_plugin("tensorboard")


def test_a_run_with_logger_tensorboard_logs_what_metrics_jsonl_holds(tiny_model_dir, tiny_dataset, tmp_path):
    from tests.helpers import grpo_core_in_process, small_run_args

    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "3"),
        "--logger",
        "jsonl",
        "--logger",
        "tensorboard",
        "--logger-opt",
        "jsonl.samples_every=2",
        "--logger-opt",
        "tensorboard.samples_every=2",
    )
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = read_events(run_dir / "tensorboard")
    assert scalars(events, "reward/total") == [(m["step"], pytest.approx(m["reward/total"])) for m in metrics]
    assert len(metrics) == 3 and tags(events, "scalars") == sorted({k for m in metrics for k in m if k != "step"})
    assert scalars(events, "time/step") == [(m["step"], pytest.approx(m["time/step"])) for m in metrics]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ((step, rows),) = table(events).items()
    assert step == 2 and {s["step"] for s in samples} == {2}
    columns = [c.strip("*") for c in rows[0]]
    assert [[cell(s[c]) for c in columns] for s in samples] == rows[1:]
