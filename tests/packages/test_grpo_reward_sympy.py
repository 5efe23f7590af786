"""The separate grpo-reward-sympy distribution, pip-installed beside grpo-core, seen by the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import grpo_core_in_process, small_run_args

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "grpo-reward-sympy"


@pytest.fixture(scope="module")
def sympy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    # pip builds in the source tree: build from a copy, so the repository's folder stays clean
    source = tmp_path_factory.mktemp("source") / PACKAGE.name
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
        check=True,
        capture_output=True,
    )
    return target


@pytest.mark.slow
def test_its_own_test_suite_passes_installed(sympy_site):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE / "tests")],
        capture_output=True,
        text=True,
        cwd=sympy_site,
        env={"PYTHONPATH": str(sympy_site), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def test_listed_with_its_distribution(sympy_site):
    infos = json.loads(grpo_core_in_process("plugins", "--json", env={"PYTHONPATH": str(sympy_site)}).stdout)
    sympy = next(i for i in infos if (i["kind"], i["name"]) == ("reward", "sympy"))
    assert (sympy["distribution"], sympy["version"]) == ("grpo-reward-sympy", "0.1.0")
    assert sympy["hooks"] == ["on_run_end", "reward"] and "error" not in sympy
    # needs_answer is a class attribute the data loader reads, not an option
    assert [o["name"] for o in sympy["options"]] == ["timeout_s", "strict", "memory_limit_mb", "startup_timeout_s"]


def test_declares_that_it_needs_the_reference_answer(sympy_site):
    probe = subprocess.run(
        [sys.executable, "-c", "from grpo_core import make_plugin; print(make_plugin('sympy').needs_answer)"],
        capture_output=True, text=True, env={"PYTHONPATH": str(sympy_site), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert probe.stdout.strip() == "True", probe.stderr


def test_run_with_reward_sympy(sympy_site, tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", "sympy"), env={"PYTHONPATH": str(sympy_site)}
    )
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["reward/failed"] == 0 for m in metrics)


def test_readme_installs_from_paths_in_the_repository():
    """Not on an index yet: every pip command of the README's Install section names this
    repository's paths (from its root), never a bare distribution name."""
    readme = (PACKAGE / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Use")]
    commands = [line.split("#")[0].split() for line in install.splitlines() if line.startswith("pip install")]
    assert len(commands) == 3
    repo = PACKAGE.parents[1]
    for words in commands:
        targets = [w.strip('"') for w in words[2:] if w != "-e" and not w.startswith("torch==")]
        assert targets, words
        for target in targets:
            assert (repo / target.removesuffix("[test]")).is_dir(), target
    assert ["pip", "install", "./packages/grpo-reward-sympy"] in commands


def test_a_row_without_answer_is_refused_up_front(sympy_site, tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, data, tmp_path / "r", "--reward", "sympy"), env={"PYTHONPATH": str(sympy_site)}
    )
    assert out.returncode == 1
    assert "rows.jsonl:2: the answer field 'answer' is missing (fields: question); the sympy reward needs it" in out.stderr
    assert not (tmp_path / "r").exists()
