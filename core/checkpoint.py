"""Checkpoints: everything a run needs to continue exactly where it stopped.

``RUN_DIR/checkpoints/step-000050/`` holds the trainer's state (through ``trainer.save_state``,
so a remote trainer checkpoints remotely), the sampler's state (its RNG, and its weights when
it keeps a copy of its own), every process RNG, the loop's counters and the prompt settings.
A checkpoint is written into a temporary folder, fsynced and renamed: a folder named
``step-*`` is complete, whatever happened while it was written, and the previous ones are only
pruned once it is. A write that fails for lack of space says so (the filesystem, the space
needed and free), not the writer's own error.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.run_dir import TMP_PREFIX
from grpo_core.types import CHECKPOINTED, RunState

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
TRAINER_STATE = "trainer"
"""What ``trainer.save_state`` writes in a checkpoint (the local trainer: a folder of weights and optimizer state)."""
UNOBSERVED_FILE = "unobserved.json"
"""In a checkpoint of a step that was counted but not observed (a plugin's ``on_step`` or the
weight sync failed): the step's metrics, which the resumed run gives its plugins first."""


class CheckpointError(PluginError):
    """A checkpoint or policy could not be written or read; the message says what is still valid."""


def capture_rng(sampler: Any) -> dict[str, Any]:
    """Every random state a step consumes, taken at a step boundary (``sampler``: None where a
    recipe samples nothing)."""
    import torch

    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if sampler is not None and not declared(sampler, "sampler object", "stateless"):
        rng["sampler"] = sampler.state_dict()
    return rng


