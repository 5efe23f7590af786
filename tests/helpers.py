"""Helpers the test modules share: running the ``grpo-core`` command and building its inputs.

- ``grpo_core(...)``: the command in a subprocess (~20 s of imports), for what needs a real process:
  signals, kills, settings read when a library is imported. Mark such a test ``slow``.
- ``grpo_core_in_process(...)``: the same command line, exit code, stdout and stderr in the test's
  own process; every other test of the command line uses it.
- ``TEMPLATE``: the prompt template of the tiny model's runs (the tiny tokenizer's ``Question:`` /
  ``Answer:`` lines).
- ``small_run_args(model, dataset, run_dir, *extra)``: the arguments of a two-step run of the tiny
  model, for either of the two above.
- ``SIGNAL``: flags that make a short run of the tiny model train visibly (a reward it earns about
  half the time, a large learning rate).
- ``signal_after_two_steps(args, run_dir, signum, code)``: start an endless run in a subprocess,
  signal it once two steps are logged, check how it ended.
- ``make_plugin_package(root, name, body, entry_points)``: write a pip-installable plugin package
  (one module, ``grpo_core`` entry points) to install in a test.
- ``captured_run_config(monkeypatch, *args)``: the config ``grpo-core run ARGS`` hands the training
  loop, without starting it.
- ``safetensors_of(folder)``: the tensors of ``folder/model.safetensors``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TEMPLATE = "Question: {prompt}\nAnswer:"


def grpo_core(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=timeout,
    )


def grpo_core_in_process(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``grpo_core(...)`` without a new interpreter: the same command line, exit code, stdout and
    stderr, minus the ~20 s of imports a subprocess pays. ``env`` is set for the call; a
    ``PYTHONPATH`` in it goes on ``sys.path`` and the plugin catalog is read again, as a new process
    would. For what needs a real process (signals, kills, import-time settings) use ``grpo_core``."""
    from click.testing import CliRunner

    from grpo_core.cli import main
    from grpo_core.plugins_manager import catalog

    env = dict(env or {})
    paths = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p]
    saved_path, saved_cwd = list(sys.path), os.getcwd()
    sys.path[:0] = paths
    catalog.cache_clear()
    try:
        if cwd is not None:
            os.chdir(cwd)
        result = CliRunner().invoke(main, list(args), env=env, prog_name="grpo-core")
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        catalog.cache_clear()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["grpo-core", *args], result.exit_code, result.stdout, result.stderr)


def small_run_args(model: Path, dataset: Path, run_dir: Path, *extra: str) -> list[str]:
    """A two-step run of the tiny model. Its rewards are all equal (0: random tokens solve
    nothing), so its groups are trained as they are (--no-drop-zero-variance-groups): dropped as
    zero-variance, the run would train nothing and end in exit 1 (``tests/test_adversarial.py``)."""
    return [
        "run", "--model", str(model), "--dataset", str(dataset), "--prompt-template", TEMPLATE,
        "--max-steps", "2", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--no-drop-zero-variance-groups", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip


SIGNAL = ("--reward", "format", "--reward-opt", r"pattern=\d", "--learning-rate", "3e-2")
"""A reward the random tiny model earns about half the time, and a step large enough to show."""


def signal_after_two_steps(args: list[str], run_dir: Path, signum: str, code: int) -> int:
    """Start an endless run, send ``signum`` once two steps are logged, check the exit code and
    the summary line; returns the number of steps it completed."""
    import signal
    import time

    # Far more steps than can run before the signal: the run must end by the interrupt, not by itself.
    args = [*args, "--max-steps", "1000000", "--epochs", "100000"]
    proc = subprocess.Popen([sys.executable, "-m", "grpo_core.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signum))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert "stopped: interrupted after step" in stdout
    steps = len(metrics.read_text().splitlines())
    assert 2 <= steps < 1000000
    return steps


def make_plugin_package(root: Path, name: str, body: str, entry_points: dict[str, str]) -> Path:
    pkg = root / name
    (pkg / name.replace("-", "_")).mkdir(parents=True)
    (pkg / name.replace("-", "_") / "__init__.py").write_text(textwrap.dedent(body))
    eps = "\n".join(f'"{k}" = "{v}"' for k, v in entry_points.items())
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{name}"
            version = "1.2.3"
            [project.entry-points.grpo_core]
            """
        )
        + eps
        + "\n"
    )
    return pkg


def captured_run_config(monkeypatch, *args: str) -> tuple[int, str, object]:
    """What ``grpo-core run ARGS`` hands the training loop (which is not started), with its exit code and output."""
    from click.testing import CliRunner

    import grpo_core.train
    from grpo_core.cli import main

    seen = []
    monkeypatch.setattr(grpo_core.train, "run", lambda config, **kwargs: seen.append(config) or {"exit_code": 0})
    out = CliRunner().invoke(main, ["run", *args])
    return out.exit_code, out.output, (seen[0] if seen else None)


def safetensors_of(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def help_sections(command: str) -> tuple[str, dict[str, list[str]]]:
    """``grpo-core COMMAND --help`` as printed, and the flags it lists under each section title, in order."""
    from click.testing import CliRunner

    from grpo_core.cli import main

    text = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
    flags: dict[str, list[str]] = {}
    for block in text.split("\n\n"):
        title, *rows = block.splitlines()
        if title.endswith(":") and rows:
            flags[title[:-1]] = [row.split()[0].rstrip(",") for row in rows if row.startswith("  -")]
    return text, flags
