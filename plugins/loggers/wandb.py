from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core import hookimpl, option
from grpo_core.data import import_extra
from grpo_core.plugins.loggers.jsonl import SampleTableOptions, sample_columns, sample_rows
from grpo_core.plugins_manager import scrubbed, secret_values
from grpo_core.types import Sample

RUN_ID_FILE = "wandb_run_id"
"""Beside config.json: the W&B run a resumed run goes on with."""
SAMPLES_KEY = "samples"
MODES = (None, "online", "offline", "disabled")


def _validate_mode(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value not in MODES:
        raise ValueError(f"mode must be online, offline or disabled, not {value!r}")


@attrs.define
class WandbLogger(SampleTableOptions):
    """Log every step's metrics to Weights & Biases, at the run's step, with the run's config
    (as in config.json, secrets shown as ***) as the W&B config.

    Every `samples_every` steps the samples of the step's first `samples_groups` prompt groups
    are logged as a W&B Table (key `samples`): prompt, completion, reward/total, reward/<name>
    per reward plugin, advantage, tokens, finish reason. The W&B run id is kept in
    <run_dir>/wandb_run_id, so `--resume` goes on with the same W&B run (W&B ignores steps it
    already has: those the stopped run logged after its checkpoint keep their first values). W&B's files go to <run_dir>/wandb
    unless WANDB_DIR is set; `mode=offline` (or WANDB_MODE=offline) logs without a network, for
    `wandb sync` later. Needs `pip install 'grpo-core[wandb]'`.
    """

    project: str = option("grpo-core", help="W&B project")
    entity: str | None = option(None, help="W&B entity (user or team); default: your default entity")
    run_name: str | None = option(None, help="the run's name in W&B; default: the run directory's name")
    group: str | None = option(None, help="W&B group, to show several runs together")
    tags: str = option("", help="comma-separated W&B tags")
    mode: str | None = option(None, help="online, offline or disabled; default: WANDB_MODE, else online", validator=_validate_mode)
    _run: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Checked when the run selects the logger, so a missing extra stops it before the model loads.
        import_extra("wandb", "wandb", "--logger wandb")

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        import wandb

        id_file = run_dir / RUN_ID_FILE
        config_file = run_dir / "config.json"
        # W&B records the command line (sys.argv, read by wandb.init) in the run's metadata, which
        # `wandb sync` uploads: a secret typed there is shown as *** there, as in config.json.
        argv, sys.argv = sys.argv, [scrubbed(arg, secret_values(config.plugin_options)) for arg in sys.argv]
        try:
            self._run = wandb.init(
                project=self.project,
                entity=self.entity,
                name=self.run_name or run_dir.name,
                group=self.group,
                tags=[t.strip() for t in self.tags.split(",") if t.strip()],
                mode=self.mode,
                id=id_file.read_text().strip() if id_file.is_file() else None,
                resume="allow",
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
                config=json.loads(config_file.read_text()) if config_file.is_file() else None,
            )
        finally:
            sys.argv = argv
        id_file.write_text(self._run.id + "\n")

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any, groups: Sequence[Sequence[Sample]]) -> None:
        assert self._run is not None, "on_run_start starts the W&B run"
        record: dict[str, Any] = dict(metrics)
        rows = sample_rows(step, groups[: self.samples_groups]) if self.wants_samples(step) else []
        if rows:
            import wandb

            columns = sample_columns(rows)
            record[SAMPLES_KEY] = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self._run.log(record, step=step)

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
