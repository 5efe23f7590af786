"""--logger wandb in offline mode: a run folder under the run directory, read back record by record; never a network."""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest
import wandb

from grpo_core import PluginError, make_plugin
from grpo_core.plugins.loggers.wandb import RUN_ID_FILE
from tests.plugins.loggers.scored_groups import EXPECTED_ROWS, two_groups


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path_factory):
    """W&B without a network, an account, or files outside the test's folders."""
    home = tmp_path_factory.mktemp("wandb-home")
    for variable, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }.items():
        monkeypatch.setenv(variable, value)
    for variable in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(variable, raising=False)


def read_records(run_folder) -> list:
    """The records of an offline run's ``run-<id>.wandb`` (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_folder.glob("run-*.wandb")
    data, records, pending = log.read_bytes(), [], b""
    block, pos = 32768, 7  # 7: the file header (":W&B", magic, version)
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records) -> dict[int, dict[str, object]]:
    steps = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items: dict[str, object] = {}
            for item in r.history.item:  # a logged table is a dict of several items: ["samples", "path"], ...
                key, *sub = list(item.nested_key) or [item.key]
                if sub:
                    items.setdefault(key, {})[sub[0]] = json.loads(item.value_json)
                else:
                    items[key] = json.loads(item.value_json)
            steps[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
    return steps


def run_record(records):
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return run


def run_steps(logger, run_dir, steps, start_step=0, offset=0.0):
    from grpo_core.config import RunConfig
    from grpo_core.plugins_manager import write_config

    config = RunConfig(plugin_options={"reward": {"remote": {"api_key": "hunter2", "url": "http://x"}}})
    write_config(config, run_dir / "config.json")
    logger.on_run_start(config=config, run_dir=run_dir, total_steps=max(steps), start_step=start_step)
    for step in steps:
        logger.on_step(step=step, metrics={"reward/total": step + offset, "loss/total": float("nan")}, state=None, groups=two_groups())
    logger.on_run_end(summary={}, run_dir=run_dir)
    wandb.teardown()  # the W&B service writes the log out when it stops


def run_folders(root):
    return sorted((root / "wandb").glob("offline-run-*"))


@pytest.mark.slow  # 4-6 s: the quick suite stays under its 5 minutes
def test_an_offline_run_writes_metrics_config_and_its_id_under_the_run_directory(tmp_path):
    run_steps(make_plugin("wandb", samples_every=0), tmp_path, [1, 2, 3])
    (folder,) = run_folders(tmp_path)
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert folder.name.endswith(f"-{run_id}") and len(run_id) == 8
    records = read_records(folder)
    steps = history(records)
    assert sorted(steps) == [1, 2, 3]
    assert steps[2]["reward/total"] == 2.0 and math.isnan(steps[2]["loss/total"])
    run = run_record(records)
    assert (run.run_id, run.project, run.display_name, run.run_group, list(run.tags)) == (run_id, "grpo-core", tmp_path.name, "", [])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["plugin_options"]["reward"]["remote"] == {"api_key": "***", "url": "http://x"}
    assert config["learning_rate"] == json.loads((tmp_path / "config.json").read_text())["learning_rate"]
    assert not (folder / "files" / "media").exists()


def test_project_entity_run_name_group_and_tags_are_options(tmp_path):
    logger = make_plugin("wandb", project="p1", entity="team-x", run_name="n1", group="g1", tags="a, b,,c")
    run_steps(logger, tmp_path, [1])
    run = run_record(read_records(run_folders(tmp_path)[0]))
    assert (run.project, run.entity, run.display_name, run.run_group, list(run.tags)) == ("p1", "team-x", "n1", "g1", ["a", "b", "c"])


def tables(folder) -> dict[int, dict]:
    """The sample table logged at each step, read from the file its history record points at."""
    return {
        step: json.loads((folder / "files" / metrics["samples"]["path"]).read_text())
        for step, metrics in history(read_records(folder)).items()
        if "samples" in metrics
    }


def test_samples_are_a_table_every_n_steps(tmp_path):
    run_steps(make_plugin("wandb", samples_every=2, samples_groups=1), tmp_path, [1, 2, 3, 4])
    (folder,) = run_folders(tmp_path)
    logged = tables(folder)
    assert sorted(logged) == [2, 4]
    columns = [c for c in EXPECTED_ROWS[0] if c != "step"]
    assert logged[2]["columns"] == columns
    assert logged[2]["data"] == [[row[c] for c in columns] for row in EXPECTED_ROWS[:2]]


def test_samples_default_every_ten_steps_four_groups(tmp_path):
    run_steps(make_plugin("wandb"), tmp_path, range(1, 11))
    logged = tables(run_folders(tmp_path)[0])
    assert sorted(logged) == [10] and logged[10]["data"] == [[row[c] for c in row if c != "step"] for row in EXPECTED_ROWS]


def test_a_resumed_run_goes_on_with_the_same_wandb_run(tmp_path):
    run_steps(make_plugin("wandb", samples_every=0), tmp_path, [1, 2, 3])
    first = (tmp_path / RUN_ID_FILE).read_text()
    run_steps(make_plugin("wandb", samples_every=0), tmp_path, [3, 4], start_step=2, offset=10.0)
    assert (tmp_path / RUN_ID_FILE).read_text() == first
    folders = run_folders(tmp_path)
    assert len(folders) == 2 and [run_record(read_records(f)).run_id for f in folders] == [first.strip()] * 2
    assert {step: m["reward/total"] for step, m in history(read_records(folders[1])).items()} == {3: 13.0, 4: 14.0}


def test_wandb_dir_and_mode_are_respected(tmp_path, monkeypatch):
    for name in ("run", "offline", "disabled"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    run_steps(make_plugin("wandb"), tmp_path / "run", [1])
    assert len(run_folders(tmp_path / "elsewhere")) == 1 and not (tmp_path / "run" / "wandb").exists()
    monkeypatch.delenv("WANDB_DIR")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the option wins; were it ignored, nothing would be written (and no network tried)
    run_steps(make_plugin("wandb", mode="offline"), tmp_path / "offline", [1])
    assert len(run_folders(tmp_path / "offline")) == 1
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_steps(make_plugin("wandb", mode="disabled"), tmp_path / "disabled", [1])
    assert not (tmp_path / "disabled" / "wandb").exists()


def test_a_bad_mode_is_refused():
    with pytest.raises(PluginError, match="mode must be online, offline or disabled, not 'ofline'"):
        make_plugin("wandb", mode="ofline")


def test_without_the_extra_the_message_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(PluginError, match=r"^--logger wandb needs the optional extra 'wandb': pip install 'grpo-core\[wandb\]'$"):
        make_plugin("wandb")


def test_a_run_with_logger_wandb_offline_writes_a_run_folder(tiny_model_dir, tiny_dataset, tmp_path):
    from tests.helpers import grpo_core_in_process, small_run_args

    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "3"),
        "--logger", "jsonl", "--logger", "wandb", "--logger-opt", "jsonl.samples_every=2", "--logger-opt", "wandb.samples_every=2",
        "--logger-opt", "wandb.project=tiny",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    wandb.teardown()  # what the end of a grpo-core process does: the W&B service writes the log out
    (folder,) = run_folders(run_dir)
    records = read_records(folder)
    run = run_record(records)
    assert (run.run_id, run.project, run.display_name) == ((run_dir / RUN_ID_FILE).read_text().strip(), "tiny", "run")
    assert json.loads(next(i.value_json for i in run.config.update if i.key == "logger")) == ["jsonl", "wandb"]
    metrics = {m.pop("step"): m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    logged = history(records)
    assert sorted(logged) == [1, 2, 3]
    assert all(logged[step][k] == pytest.approx(v) for step, m in metrics.items() for k, v in m.items() if v is not None)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ((step, table),) = tables(folder).items()
    assert step == 2 and table["data"] == [[s[c] for c in table["columns"]] for s in samples]
