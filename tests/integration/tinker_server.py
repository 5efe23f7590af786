"""A real Tinker-API server (skyrl 0.3.0, JAX on the CPU) and a tinker==0.24.1 client side, for the
integration tests (marker ``tinker``).

Two virtualenvs, each built once and reused (under ``~/.cache/grpo-core/``, or ``$GRPO_CORE_CACHE``):
- ``tinker-server-venv``: torch (the CPU wheel) and ``skyrl[tinker,jax]==0.3.0`` (~2.2 GB), with
  skyrl's ``typing.TypedDict`` import taken from ``typing_extensions`` (pydantic refuses the
  former below Python 3.12), and a ``uv`` stand-in: the API starts itself and its engine with
  ``uv run ... -m skyrl.tinker.api|engine``; the stand-in runs the venv's python with the same
  module and arguments, as a child process.
- ``tinker-client-venv``: torch, ``tinker==0.24.1`` (skyrl cannot parse the protobuf bodies of
  0.25 and later) and grpo-core's dependencies; the tests run this checkout with it through
  ``PYTHONPATH`` (the checkout is not installed there, so one venv serves every clone).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.server_process import ServerProcess

CACHE = Path(os.environ.get("GRPO_CORE_CACHE", Path.home() / ".cache" / "grpo-core"))
"""Outside the repository, so that every clone (CI makes a fresh one per run) reuses one build."""
SERVER_VENV = CACHE / "tinker-server-venv"
SERVER_PACKAGES = ["torch==2.13.0", "skyrl[tinker,jax]==0.3.0"]
CLIENT_VENV = CACHE / "tinker-client-venv"
CLIENT_SDK = "tinker==0.24.1"
API_KEY = "tml-grpo-core-test-key-0123456789"
"""The SDK refuses keys without the tml- prefix; skyrl accepts any."""

UV_STANDIN = """#!{python}
# A stand-in for `uv run [uv flags] -m MODULE ARGS...`: runs MODULE with this venv's python, as a child.
import os, subprocess, sys
args = sys.argv[1:]
i = args.index("-m")
child = subprocess.Popen([{python!r}, *args[i:]])
try:
    sys.exit(child.wait())
except KeyboardInterrupt:
    child.terminate()
    sys.exit(child.wait())
"""


def _src_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _client_requirements() -> list[str]:
    """grpo-core's own dependencies, the tinker bound replaced by the SDK skyrl speaks."""
    import tomllib

    deps = tomllib.loads((_src_root() / "pyproject.toml").read_text())["project"]["dependencies"]
    return [CLIENT_SDK if re.match(r"tinker\b", d) else d for d in deps] + ["torch==2.13.0"]


def _build(venv: Path, steps: list[list[str]], wanted: str, log) -> tuple[Path, float]:
    """``venv``'s python, built with ``steps`` (pip argument lists) unless its stamp says ``wanted``."""
    stamp = venv / ".built"
    python = venv / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{venv.name}.lock", "w") as lock:
        # Two test sessions at once must not build into the same folder.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == wanted:
            return python, 0.0
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for step in steps:
            subprocess.run([str(python), "-m", "pip", *step], check=True, stdout=log, stderr=log)
        return python, started


def ensure_server_venv(log=sys.stderr) -> Path:
    """The python of skyrl's virtualenv, built when missing (minutes; reused after)."""
    wanted = " ".join(SERVER_PACKAGES) + " +typing_extensions.TypedDict +uv"
    python, started = _build(SERVER_VENV, [["install", "-q", p] for p in SERVER_PACKAGES], wanted, log)
    if started:
        _patch_typed_dict(python)
        uv = SERVER_VENV / "uv-bin" / "uv"
        uv.parent.mkdir(exist_ok=True)
        uv.write_text(UV_STANDIN.format(python=str(python)))
        uv.chmod(0o755)
        (SERVER_VENV / ".built").write_text(wanted)
        print(f"tinker server venv built in {time.monotonic() - started:.0f}s", file=log)
    return python


