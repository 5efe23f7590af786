"""A run folder is owned: one process at a time holds it, and grpo-core only ever deletes a folder
that is its own run.

The holder keeps an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` (the file holds its PID) for
the run's lifetime; the kernel drops the lock when the process dies, however it dies, so a lock
left by a killed run is free to take (and its PID, left in the file, tells it was killed).
``--overwrite`` replaces only a folder holding a grpo-core run (its ``config.json``), never the
working directory or a folder above it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from grpo_core.errors import PluginError

LOCK_FILE = ".lock"
DATA_FILE = "data.json"
"""The rows a run started on: the dataset's name, how many prompts, the sha256 of its rows."""
RUN_CONFIG_KEYS = frozenset({"model", "dataset", "backend", "rollout", "reward", "advantage", "loss", "plugin_options"})
"""Keys every grpo-core ``config.json`` holds (a model folder's ``config.json`` holds none of them)."""


class RunDirInUse(PluginError):
    """Another process holds the run folder's lock."""


def choose_run_dir(requested: str | None) -> Path:
    """``requested``, or a new ``runs/<time>`` folder."""
    if requested is not None:
        return Path(requested)
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def holder_of(path: Path) -> str:
    """The PID written in a run folder's lock file ("unknown" when it holds none)."""
    try:
        return (path / LOCK_FILE).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def in_use(path: Path) -> RunDirInUse:
    return RunDirInUse(
        f"run directory {path} is in use by process {holder_of(path)} (a grpo-core run holds its lock); "
        "wait for it to end, or stop it first"
    )


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock (creating the folder) until the block ends; refused while another process holds it."""
    if path.exists() and not path.is_dir():
        raise PluginError(f"run directory {path} is a file")
    created, lock_created = not path.exists(), not (path / LOCK_FILE).exists()
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use(path) from None
        stale = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if stale:
            # A run that ends clears its PID: one left here was killed (SIGKILL, power loss).
            print(f"note: {path} was held by process {stale}, which was stopped without ending; taking it over", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        except BaseException:
            # A refused or failed start leaves the place as it found it.
            if created and [p.name for p in path.iterdir()] == [LOCK_FILE]:
                shutil.rmtree(path)
            elif lock_created:
                (path / LOCK_FILE).unlink(missing_ok=True)
            raise
        finally:
            if path.is_dir():
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)


@contextlib.contextmanager
def not_running(path: Path) -> Iterator[None]:
    """Read a run folder while no run writes it (``export``): a shared lock, refused while a run holds it.

    Writes nothing: a folder of a run from before locks existed (no lock file) is read as it is.
    """
    lock = path / LOCK_FILE
    if not lock.is_file():
        yield
        return
    fd = os.open(lock, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use(path) from None
        yield
    finally:
        os.close(fd)


def is_run_config(path: Path) -> bool:
    """Whether ``path`` is a ``config.json`` grpo-core wrote (whole, with a run's keys)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(stored, dict) and RUN_CONFIG_KEYS <= stored.keys()


def check_new_run_dir(path: Path, overwrite: bool) -> None:
    """A new run goes into an empty folder, or replaces a grpo-core run with ``--overwrite``.

    Refused (nothing is touched): a folder holding anything but a run, the working directory
    or a folder above it, whatever it holds.
    """
    entries = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE) if path.is_dir() else []
    if not entries:
        return
    refusal = overwrite_refusal(path, entries)
    if not overwrite:
        raise PluginError(
            f"run directory {path} is not empty: "
            + (f"continue that run with --resume {path}, start over with --overwrite, " if refusal is None else "")
            + ("or " if refusal is None else "")
            + "choose another --run-dir"
        )
    if refusal is not None:
        raise PluginError(refusal)


def overwrite_refusal(path: Path, entries: list[str]) -> str | None:
    """Why ``--overwrite`` may not empty ``path`` (None when it holds a grpo-core run)."""
    cwd, target = Path.cwd().resolve(), path.resolve()
    if target == cwd or target in cwd.parents:
        return f"--overwrite never empties the working directory or a folder above it ({path}); choose another --run-dir"
    if not is_run_config(path / "config.json"):
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        return (
            f"--overwrite only replaces a grpo-core run, and {path} holds no run's config.json (it holds {shown}); choose another --run-dir"
        )
    return None


def clear_run_dir(path: Path) -> None:
    """Empty a run folder for ``--overwrite`` (checked by :func:`check_new_run_dir`), keeping the lock it holds."""
    for entry in path.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def record_data(path: Path, dataset: str, prompts: int, sha256: str) -> None:
    """Write the run's ``data.json``: what ``check_same_data`` compares on ``--resume``."""
    record = {"dataset": dataset, "prompts": prompts, "sha256": sha256}
    (path / DATA_FILE).write_text(json.dumps(record, indent=1) + "\n")


def check_same_data(path: Path, dataset: str, prompts: int, sha256: str) -> None:
    """``--resume`` continues on the rows the run started with: other rows would silently change
    which prompts its remaining steps see (the order is drawn over the rows by index).

    A run from before ``data.json`` existed has nothing to compare; its rows are recorded now.
    """
    try:
        started = json.loads((path / DATA_FILE).read_text())
        then, count = started["sha256"], started["prompts"]
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PluginError(f"{path / DATA_FILE} cannot be read ({type(exc).__name__}: {exc}): it was cut short or edited") from None
    if then == sha256:
        return
    change = f"{count} prompts then, {prompts} now" if count != prompts else f"the same {prompts} prompts in number, their content differs"
    raise PluginError(
        f"--resume {path}: the dataset {dataset} changed since the run started ({change}; sha256 of its rows "
        f"{then[:12]}... then, {sha256[:12]}... now); resume with the data the run started on, or start a new run "
        "with this data (another --run-dir)"
    )
