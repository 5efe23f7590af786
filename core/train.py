"""``run``: a training run, from the run folder held to the summary, on the loop its config names.

The sync recipe (``grpo_core.loop``) and the async one (``grpo_core.async_loop``) are two loops
over the same stages; neither imports the other, and this is the one place that chooses.
"""

from __future__ import annotations

from typing import Any

from grpo_core.async_loop import run_async
from grpo_core.config import RunConfig
from grpo_core.lifecycle import own_run_dir
from grpo_core.loop import run_sync


def run(config: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train; the run folder is held, locked, from the first check to the summary (both loops)."""
    with own_run_dir(config, resume, overwrite):
        if config.loop == "async":
            return run_async(config, resume, overwrite)
        return run_sync(config, resume, overwrite)
