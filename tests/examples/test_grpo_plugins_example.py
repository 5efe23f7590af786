"""The example plugin package in examples/, pip-installed beside grpo-core and run by the CLI."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import grpo_core_in_process, small_run_args

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "examples" / "grpo-plugins-example"


def copy_of_the_package(root: Path) -> Path:
    """The example under ``root`` as in the repository (pip builds in the source tree: not in ours)."""
    copy = root / "examples" / PACKAGE.name
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return copy


def pip_install_target(target: Path, *paths: str, cwd: Path | None = None) -> None:
    """pip install into ``target`` (used through PYTHONPATH), leaving the test environment as it is."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), *paths],
        check=True,
        capture_output=True,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    pip_install_target(target, str(copy_of_the_package(tmp_path_factory.mktemp("source"))))
    return target


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_its_own_test_suite_passes_installed(example_site):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE / "tests")],
        capture_output=True,
        text=True,
        cwd=example_site,
        env={"PYTHONPATH": str(example_site), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    passed = re.search(r"\b(\d+) passed\b", out.stdout)
    assert passed and int(passed[1]) >= 20, out.stdout[-3000:]
    assert " failed" not in out.stdout and " skipped" not in out.stdout


def test_both_plugins_are_listed_with_the_distribution(example_site):
    infos = json.loads(grpo_core_in_process("plugins", "--json", env={"PYTHONPATH": str(example_site)}).stdout)
    by_name = {(i["kind"], i["name"]): i for i in infos}
    brevity, w_reinforce = by_name[("reward", "brevity")], by_name[("loss", "w_reinforce")]
    for info, hook, target in ((brevity, "reward", "grpo_plugins_example.brevity:BrevityReward"),
                               (w_reinforce, "loss", "grpo_plugins_example.w_reinforce:WReinforceLoss")):  # fmt: skip
        assert (info["distribution"], info["version"], info["target"]) == ("grpo-plugins-example", "0.1.0", target)
        assert info["hooks"] == [hook] and "error" not in info
    assert {o["name"]: o["default"] for o in brevity["options"]} == {"limit": 256}
    assert {o["name"]: o["default"] for o in w_reinforce["options"]} == {
        "positive_weight": 0.1, "agg": "token-mean", "kl_beta": 0.0, "kl_estimator": "k3",
    }  # fmt: skip


@pytest.mark.slow
def test_two_loose_modules_package_once_named_as_contributing_says(tmp_path):
    """The packaging trap of issue 10: two plugin modules beside pyproject.toml. Unnamed, setuptools
    refuses them; named with py-modules, they install and both plugins are found."""
    project = tmp_path / "loose"
    project.mkdir()
    for module in ("brevity.py", "w_reinforce.py"):
        shutil.copy(PACKAGE / "grpo_plugins_example" / module, project / module)
    pyproject = (PACKAGE / "pyproject.toml").read_text().replace("grpo_plugins_example.", "")
    unnamed = pyproject.replace('packages = ["grpo_plugins_example"]', "")
    (project / "pyproject.toml").write_text(unnamed)
    refused = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--target", str(tmp_path / "none"), str(project)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode != 0 and "Multiple top-level modules discovered in a flat-layout" in refused.stdout + refused.stderr

    named = unnamed.replace("[tool.setuptools]\n", '[tool.setuptools]\npy-modules = ["brevity", "w_reinforce"]\n')
    (project / "pyproject.toml").write_text(named)
    pip_install_target(tmp_path / "site", str(project))
    infos = json.loads(grpo_core_in_process("plugins", "--json", env={"PYTHONPATH": str(tmp_path / "site")}).stdout)
    found = {(i["kind"], i["name"]): i["target"] for i in infos if i["distribution"] == "grpo-plugins-example"}
    assert found == {("reward", "brevity"): "brevity:BrevityReward", ("loss", "w_reinforce"): "w_reinforce:WReinforceLoss"}
    assert all("error" not in i for i in infos if i["distribution"] == "grpo-plugins-example")


# " " as a stop string ends many completions of the tiny model early: lengths differ within a
# group, so brevity has a signal and every step trains.
TINY_RUN = ("--reward", "brevity", "--reward-opt", "limit=8", "--stop", " ")


def test_run_with_its_reward_and_its_loss(example_site, tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, *TINY_RUN, "--loss", "w_reinforce")
    out = grpo_core_in_process(*args, env={"PYTHONPATH": str(example_site)})
    assert out.returncode == 0, out.stderr
    metrics = metrics_of(run_dir)
    assert len(metrics) == 2
    for m in metrics:
        # the brevity reward with limit=8, on the completions this step sampled
        assert m["reward/brevity"] == pytest.approx(1 - m["tokens/completion_mean"] / 8)
        assert m["reward/total"] == pytest.approx(m["reward/brevity"]) and m["reward/failed"] == 0
        assert 0 < m["reward/brevity"] < 1 and m["reward/std"] > 0
        # the w_reinforce loss trained on every kept token; its own metric is a share in (0, 1)
        assert m["groups/kept"] >= 1 and m["loss/active_tokens"] > 0
        if m["groups/kept"] == 2:  # every sampled completion token is trained
            assert m["loss/active_tokens"] == m["tokens/completion"]
        assert 0 < m["loss/positive_frac"] < 1
        assert m["loss/ratio_mean"] == pytest.approx(1.0)  # on-policy
    config = json.loads((run_dir / "config.json").read_text())
    assert config["loss"] == ["w_reinforce"] and config["reward"] == {"brevity": 1.0}


def test_positive_weight_one_trains_exactly_like_importance_sampling(example_site, tiny_model_dir, tiny_dataset, tmp_path):
    env = {"PYTHONPATH": str(example_site)}
    runs = {
        "is": ("--loss", "importance_sampling"),
        "w1": ("--loss", "w_reinforce", "--loss-opt", "positive_weight=1", "--loss-opt", "agg=seq-mean-token-sum"),
        "w0.1": ("--loss", "w_reinforce", "--loss-opt", "agg=seq-mean-token-sum"),
    }
    metrics = {}
    for name, loss_args in runs.items():
        out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / name, *TINY_RUN, *loss_args), env=env)
        assert out.returncode == 0, out.stderr
        metrics[name] = metrics_of(tmp_path / name)
    for step_is, step_w1 in zip(metrics["is"], metrics["w1"]):
        for key in ("loss/total", "loss/policy", "optim/grad_norm", "reward/total"):
            assert step_w1[key] == pytest.approx(step_is[key], rel=1e-6, abs=1e-9), key
    # the same samples in step 1 (sampled before any update), a different loss: λ = 0.1 is used
    first_is, first_w = metrics["is"][0], metrics["w0.1"][0]
    assert first_w["reward/total"] == first_is["reward/total"]
    assert abs(first_w["loss/policy"] - first_is["loss/policy"]) > 1e-3