def restore_rng(rng: dict[str, Any], sampler: Any) -> None:
    import torch

    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "sampler" in rng:
        sampler.load_state_dict(rng["sampler"])


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders of a run, oldest first; half-written ones (temporary names) never count."""
    folder = run_dir / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def save_checkpoint(state: RunState, trainer: Any, write_extra: Callable[[Path], Any], keep: int, background: bool = False) -> Path:
    """Write the checkpoint of ``state.step`` atomically (its :data:`CHECKPOINTED` fields and
    ``state.rng``) and keep the newest ``keep``.

    ``write_extra(folder)`` adds what other modules own (the prompt settings). A failure leaves
    the previous checkpoints as they were. ``background``: where the trainer declares a
    ``state_snapshot``, its state is copied here and written by a thread while training goes on
    (the folder is complete once :func:`wait_for_checkpoint` returns); the previous background
    write is always waited for first, and its error raised.
    """
    import torch

    run_dir = state.run_dir
    wait_for_checkpoint(run_dir)
    final = checkpoint_dir(run_dir, state.step)
    if (final / STATE_FILE).is_file():
        return final  # this step is saved already (a periodic checkpoint that is also the last)
    previous = complete_checkpoints(run_dir)
    kept = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
    where = final.parent if final.parent.is_dir() else run_dir
    free = free_bytes(where)
    # A checkpoint is as large as the one before it: one that cannot fit is not begun (a full disk
    # stops whatever else writes there).
    needed = folder_bytes(previous[-1]) if previous else None
    estimate = f"about {human(needed)} (the size of {previous[-1].name})" if needed is not None else None
    if needed is not None and needed > free:
        raise CheckpointError(f"could not write checkpoint {final.name}: {no_space(where, estimate, free)}; {kept}")
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{os.getpid()}")

    def fail(exc: BaseException) -> NoReturn:
        """Remove the partial folder of a write that raised ``exc`` and say why it failed (an interrupt goes on as it is)."""
        written = folder_bytes(tmp)
        full = out_of_space(exc) or free_bytes(where) < FULL_BELOW  # measured before the partial write is removed
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise exc
        cause = f"{type(exc).__name__}: {exc}"
        if full:
            space = no_space(where, estimate or f"more than {human(written)}", free)
            # torch's C++ writer says "unexpected pos" or "file write failed": the space says what happened.
            cause = f"{cause}; {space}" if isinstance(exc, OSError) else space
        raise CheckpointError(f"could not write checkpoint {final.name}: {cause}; {kept}") from exc

    snapshot = declared(trainer, "trainer object", "state_snapshot") if background else None
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # Everything a later step changes is taken now, on the training thread.
        write_trainer = snapshot() if snapshot is not None else None
        if write_trainer is None:
            trainer.save_state(str(tmp / TRAINER_STATE))
        torch.save(state.rng or {}, tmp / "rng.pt")
        write_extra(tmp)
        record = {name: getattr(state, name) for name in CHECKPOINTED}
    except BaseException as exc:
        fail(exc)

    def complete() -> None:
        try:
            if write_trainer is not None:
                write_trainer(str(tmp / TRAINER_STATE))
            # state.json last: its presence inside a step-* folder marks a whole checkpoint.
            (tmp / STATE_FILE).write_text(json.dumps(record, indent=1) + "\n")
            fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)  # an incomplete folder of that name
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except BaseException as exc:
            fail(exc)
        for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    if write_trainer is None:
        complete()
    else:
        WRITING[run_dir] = BackgroundWrite(complete, final)
    return final


class BackgroundWrite:
    """A checkpoint's files, written by a thread of their own; the error it ended with, kept for
    whoever waits. Not a daemon: a process that ends while it writes finishes the checkpoint first."""

    def __init__(self, write: Callable[[], None], folder: Path) -> None:
        self.folder = folder
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-write")
        self.thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as exc:  # raised where the run waits, not in this thread
            self.error = exc


WRITING: dict[Path, BackgroundWrite] = {}
"""The checkpoint write in progress per run folder (one at a time: each waits for the one before)."""


def checkpoint_steps(run_dir: Path) -> set[int]:
    """The steps of the run's complete checkpoints and of the one being written in the background
    (what belongs to it must outlive its write)."""
    folders = complete_checkpoints(run_dir)
    if (pending := WRITING.get(run_dir)) is not None:
        folders.append(pending.folder)
    return {int(p.name.removeprefix("step-")) for p in folders}


def wait_for_checkpoint(run_dir: Path) -> None:
    """Wait until the run's background checkpoint write is done; raise its error (a
    :class:`CheckpointError` that says what is still valid)."""
    pending = WRITING.pop(run_dir, None)
    if pending is None:
        return
    pending.thread.join()
    if pending.error is not None:
        raise pending.error


FULL_BELOW = 64 * 2**20
"""Free bytes under which a failed write is taken for a full disk (a C++ writer's error carries no errno)."""


def free_bytes(folder: Path) -> int:
    """What an unprivileged process may still write on ``folder``'s filesystem."""
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is the filesystem's "no space" or "quota"."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def no_space(folder: Path, needed: str, free: int) -> str:
    mount = folder.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    return f"no space left on {mount}: needed {needed}, free {human(free)}"


def human(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale / 10:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


ADAM_BYTES_PER_PARAMETER = 8
"""AdamW's two fp32 moments per trained parameter: the optimizer state a checkpoint holds by default."""
MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 2 * 4 / 256, "offload": 8.0}
"""What a checkpoint holds of AdamW's two moments per trained parameter, by ``--optimizer-state``
(grpo_core.engine.optim): 8bit is a byte of each and a float32 absmax per 256 (QUANT_BLOCK) elements of each."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets, counted from the
    second value) and where its data starts, read alone; ValueError says why the file has none."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError("is empty")
    with path.open("rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little") if len(head) == 8 else size
        if 8 + header_size > size:
            raise ValueError(f"is cut short ({size} bytes, not even its header)")
        try:
            return json.loads(f.read(header_size)), 8 + header_size
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("is not a safetensors file (its header is not JSON)") from None


def tensor_shapes(folder: Path) -> dict[str, list[int]] | None:
    """Name -> shape of every tensor in a model folder's safetensors files (None without any, or unreadable)."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            header, _ = safetensors_header(path)
        except (OSError, ValueError):
            return None
        shapes.update({name: entry["shape"] for name, entry in header.items() if name != "__metadata__"})
    return shapes or None


def estimated_bytes(
    shapes: dict[str, list[int]], weight_bytes: int, lora_rank: int, optimizer_state: str = "fp32", saved_weight_bytes: int | None = None
) -> tuple[int, int, str]:
    """What one checkpoint and ``final/`` hold for a model of these tensors, and the first in words.

    A full fine-tune saves every weight in its dtype (``saved_weight_bytes`` where the trainer saves
    them otherwise: fsdp's float32 master weights) and AdamW's two moments per weight as
    ``optimizer_state`` keeps them (:data:`MOMENT_BYTES`); a LoRA run saves its adapters only,
    counted here as rank x (rows + columns) of every matrix in the decoder layers (the most
    ``all-linear`` adds), in fp32. ``final/`` is the whole (merged) model in its dtype.
    """
    parameters = sum(math.prod(shape) for shape in shapes.values())
    final = parameters * weight_bytes
    # auto's memory plan chooses after this plan has run: the largest it may choose.
    optimizer_state = "fp32" if optimizer_state == "auto" else optimizer_state
    moments = f"{optimizer_state} AdamW moments"
    if not lora_rank:
        weights = parameters * (saved_weight_bytes or weight_bytes)
        return weights + round(parameters * MOMENT_BYTES[optimizer_state]), final, f"weights {human(weights)} + {moments}"
    trained = sum(lora_rank * (shape[0] + shape[1]) for name, shape in shapes.items() if len(shape) == 2 and "layers." in name)
    adapters = trained * DTYPE_BYTES["float32"]
    return adapters + round(trained * MOMENT_BYTES[optimizer_state]), final, f"LoRA adapters {human(adapters)} + {moments}"


def peak_bytes(each: int, final: int, existing: int, writes: int, keep: int) -> int:
    """The most bytes a run adds to its folder: ``writes`` more checkpoints of ``each`` bytes
    beside the ``existing`` ones, pruned to ``keep`` only once the next is complete (so keep + 1
    at once), then ``final/`` beside the last ``keep``."""
    total = existing + writes
    return max(min(total, keep + 1) * each, min(total, keep) * each + final, existing * each) - existing * each


def load_checkpoint(path: Path, trainer: Any, sampler: Any, state: RunState) -> RunState:
    """Restore trainer, sampler and RNGs from ``path``, and ``state``'s checkpointed fields (those
    a checkpoint written before a field existed lacks keep their defaults); returns ``state``."""
    import torch

    try:
        record = json.loads((path / STATE_FILE).read_text())
        unknown = sorted(set(record) - set(CHECKPOINTED)) if isinstance(record, dict) else None
        if unknown is None or unknown:
            raise ValueError(f"{STATE_FILE} holds {unknown or type(record).__name__}, not the fields {', '.join(CHECKPOINTED)}")
        trainer.load_state(str(path / TRAINER_STATE))
        restore_rng(torch.load(path / "rng.pt", weights_only=False), sampler)
    except Exception as exc:
        raise CheckpointError(f"cannot resume from {path}: {type(exc).__name__}: {exc}") from exc
    for name, value in record.items():
        setattr(state, name, value)
    return state


def remove_partial(run_dir: Path) -> None:
    """Temporary folders and files left by a run killed while writing a checkpoint or ``final/``
    (never valid). Only called while the run folder is held: no live process is writing them."""
    for folder in (run_dir, run_dir / CHECKPOINTS):
        for p in folder.glob(f"{TMP_PREFIX}*") if folder.is_dir() else []:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def write_unobserved(folder: Path, metrics: dict[str, float] | None) -> None:
    if metrics is not None:
        (folder / UNOBSERVED_FILE).write_text(json.dumps(metrics) + "\n")


def read_unobserved(checkpoint: Path) -> dict[str, float] | None:
    """The metrics of the checkpoint's step when no plugin observed that step, else None."""
    path = checkpoint / UNOBSERVED_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot resume from {checkpoint}: {UNOBSERVED_FILE} is unreadable ({exc})") from None


def save_policy(path: Path, write: Any) -> str:
    """Write a policy folder atomically: ``write(tmp)`` fills a temporary folder that replaces ``path``."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(str(tmp))
        fsync_tree(tmp)
        old = path.with_name(f"{TMP_PREFIX}{path.name}-old-{os.getpid()}")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(path.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        raise CheckpointError(f"could not write the policy to {path}: {type(exc).__name__}: {exc}") from exc
    return str(path)


def fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
