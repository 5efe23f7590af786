"""What holds for every reward distribution under packages/: installed beside grpo-core, its own
suite passes, the CLI lists and runs it, and its README installs it from this repository."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import grpo_core_in_process, small_run_args
from tests.packages.conftest import PACKAGES

# (reward name, distribution, its options in order)
DISTRIBUTIONS = [
    ("sympy", "grpo-reward-sympy", ["timeout_s", "strict", "memory_limit_mb", "startup_timeout_s"]),
    ("math_verify", "grpo-reward-math-verify", ["timeout_s", "memory_limit_mb", "startup_timeout_s"]),
]
REWARDS = [name for name, _, _ in DISTRIBUTIONS]


@pytest.fixture
def site(request: pytest.FixtureRequest) -> Path:
    """The folder the distribution of the test's ``reward`` is installed in."""
    return request.getfixturevalue(f"{request.node.callspec.params['reward']}_site")


@pytest.mark.slow
@pytest.mark.parametrize(("reward", "distribution"), [(r, d) for r, d, _ in DISTRIBUTIONS])
def test_its_own_test_suite_passes_installed(reward, distribution, site):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGES / distribution / "tests")],
        capture_output=True,
        text=True,
        cwd=site,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


@pytest.mark.parametrize(("reward", "distribution", "options"), DISTRIBUTIONS)
def test_listed_with_its_distribution(reward, distribution, options, site):
    infos = json.loads(grpo_core_in_process("plugins", "--json", env={"PYTHONPATH": str(site)}).stdout)
    plugin = next(i for i in infos if (i["kind"], i["name"]) == ("reward", reward))
    assert (plugin["distribution"], plugin["version"]) == (distribution, "0.1.0")
    assert plugin["hooks"] == ["on_run_end", "reward"] and "error" not in plugin
    # needs_answer is a class attribute the data loader reads, not an option
    assert [o["name"] for o in plugin["options"]] == options


@pytest.mark.parametrize("reward", REWARDS)
def test_declares_that_it_needs_the_reference_answer(reward, site):
    probe = subprocess.run(
        [sys.executable, "-c", f"from grpo_core import make_plugin; print(make_plugin({reward!r}).needs_answer)"],
        capture_output=True, text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert probe.stdout.strip() == "True", probe.stderr


@pytest.mark.parametrize("reward", REWARDS)
def test_run_with_the_reward(reward, site, tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", reward), env={"PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["reward/failed"] == 0 for m in metrics)


@pytest.mark.parametrize("reward", REWARDS)
def test_a_row_without_answer_is_refused_up_front(reward, site, tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, data, tmp_path / "r", "--reward", reward), env={"PYTHONPATH": str(site)})
    assert out.returncode == 1
    assert f"rows.jsonl:2: the answer field 'answer' is missing (fields: question); the {reward} reward needs it" in out.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("distribution", [d for _, d, _ in DISTRIBUTIONS])
def test_readme_installs_from_paths_in_the_repository(distribution):
    """Not on an index yet: every pip command of the README's Install section names this
    repository's paths (from its root), never a bare distribution name."""
    readme = (PACKAGES / distribution / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Use")]
    commands = [line.split("#")[0].split() for line in install.splitlines() if line.startswith("pip install")]
    assert len(commands) == 3
    repo = PACKAGES.parent
    for words in commands:
        targets = [w.strip('"') for w in words[2:] if w != "-e" and not w.startswith("torch==")]
        assert targets, words
        for target in targets:
            assert (repo / target.removesuffix("[test]")).is_dir(), target
    assert ["pip", "install", f"./packages/{distribution}"] in commands
