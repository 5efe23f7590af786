"""The separate grpo-reward-math-verify distribution, pip-installed beside grpo-core, seen by the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.plugins.rewards import gsm8k
from grpo_core.plugins_manager import catalog
from tests.test_cli import grpo_core_in_process, small_run_args

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "grpo-reward-math-verify"


@pytest.fixture(scope="module")
def math_verify_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
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


@pytest.fixture
def installed(math_verify_site: Path, monkeypatch: pytest.MonkeyPatch):
    """The installed package importable in this process, and in the catalog."""
    monkeypatch.syspath_prepend(str(math_verify_site))
    catalog.cache_clear()
    from grpo_core import make_plugin

    plugin = make_plugin("math_verify", timeout_s=30.0)  # generous: the machine may be loaded
    yield plugin
    plugin.close()
    catalog.cache_clear()


@pytest.mark.slow
def test_its_own_test_suite_passes_installed(math_verify_site):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE / "tests")],
        capture_output=True,
        text=True,
        cwd=math_verify_site,
        env={"PYTHONPATH": str(math_verify_site), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def test_listed_with_its_distribution(math_verify_site):
    infos = json.loads(grpo_core_in_process("plugins", "--json", env={"PYTHONPATH": str(math_verify_site)}).stdout)
    plugin = next(i for i in infos if (i["kind"], i["name"]) == ("reward", "math_verify"))
    assert (plugin["distribution"], plugin["version"]) == ("grpo-reward-math-verify", "0.1.0")
    assert plugin["hooks"] == ["on_run_end", "reward"] and "error" not in plugin
    assert [o["name"] for o in plugin["options"]] == ["timeout_s", "memory_limit_mb", "startup_timeout_s"]


def gsm8k_pairs(path: Path) -> list[tuple[str, str]]:
    """(completion, reference) pairs from every row of the split: its own solution, the solutions of
    two other rows, and its solution ending in "The answer is N" instead of "#### N"."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    pairs = []
    for i, row in enumerate(rows):
        for other in (rows[i], rows[(i + 1) % len(rows)], rows[(i + 7) % len(rows)]):
            pairs.append((other["answer"], row["answer"]))
        body, _, number = row["answer"].rpartition("####")
        pairs.append((f"{body}The answer is {number.strip()}.", row["answer"]))
    return pairs


@pytest.mark.slow
def test_agrees_with_the_gsm8k_scorer_on_the_shipped_test_split(installed, gsm8k_test_split):
    pairs = gsm8k_pairs(gsm8k_test_split)
    assert len(pairs) == 4 * 1319
    disagree = [(c[-60:], r[-20:]) for c, r in pairs if installed.score(c, r) != gsm8k.score(c, r)]
    assert disagree == []
    assert sum(gsm8k.score(c, r) for c, r in pairs) > 2 * 1319  # right and wrong answers both


def test_a_hanging_parse_is_handled_within_its_timeout(math_verify_site, monkeypatch):
    import time

    monkeypatch.syspath_prepend(str(math_verify_site))
    catalog.cache_clear()
    from grpo_core import Prompt, Sample, make_plugin

    plugin = make_plugin("math_verify", timeout_s=1.0)
    prompt = Prompt(id="p", text="?", answer="#### 5")
    samples = [Sample(prompt, [1, 2], [0.0, 0.0], [0.0, 1.0], t, "stop", 0) for t in ("5", "\\boxed{9^{9^{9^{9}}}}", "5")]
    try:
        plugin.reward(prompt=prompt, samples=samples[:1])  # the worker is up
        started = time.perf_counter()
        assert plugin.reward(prompt=prompt, samples=samples) == [1.0, 0.0, 1.0]
        assert time.perf_counter() - started < 1.0 + 20.0  # the limit, then a fresh worker's start
    finally:
        plugin.close()
        catalog.cache_clear()


def test_run_with_reward_math_verify(math_verify_site, tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", "math_verify"), env={"PYTHONPATH": str(math_verify_site)}
    )
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["reward/failed"] == 0 for m in metrics)


def test_a_row_without_answer_is_refused_up_front(math_verify_site, tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, data, tmp_path / "r", "--reward", "math_verify"), env={"PYTHONPATH": str(math_verify_site)}
    )
    assert out.returncode == 1
    assert "rows.jsonl:2: the answer field 'answer' is missing (fields: question); the math_verify reward needs it" in out.stderr


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
    assert ["pip", "install", "./packages/grpo-reward-math-verify"] in commands
