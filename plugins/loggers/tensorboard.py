from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core import hookimpl, option
from grpo_core.data import import_extra
from grpo_core.plugins.loggers.jsonl import SampleTableOptions, sample_columns, sample_rows
from grpo_core.types import Sample

SAMPLES_TAG = "samples"


@attrs.define
class TensorBoardLogger(SampleTableOptions):
    """Write every step's metrics as TensorBoard scalars to <run_dir>/<log_dir>
    (`tensorboard --logdir RUN_DIR`), flushed after each step.

    Every `samples_every` steps the samples of the step's first `samples_groups` prompt groups
    show as a table in TensorBoard's Text tab (tag `samples`): prompt, completion, reward/total,
    reward/<name> per reward plugin, advantage, tokens, finish reason. A resumed run hides what
    the stopped one wrote after its checkpoint (TensorBoard's purge_step).
    Needs `pip install 'grpo-core[tensorboard]'`.
    """

    log_dir: str = option("tensorboard", help="folder for the event files, inside the run directory")
    _writer: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Checked when the run selects the logger, so a missing extra stops it before the model loads.
        import_extra("torch.utils.tensorboard", "tensorboard", "--logger tensorboard")

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Every start marks a session start at its first step. TensorBoard takes the first mark
        # in a log folder as the start and a later one as a restart: it then hides what the
        # stopped run wrote from that step on.
        self._writer = SummaryWriter(log_dir=str(run_dir / self.log_dir), purge_step=start_step + 1)

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any, groups: Sequence[Sequence[Sample]]) -> None:
        assert self._writer is not None, "on_run_start opens the writer"
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)
        rows = sample_rows(step, groups[: self.samples_groups]) if self.wants_samples(step) else []
        if rows:
            # add_text writes a single string; a table is a 2-D string tensor, so it goes to the
            # writer's own event file directly.
            self._writer._get_file_writer().add_summary(text_table(SAMPLES_TAG, rows), step)
        self._writer.flush()

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def text_table(tag: str, rows: list[dict[str, Any]]) -> Any:
    """A summary that TensorBoard's Text tab shows as a table: a 2-D string tensor, header row first.

    Text cells are fenced as code, so a completion's line breaks and markdown (GSM8K's ``####``)
    show as written; the step is the summary's own.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    columns = sample_columns(rows)
    cells = [f"**{c}**" for c in columns] + [cell(row.get(c)) for row in rows for c in columns]
    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name="text", content=TextPluginData(version=0).SerializeToString())
    )
    tensor = TensorProto(
        dtype="DT_STRING",
        string_val=[c.encode("utf-8") for c in cells],
        tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=len(rows) + 1), TensorShapeProto.Dim(size=len(columns))]),
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", value)), default=0))
        return f"{fence}\n{value}\n{fence}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