def _patch_typed_dict(python: Path) -> None:
    types_py = (
        Path(subprocess.check_output([str(python), "-c", "import skyrl, os; print(os.path.dirname(skyrl.__file__))"], text=True).strip())
        / "tinker"
        / "types.py"
    )
    text = types_py.read_text()
    patched = text.replace(
        "from typing import Annotated, Any, Literal, TypedDict",
        "from typing import Annotated, Any, Literal\nfrom typing_extensions import TypedDict",
    )
    if patched == text:
        raise RuntimeError(f"skyrl's {types_py} does not import typing.TypedDict as expected; update the patch")
    types_py.write_text(patched)


def ensure_client_venv(log=sys.stderr) -> Path:
    """The python of a virtualenv with tinker==0.24.1 and grpo-core's dependencies (not grpo-core itself)."""
    requirements = _client_requirements()
    wanted = " ".join(requirements)
    python, started = _build(CLIENT_VENV, [["install", "-q", "torch==2.13.0"], ["install", "-q", *requirements, "pytest>=8"]], wanted, log)
    if started:
        (CLIENT_VENV / ".built").write_text(wanted)
        print(f"tinker client venv built in {time.monotonic() - started:.0f}s", file=log)
    return python


def client_env(root: Path) -> dict[str, str]:
    """The environment of a process that runs this checkout with the client venv: grpo_core
    importable from ``root`` (a folder of links laid out as the installed package)."""
    src = _src_root()
    package = root / "grpo_core"
    if not package.exists():
        package.parent.mkdir(parents=True, exist_ok=True)
        # Links to every file: the checkout's sources, laid out as pyproject's package-dir installs them.
        skip = shutil.ignore_patterns("__pycache__")
        for name, folder in sorted(_package_dirs(src).items()):  # grpo_core first: the others nest in it
            shutil.copytree(src / folder, root.joinpath(*name.split(".")), ignore=skip, copy_function=os.symlink)
        dist = root / "grpo_core-0.1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-core\nVersion: 0.1.0\n")
        (dist / "entry_points.txt").write_text(_entry_points(src))
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{src}", "TINKER_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
    return env


def _package_dirs(src: Path) -> dict[str, str]:
    import tomllib

    return tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _entry_points(src: Path) -> str:
    import tomllib

    project = tomllib.loads((src / "pyproject.toml").read_text())["project"]
    lines = ["[console_scripts]"] + [f"{k} = {v}" for k, v in project["scripts"].items()]
    lines += ["", "[grpo_core]"] + [f"{k} = {v}" for k, v in project["entry-points"]["grpo_core"].items()]
    return "\n".join(lines) + "\n"


class TinkerServer(ServerProcess):
    """``uv run -m skyrl.tinker.api`` (through the stand-in) on 127.0.0.1, stopped by its PID."""

    name = "skyrl"

    def __init__(self, base_model: Path, workdir: Path, port: int | None = None, **backend_config: object) -> None:
        super().__init__(workdir / "skyrl.log", port)
        self.base_model = base_model
        self.workdir = workdir
        self.backend_config = json.dumps({"max_lora_adapters": 4, "max_lora_rank": 8, **backend_config})

    def start(self, timeout: float = 600.0) -> float:
        """Start and wait until /api/v1/healthz answers; returns the seconds that took."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        uv = SERVER_VENV / "uv-bin" / "uv"
        env = {
            **os.environ,
            "PATH": f"{uv.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "JAX_PLATFORMS": "cpu",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        }
        command = [
            str(uv), "run", "-m", "skyrl.tinker.api",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--base-model", str(self.base_model),
            "--database-url", f"sqlite:///{self.workdir / 'skyrl.db'}",
            "--checkpoints-base", str(self.workdir / "checkpoints"),
            "--backend-config", self.backend_config,
        ]  # fmt: skip
        return self.launch(command, env, "/api/v1/healthz", timeout, cwd=self.workdir)
