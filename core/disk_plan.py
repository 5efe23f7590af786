"""The disk plan: what a run's checkpoints and ``final/`` take at most on its run folder's
filesystem, sized before the model loads and refused when it cannot fit (``--allow-low-disk``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs

from grpo_core.checkpoint import (
    DTYPE_BYTES,
    CheckpointError,
    complete_checkpoints,
    estimated_bytes,
    folder_bytes,
    free_bytes,
    human,
    no_space,
    peak_bytes,
    tensor_shapes,
)
from grpo_core.config import RunConfig
from grpo_core.embedded import ASSETS
from grpo_core.hookspecs import declared


@attrs.frozen
class DiskPlan:
    """What a run's checkpoints and ``final/`` take at most on its run directory's filesystem."""

    each: int
    each_is: str
    """How ``each`` was found, in words."""
    final: int
    writes: int
    """Checkpoints this run writes (periodic and the end's)."""
    needed: int
    """The most bytes the run adds to its folder at once (see :func:`grpo_core.checkpoint.peak_bytes`)."""
    free: int
    folder: Path

    def line(self) -> str:
        return (
            f"disk plan: each checkpoint about {human(self.each)} ({self.each_is}), {self.writes} to write, "
            f"final/ {human(self.final)}: up to {human(self.needed)} at once on the filesystem of {self.folder}, {human(self.free)} free"
        )

    @classmethod
    def of(
        cls, config: RunConfig, backend: Any, newest: Path | None, total_steps: int, trainer_bytes: int | None, replaced: list[str]
    ) -> DiskPlan | None:
        """Sizes from what is there: a resumed run's newest checkpoint and final/ as they are, else the
        trainer's own estimate (``checkpoint_bytes``), else one from the model's safetensors headers."""
        run_dir = Path(str(config.run_dir))
        folder = model_folder(config.model)
        shapes = tensor_shapes(folder) if folder is not None else None
        each = final = None
        if shapes is not None:
            saved_as = declared(backend, "backend", "checkpoint_weights")
            saved_bytes = DTYPE_BYTES[saved_as] if saved_as is not None else None
            each, final, each_is = estimated_bytes(shapes, weight_bytes(config), config.lora_rank, config.optimizer_state, saved_bytes)
        if not declared(backend, "backend", "local_checkpoints"):
            each, each_is = 0, "the backend's service keeps the trainer's state"
        if trainer_bytes is not None:
            each, each_is = trainer_bytes, "the trainer's estimate"
        existing = complete_checkpoints(run_dir) if newest is not None else []
        if newest is not None:
            each, each_is = folder_bytes(newest), f"the size of {newest.name}"
            if (run_dir / "final").is_dir():
                final = folder_bytes(run_dir / "final")
        if each is None or final is None:
            return None
        if config.sampling_runs_ahead and newest is None and declared(backend, "backend", "local_checkpoints"):
            each, each_is = each + final, f"{each_is} + the sampler's own copy of the weights"
        start = int(newest.name.removeprefix("step-")) if newest is not None else 0
        every = config.checkpoint_every
        periodic = total_steps // every - start // every if every else 0
        writes = periodic + int(total_steps > start and (not every or total_steps % every != 0))
        # What --overwrite replaces is deleted once training begins: its space is the run's.
        freed = sum(folder_bytes(run_dir / name) or (run_dir / name).stat().st_size for name in replaced)
        needed = peak_bytes(each, final, len(existing), writes, config.keep_checkpoints)
        return cls(each, each_is, final, writes, needed, free_bytes(run_dir) + freed, run_dir)


def plan_disk(
    config: RunConfig, backend: Any, newest: Path | None, total_steps: int, replaced: list[str], trainer_bytes: int | None = None
) -> DiskPlan | None:
    """The run's disk plan, refused when it cannot fit (unless --allow-low-disk); None when the
    checkpoints' size cannot be known yet (a hub model not in the cache: planned once it loads)."""
    plan = DiskPlan.of(config, backend, newest, total_steps, trainer_bytes, replaced)
    if plan is None or plan.needed <= plan.free:
        return plan
    shrunk = [
        (flag, DiskPlan.of(attrs.evolve(config, **change), backend, newest, total_steps, trainer_bytes, replaced))
        for flag, change, applies in (
            ("--keep-checkpoints 1", {"keep_checkpoints": 1}, config.keep_checkpoints > 1),
            ("--checkpoint-every 0 (one checkpoint, at the end)", {"checkpoint_every": 0}, plan.writes > 1),
            ("--lora-rank 16 (LoRA adapters only)", {"lora_rank": 16}, not config.lora_rank and trainer_bytes is None),
        )
        if applies
    ]
    options = [f"{flag}: {human(smaller.needed)}" for flag, smaller in shrunk if smaller is not None and smaller.needed < plan.needed]
    problem = (
        f"the run directory cannot hold this run's checkpoints: {no_space(plan.folder, human(plan.needed), plan.free)} "
        f"({plan.line().removeprefix('disk plan: ')}); "
        + (f"what these options need: {'; '.join(options)}; " if options else "")
        + "or choose a --run-dir on a larger disk"
    )
    if not config.allow_low_disk:
        raise CheckpointError(f"{problem}; --allow-low-disk starts it anyway")
    print(f"warning: {problem} (--allow-low-disk: starting anyway)", file=sys.stderr)
    return plan


def model_folder(model: str) -> Path | None:
    """Where the model's weights are on this machine before it loads (None: a hub model not in the cache)."""
    if model == "default":
        return ASSETS
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(model, "config.json") if model.count("/") <= 1 else None
    return Path(config).parent if isinstance(config, str) else None


def weight_bytes(config: RunConfig) -> int:
    """Bytes per weight as the trainer holds and saves them (--dtype auto: bfloat16 on CUDA)."""
    if config.dtype != "auto":
        return DTYPE_BYTES[config.dtype]
    import torch

    on_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return DTYPE_BYTES["bfloat16" if on_cuda else "float32"]