def readme_commands() -> list[str]:
    readme = (PACKAGE / "README.md").read_text()
    block = re.search(r"## Install and run.*?```bash\n(.*?)```", readme, re.DOTALL)
    assert block, "examples/grpo-plugins-example/README.md has an 'Install and run' bash block"
    return [line for line in block[1].splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_commands_work_as_written(tmp_path):
    """The README's commands, run from the repository root: pip into a target (not into the test
    environment), and the runs on the embedded model shortened to 2 steps."""
    commands = readme_commands()
    pip, listing, *runs = commands
    assert pip.startswith("pip install ") and listing == "grpo-core plugins" and len(runs) == 2
    site = tmp_path / "site"
    copy_of_the_package(tmp_path / "repo")
    pip_install_target(site, *shlex.split(pip)[2:], cwd=tmp_path / "repo")
    env = {"PYTHONPATH": str(site)}

    shown = re.search(r"lists both.*?```\n(.*?)```", (PACKAGE / "README.md").read_text(), re.DOTALL)[1]
    out = grpo_core_in_process(*shlex.split(listing)[1:], env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    for line in shown.splitlines():
        assert line in out.stdout

    first_steps = []
    for i, command in enumerate(runs):
        args = shlex.split(command)
        assert args[0] == "grpo-core"
        run_dir = tmp_path / f"run{i}"
        out = grpo_core_in_process(*args[1:], "--max-steps", "2", "--run-dir", str(run_dir), env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        metrics = metrics_of(run_dir)
        for m in metrics:
            assert m["reward/total"] == pytest.approx(m["reward/gsm8k"] + 0.1 * m["reward/brevity"])
            assert 0 <= m["loss/positive_frac"] <= 1 and m["loss/active_tokens"] > 0
        first_steps.append(metrics[0])
    default_limit, limit_16 = first_steps
    # step 1 samples the same completions in both runs; only brevity's limit differs
    assert default_limit["tokens/completion_mean"] == limit_16["tokens/completion_mean"]
    mean_tokens = default_limit["tokens/completion_mean"]
    assert default_limit["reward/brevity"] == pytest.approx(1 - mean_tokens / 256)
    assert 1 - mean_tokens / 16 <= limit_16["reward/brevity"] < default_limit["reward/brevity"]
    options = json.loads((tmp_path / "run1" / "config.json").read_text())["plugin_options"]
    assert float(options["loss"]["w_reinforce"]["positive_weight"]) == 0.5
    assert int(options["reward"]["brevity"]["limit"]) == 16


def test_contributing_shows_the_example_loss_and_pyproject_as_they_are():
    contributing = (REPO / "CONTRIBUTING.md").read_text()
    blocks = re.findall(r"```(python|toml)\n(.*?)```", contributing, re.DOTALL)
    assert sorted(lang for lang, _ in blocks) == ["python", "toml"]
    shown = dict(blocks)
    assert shown["python"] == (PACKAGE / "grpo_plugins_example" / "w_reinforce.py").read_text()
    assert shown["toml"] == (PACKAGE / "pyproject.toml").read_text()
