"""The separate reward distributions under packages/, pip-installed into a folder of their own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2] / "packages"


def pip_install(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``package`` pip-installed (without its dependencies), for PYTHONPATH."""
    target = tmp_path_factory.mktemp("site")
    # pip builds in the source tree: build from a copy, so the repository's folder stays clean
    source = tmp_path_factory.mktemp("source") / package.name
    shutil.copytree(package, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
        check=True,
        capture_output=True,
    )
    return target


@pytest.fixture(scope="session")
def sympy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(PACKAGES / "grpo-reward-sympy", tmp_path_factory)


@pytest.fixture(scope="session")
def math_verify_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(PACKAGES / "grpo-reward-math-verify", tmp_path_factory)
