"""A run folder is owned: one process at a time holds it, and grpo-core only ever deletes a folder
that is its own run.

The holder keeps an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` (the file holds its PID) for
the run's lifetime; the kernel drops the lock when the process dies, however it dies, so a lock
left by a killed run is free to take (and its PID, left in the file, tells it was killed).
``--overwrite`` replaces only a folder holding a grpo-core run (its ``config.json``), never the
working directory or a folder above it, and within it only the files the old run's manifest
(:data:`MANIFEST_FILE`) lists: a file the new run reads stays, anything else (a top-level name
grpo-core does not write, a user's file inside ``checkpoints/``, ``final/`` or a logger's folder) is
refused, named, before anything changes.
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
from typing import Any

import attrs

from grpo_core.errors import PluginError

LOCK_FILE = ".lock"
DATA_FILE = "data.json"
"""The rows a run started on: the dataset's name, how many prompts, the sha256 of its rows."""
MANIFEST_FILE = "manifest.json"
"""Every file the run wrote in its folder (relative paths), rewritten as it goes: what ``--overwrite`` removes."""
TMP_PREFIX = ".tmp-"
"""Temporary names (a checkpoint, ``final/`` or a replaced run being written or moved aside)."""
WRITTEN = frozenset(
    {LOCK_FILE, MANIFEST_FILE, "config.json", DATA_FILE, "summary.json", "traceback.txt", "checkpoints", "final", "async"}
    # The built-in plugins' defaults: the jsonl logger, tensorboard, wandb, the vllm weight sync.
    | {"metrics.jsonl", "samples.jsonl", "tensorboard", "wandb", "wandb_run_id", "sampler-weights"}
)
"""What grpo-core writes in a run folder (top-level names), all it may replace on ``--overwrite``."""
NAMED_OUTPUTS = {("logger", "jsonl"): ("filename", "samples_filename"), ("logger", "tensorboard"): ("log_dir",)}
"""Options of built-in plugins that name what they write in the run folder, when set otherwise."""
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
    created = [p for p in (path, *path.parents) if not p.exists()]  # the folder, and those above it made for it
    lock_created = not (path / LOCK_FILE).exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PluginError(
            f"run directory {path} cannot be written: {exc.strerror or exc} ({exc.filename}); choose another --run-dir"
        ) from None
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
                for parent in created[1:]:
                    with contextlib.suppress(OSError):  # not empty: something else is there now
                        parent.rmdir()
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


def check_new_run_dir(path: Path, overwrite: bool, read: set[str] = frozenset()) -> list[str]:
    """A new run goes into a folder holding nothing but what it reads (``read``: top-level names,
    see :func:`entries_read`), or replaces a grpo-core run with ``--overwrite``. Returns what
    ``--overwrite`` replaces (the old run's entries, by name).

    Refused (nothing is touched): a folder holding anything grpo-core did not write besides what
    the run reads, a file the run reads under a name grpo-core writes (the run would replace it),
    the working directory or a folder above it, whatever it holds.
    """
    entries = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE) if path.is_dir() else []
    if not [name for name in entries if name not in read]:
        return []
    refusal = overwrite_refusal(path, entries, read)
    if not overwrite:
        # A run refused or failed before its first checkpoint cannot be resumed: no advice to.
        resumable = refusal is None and any((path / "checkpoints").glob("step-*/state.json"))
        raise PluginError(
            f"run directory {path} is not empty: "
            + (f"continue that run with --resume {path}, " if resumable else "")
            + ("start over with --overwrite, or " if refusal is None else "")
            + "choose another --run-dir"
        )
    if refusal is not None:
        raise PluginError(refusal)
    return [name for name in entries if name not in read]


def overwrite_refusal(path: Path, entries: list[str], read: set[str] = frozenset()) -> str | None:
    """Why ``--overwrite`` may not replace what ``path`` holds (None when it holds a grpo-core run
    and, besides, only what the new run reads)."""
    cwd, target = Path.cwd().resolve(), path.resolve()
    if target == cwd or target in cwd.parents:
        return f"--overwrite never empties the working directory or a folder above it ({path}); choose another --run-dir"
    if not is_run_config(path / "config.json"):
        return (
            f"--overwrite only replaces a grpo-core run, and {path} holds no run's config.json (it holds {shown(entries)}); "
            "choose another --run-dir"
        )
    written = written_names(path)
    others = [name for name in entries if name not in written and name not in read and not name.startswith(TMP_PREFIX)]
    others += unlisted_files(path, [name for name in entries if name in written and name not in read])
    if others:
        return (
            f"--overwrite only replaces what grpo-core wrote, and {path} also holds {shown(others)}, which it did not write: "
            f"move {'it' if len(others) == 1 else 'them'} out of {path}, or choose another --run-dir"
        )
    clash = sorted(read & written)
    if clash:
        return (
            f"--overwrite would replace {path / clash[0]}, which this run reads: "
            f"copy it out of {path} and name the copy, or choose another --run-dir"
        )
    return None


def shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def written_names(path: Path) -> set[str]:
    """What grpo-core wrote in the run folder ``path``: :data:`WRITTEN`, and the names its run's
    config.json gave the built-in plugins' outputs."""
    names = set(WRITTEN)
    try:
        options = json.loads((path / "config.json").read_text()).get("plugin_options") or {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return names
    for (kind, plugin), keys in NAMED_OUTPUTS.items():
        given = options.get(kind, {}).get(plugin, {}) if isinstance(options.get(kind), dict) else {}
        for key in keys:
            value = given.get(key) if isinstance(given, dict) else None
            if isinstance(value, str) and value and not Path(value).is_absolute():
                names.add(Path(value).parts[0])
    return names


def files_in(path: Path, names: list[str] | set[str]) -> list[str]:
    """The files under the entries ``names`` of ``path`` (relative paths; not the lock, the manifest,
    or what is being written under a temporary name)."""
    found = []
    for name in names:
        entry = path / name
        inside = [entry] if not entry.is_dir() or entry.is_symlink() else [p for p in entry.rglob("*") if p.is_symlink() or not p.is_dir()]
        for file in inside:
            relative = file.relative_to(path)
            if (file.exists() or file.is_symlink()) and not any(part.startswith(TMP_PREFIX) for part in relative.parts):
                found.append(relative.as_posix())
    return sorted(set(found) - {LOCK_FILE, MANIFEST_FILE})


def record_files(path: Path) -> None:
    """Rewrite the run's manifest: the files now under the names grpo-core writes (:func:`written_names`).

    Called at start, after every step and at the end, so that a run killed mid-step lists all but
    that step's new files (which ``--overwrite`` then refuses, named, rather than guesses about).
    """
    temporary = path / f"{TMP_PREFIX}{MANIFEST_FILE}"
    # A manifest that cannot be written (a full disk) stops no run: the one before it stays, and
    # --overwrite refuses, named, what it does not list.
    with contextlib.suppress(OSError):
        temporary.write_text(json.dumps({"files": files_in(path, written_names(path))}, indent=0) + "\n")
        os.replace(temporary, path / MANIFEST_FILE)


def unlisted_files(path: Path, names: list[str]) -> list[str]:
    """The files inside the folders ``names`` that the old run's manifest does not list: a user's,
    kept. A top-level file of a name grpo-core writes is the run's (metrics.jsonl, created by a step
    that was killed before its manifest was rewritten); without a manifest (a run of an older
    grpo-core, or one stopped during its start) those are all that count as the run's."""
    try:
        listed = set(json.loads((path / MANIFEST_FILE).read_text())["files"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        listed = set()
    listed |= {name for name in names if (path / name).is_file()}
    return [file for file in files_in(path, names) if file not in listed]


def config_strings(value: Any) -> list[str]:
    """Every string in a config's values (nested): where it may name a file the run reads."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [s for item in value for s in config_strings(item)]
    return []


def entries_read(path: Path, values: list[str]) -> set[str]:
    """The top-level entries of the folder ``path`` that hold a path among ``values`` (every
    string of a run's config: its dataset, model, a plugin's file), which the run reads."""
    root = path.resolve()
    found = set()
    for value in values:
        # A dataset folder may be given with its split (FOLDER:SPLIT).
        for candidate in {value, value.rpartition(":")[0]} - {""}:
            try:
                inside = Path(candidate).resolve().relative_to(root)
            except (ValueError, OSError, RuntimeError):
                continue
            if inside.parts and (root / inside.parts[0]).exists():
                found.add(inside.parts[0])
    return found


def move_aside(path: Path, names: list[str]) -> Path:
    """Move the entries ``names`` of ``path`` into a temporary folder inside it (kept until
    :func:`restore` or deletion): a refused start puts the old run back."""
    aside = path / f"{TMP_PREFIX}replaced-{os.getpid()}"
    aside.mkdir()
    for name in names:
        os.replace(path / name, aside / name)
    return aside


def restore(path: Path, aside: Path) -> None:
    for entry in aside.iterdir():
        os.replace(entry, path / entry.name)
    aside.rmdir()


def remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)


def record_data(path: Path, dataset: str, prompts: int, sha256: str, fetched: list[dict[str, str]] | None = None) -> None:
    """Write the run's ``data.json``: what ``check_same_data`` compares on ``--resume``, and the
    URLs the rows were fetched from (each with its file's sha256 and cached copy)."""
    record: dict[str, object] = {"dataset": dataset, "prompts": prompts, "sha256": sha256}
    if fetched:
        record["fetched"] = fetched
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


@attrs.define
class StartUp:
    """What this invocation changes in its run folder until training begins: a start refused or
    failed before then undoes it (:meth:`undo`), so the folder is as it was and the corrected
    command runs as if the failed one never had. Only what this invocation wrote is removed: a
    resumed run's folder stays, and its files are put back as they were."""

    path: Path
    before: set[str]
    """Top-level names the folder held when this invocation took it."""
    replaced: list[str] = attrs.field(factory=list)
    """The old run's entries that ``--overwrite`` replaces: moved aside at start, deleted once training begins."""
    kept: dict[str, bytes] = attrs.field(factory=dict)
    """A resumed run's files that its start rewrites (config.json, data.json), as they were."""
    aside: Path | None = None
    begun: bool = False

    def replace_old_run(self) -> None:
        """Move the old run out of the way (a rename: its files stay until training begins)."""
        if self.replaced:
            self.aside = move_aside(self.path, self.replaced)

    def begin(self) -> None:
        """Training begins: from here a failure keeps what the run wrote (see :func:`guard_run`)."""
        self.begun = True
        if self.aside is not None:
            remove(self.aside)
            self.aside = None

    def undo(self) -> None:
        if self.begun or not self.path.is_dir():
            return
        # Names of the old run moved aside that are here again were written by this invocation.
        moved = {*self.replaced, self.aside.name} if self.aside is not None else set()
        keep = (self.before - moved) | {LOCK_FILE} | ({self.aside.name} if self.aside is not None else set())
        for entry in self.path.iterdir():
            if entry.name not in keep:
                remove(entry)
        if self.aside is not None:
            restore(self.path, self.aside)
        for name, content in self.kept.items():
            file = self.path / name
            if not file.is_file() or file.read_bytes() != content:  # untouched: left as it is (its time too)
                file.write_bytes(content)
