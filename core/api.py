"""Train from Python: ``grpo_core.run(config, rows=[...], reward=[MyReward()])``.

The run ``grpo-core run`` makes, with the same checks and the same run directory: settings are
validated as flags and TOML keys are, plugins passed as instances are checked as plugin classes
are, and the rows given in memory are saved once (by their content) beside the run directory, so
that config.json names them and the run resumes like any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core.config import DEFAULT, RunConfig, load
from grpo_core.errors import PluginError
from grpo_core.hookspecs import KIND_TABLE
from grpo_core.resume import load_resumed

ROWS_DIR = "rows"
"""Where rows given in memory are saved: ``<the run directory's parent>/rows/<content hash>.jsonl``."""


def run(
    config: RunConfig | Mapping[str, Any] | None = None,
    *,
    rows: Sequence[Mapping[str, Any]] | None = None,
    resume: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    **plugins: Any,
) -> dict[str, Any]:
    """Train a policy; returns the run's summary (also written to RUN_DIR/summary.json).

    :param config: a :class:`grpo_core.config.RunConfig`, or a mapping of the settings a TOML
        config holds (``{"max_steps": 20, "loss": "cispo"}``; plugin options as
        ``plugin_options={"loss": {"cispo": {"eps_high": 0.28}}}``). None: every default.
    :param rows: the dataset, in memory: one mapping per row with the fields a JSONL dataset has
        (``prompt_field``, ``answer_field`` or ``messages``). Instead of ``dataset``.
    :param resume: a run directory to continue, with its own config and rows (pass the same
        plugin instances again; ``config`` may only change what ``--resume`` allows).
    :param overwrite: replace what the run directory holds, as ``--overwrite``.
    :param plugins: plugin instances by kind: ``rollout=MyRollout()``, ``reward=[Exact(),
        (Format(), 0.1)]`` (a reward with its weight), ``loss=MyLoss()``, ``logger=[...]``, and
        so on for every kind. Each is named after its class (``MyRollout`` -> ``my_rollout``).
        A single-choice kind's instance replaces the config's choice; a loss replaces the
        config's loss (a loss wrapper joins it); rewards replace the default reward, else join
        the config's; loggers, tools and group filters join the config's.
    """
    from grpo_core.plugins_manager import provided_plugins
    from grpo_core.train import run as run_loop

    instances, weights = _instances(plugins)
    if resume is not None:
        if isinstance(config, RunConfig) or rows is not None:
            raise PluginError(
                "resume=RUN_DIR continues the run with its own config and rows: give no rows, and as config only "
                "a mapping of the settings a resumed run may change (e.g. {'max_steps': 40})"
            )
        resumed = load_resumed(str(resume), dict(config or {}), {})
        with provided_plugins(instances):
            return run_loop(resumed, resume=True, overwrite=False)
    resolved = _config(config, rows)
    try:
        resolved = _select(resolved, instances, weights)
        with provided_plugins(instances):
            return run_loop(resolved, resume=False, overwrite=overwrite)
    except BaseException:
        if rows is not None:
            forget_rows(resolved.dataset)
        raise


def plugin_name(instance: Any) -> str:
    """``MyRollout()`` -> ``my_rollout``: what config.json and messages call an instance."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(instance).__name__).lower()


def _instances(plugins: Mapping[str, Any]) -> tuple[dict[tuple[str, str], Any], dict[str, dict[str, float]]]:
    unknown = [kind for kind in plugins if kind not in KIND_TABLE]
    if unknown:
        raise PluginError(f"unknown plugin kind {', '.join(map(repr, unknown))}; kinds: {', '.join(KIND_TABLE)}")
    instances: dict[tuple[str, str], Any] = {}
    weights: dict[str, dict[str, float]] = {}  # per weighted kind (reward): each instance's weight
    for kind, given in plugins.items():
        single = _names_one(kind)
        listed = [given] if single else (list(given) if isinstance(given, (list, tuple)) else [given])
        if single and isinstance(given, (list, tuple)):
            raise PluginError(f"{kind}=: one instance (a run has exactly one {kind})")
        for item in listed:
            instance, weight = item if KIND_TABLE[kind].weighted and isinstance(item, tuple) else (item, 1.0)
            if isinstance(instance, (str, type)):
                raise PluginError(f"{kind}=: pass an instance ({kind}=MyPlugin()); a plugin is named in config instead")
            name = plugin_name(instance)
            if (kind, name) in instances:
                raise PluginError(f"two {kind} instances are both named '{name}' (after their class)")
            instances[kind, name] = instance
            if KIND_TABLE[kind].weighted:
                weights.setdefault(kind, {})[name] = float(weight)
    return instances, weights


def _names_one(kind: str) -> bool:
    """The config names one plugin of ``kind`` (``--rollout NAME``), not a list or weights."""
    return not KIND_TABLE[kind].listed and not KIND_TABLE[kind].weighted


def _config(config: RunConfig | Mapping[str, Any] | None, rows: Sequence[Mapping[str, Any]] | None) -> RunConfig:
    """The run's config; with ``rows``, its dataset is their saved file (and its run directory fixed)."""
    given = attrs.asdict(config) if isinstance(config, RunConfig) else dict(config or {})
    plugin_options = given.pop("plugin_options", {}) or {}
    data: dict[str, Any] = {}
    if rows is not None:
        if given.get("dataset", DEFAULT) != DEFAULT:
            raise PluginError("rows= is the dataset: do not name a dataset in the config too")
        data["dataset"], data["run_dir"] = save_rows(rows, given.get("run_dir"))
    try:
        if isinstance(config, RunConfig):
            resolved = attrs.evolve(config, **data)
        else:
            # Read as a TOML file's keys are; without a dataset the embedded task's preset applies.
            resolved = load(None, {**given, **data}, {})
    except BaseException:
        if data:
            forget_rows(data["dataset"])
        raise
    resolved.plugin_options = {kind: {name: dict(o) for name, o in by.items()} for kind, by in plugin_options.items()}
    return resolved


def _select(config: RunConfig, instances: dict[tuple[str, str], Any], weights: dict[str, dict[str, float]]) -> RunConfig:
    from grpo_core.plugins_manager import is_wrapper

    changes: dict[str, Any] = {}
    for (kind, name), instance in instances.items():
        spec = KIND_TABLE[kind]
        if _names_one(kind):
            changes[kind] = name
        elif spec.wrapped:
            wrapper = is_wrapper(instance, spec.hooks[0])
            kept = changes.get(kind, getattr(config, kind) if wrapper else [])
            changes[kind] = [*kept, name] if wrapper else [name, *kept]
        elif spec.listed:
            changes[kind] = [*changes.get(kind, getattr(config, kind)), name]
    for kind, by_name in weights.items():
        # Instances replace the default choice, else join the config's.
        default = getattr(attrs.evolve(config, **{kind: {}}), kind)
        base = {} if getattr(config, kind) == default else dict(getattr(config, kind))
        changes[kind] = {**base, **by_name}
    return attrs.evolve(config, **changes)


def save_rows(rows: Sequence[Mapping[str, Any]], requested_run_dir: str | None) -> tuple[str, str]:
    """Save ``rows`` as JSONL in ``<run directory's parent>/rows/<content hash>.jsonl`` (once per
    content); returns that file and the run directory."""
    from grpo_core.run_dir import choose_run_dir

    if isinstance(rows, (str, bytes, Mapping)) or not rows:
        raise PluginError("rows= takes a non-empty list of rows, each a mapping of fields (e.g. {'question': ..., 'answer': ...})")
    lines = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise PluginError(f"rows[{i}] is a {type(row).__name__}, not a mapping of fields")
        try:
            lines.append(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
        except (TypeError, ValueError) as exc:
            raise PluginError(f"rows[{i}] cannot be saved as JSON: {exc}") from None
    text = "".join(lines)
    # Where the run will write (a default one named now); the run checks it with the caller's overwrite.
    run_dir = choose_run_dir(requested_run_dir)
    path = run_dir.parent / ROWS_DIR / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path), str(run_dir)


def forget_rows(saved: str) -> None:
    """A run that failed before it became a run (refused: its folder holds no config.json naming
    its rows) leaves no rows behind: their file, and the folders made for it once empty. Rows a
    run names stay, for its ``--resume``."""
    path = Path(saved)
    if any(named_dataset(run / "config.json") == saved for run in path.parent.parent.iterdir() if run.is_dir()):
        return
    path.unlink(missing_ok=True)
    for folder in (path.parent, path.parent.parent):
        with contextlib.suppress(OSError):  # not empty: kept
            folder.rmdir()


def named_dataset(config_file: Path) -> str | None:
    try:
        return json.loads(config_file.read_text()).get("dataset")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
