"""End to end: a run that fails ends in one clear message and an exit code, keeps what it trained,
and never writes a secret."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import grpo_core, grpo_core_in_process, make_plugin_package, small_run_args

PLUGINS = '''
import os
import attrs
from grpo_core import hookimpl, option
from grpo_core.plugins.losses.grpo import GRPOLoss


@attrs.define
class KeyedReward:
    """Scores length; needs an API key (a secret option), and breaks its contract on request."""

    api_key: str = option("", help="the service's key")
    wrong_count_at_call: int = option(0, help="return one score too few at this call (0 = never)")
    calls: int = attrs.field(default=0, init=False)

    @hookimpl
    def reward(self, prompt, samples):
        assert self.api_key == "sk-test-123", self.api_key
        self.calls += 1
        if self.calls == self.wrong_count_at_call:
            return [0.0] * (len(samples) - 1)
        return [len(s.text) / 10 for s in samples]


@attrs.define
class BuggyLoss(GRPOLoss):
    """The grpo loss, with a bug that shows at the third call."""

    calls: int = attrs.field(default=0, init=False)

    @hookimpl
    def loss(self, inputs):
        self.calls += 1
        if self.calls == 3:
            raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")
        return super().loss(inputs)
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkg")
    pkg = make_plugin_package(
        root,
        "grpo-safety-plugins",
        PLUGINS,
        {"reward.keyed": "grpo_safety_plugins:KeyedReward", "loss.buggy": "grpo_safety_plugins:BuggyLoss"},
    )
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(pkg)],
        check=True,
        capture_output=True,
    )
    return {"PYTHONPATH": str(target), "SAFETY_KEY": "sk-test-123"}


def run_args(tiny_model_dir, tiny_dataset, run_dir, *extra):
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", "keyed", "--no-drop-zero-variance-groups", *extra)
    return [*args, "--max-steps", "4", "--checkpoint-every", "1"]


def test_a_secret_option_is_never_written_and_must_be_given_again_to_resume(plugin_site, tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "r"
    out = grpo_core_in_process(*run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward-opt", "api_key=sk-test-123"), env=plugin_site)
    assert out.returncode == 0, out.stderr
    written = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".txt"))
    assert "sk-test-123" not in written + out.stdout + out.stderr
    assert json.loads((run_dir / "config.json").read_text())["plugin_options"]["reward"]["keyed"]["api_key"] == "***"

    more = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "5", env=plugin_site)
    assert more.returncode == 1
    assert "secret options were not saved; give them again (reward.keyed.api_key)" in more.stderr
    more = grpo_core_in_process(
        "run", "--resume", str(run_dir), "--max-steps", "5", "--reward-opt", "keyed.api_key=env:SAFETY_KEY", env=plugin_site
    )
    assert more.returncode == 0, more.stderr
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_a_setting_that_changes_the_run_cannot_change_on_resume(plugin_site, tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "r"
    assert (
        grpo_core_in_process(
            *run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward-opt", "api_key=env:SAFETY_KEY"), env=plugin_site
        ).returncode
        == 0
    )
    out = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "6", "--learning-rate", "0.5", env=plugin_site)
    assert out.returncode == 1
    assert "--learning-rate cannot change" in out.stderr and "allowed: --max-steps" in out.stderr
    assert "Traceback" not in out.stderr
    same = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "6", "--prompt-groups-per-step", "2", env=plugin_site)
    assert same.returncode == 0, same.stderr  # repeating a stored value is no change


def test_an_error_after_training_started_keeps_the_trained_steps_and_says_how_to_resume(
    plugin_site, tiny_model_dir, tiny_dataset, tmp_path
):
    run_dir = tmp_path / "r"
    # Two prompt groups per step: call 5 is step 3's first group.
    args = run_args(
        tiny_model_dir, tiny_dataset, run_dir, "--reward-opt", "api_key=env:SAFETY_KEY", "--reward-opt", "wrong_count_at_call=5"
    )
    out = grpo_core_in_process(*args, env=plugin_site)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-2:] == [
        "error: reward 'keyed' returned 3 scores for 4 samples",
        f"  steps 1-2 are saved in {run_dir}/checkpoints/step-000002; continue with: grpo-core run --resume {run_dir}",
    ]
    assert "Traceback" not in out.stderr
    resumed = grpo_core_in_process("run", "--resume", str(run_dir), env=plugin_site)
    assert resumed.returncode == 0, resumed.stderr
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_a_plugins_bug_names_the_plugin_and_its_distribution_with_its_traceback_in_the_run_directory(
    plugin_site, tiny_model_dir, tiny_dataset, tmp_path
):
    run_dir = tmp_path / "r"
    args = run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward-opt", "api_key=env:SAFETY_KEY", "--loss", "buggy")
    out = grpo_core_in_process(*args, env=plugin_site)
    assert out.returncode == 1  # not grpo-core's bug (exit 3): the plugin's, and its distribution is named
    assert out.stderr.splitlines()[-3:] == [
        "error: loss plugin 'buggy' from grpo-safety-plugins 1.2.3 raised TypeError: "
        "unsupported operand type(s) for +: 'Tensor' and 'NoneType'",
        f"  the traceback is in {run_dir}/traceback.txt (--debug shows it); a bug of grpo-safety-plugins: report it to its authors",
        f"  steps 1-2 are saved in {run_dir}/checkpoints/step-000002; continue with: grpo-core run --resume {run_dir}",
    ]
    assert "Traceback" not in out.stderr
    assert 'raise TypeError("unsupported operand' in (run_dir / "traceback.txt").read_text()
    debug = grpo_core_in_process(*args, "--overwrite", "--debug", env=plugin_site)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--beta2", "-1"], "beta2 must be in [0, 1), got -1.0"),
        (["--beta1", "1"], "beta1 must be in [0, 1), got 1.0"),
        (["--adam-eps", "0"], "adam_eps must be positive, got 0.0"),
        (["--learning-rate", "-1e-3"], "learning_rate must be >= 0, got -0.001"),
        (["--grad-clip-norm", "-1"], "grad_clip_norm must be >= 0, got -1.0"),
        (["--completions-per-prompt", "1"], "completions_per_prompt must be >= 2: a group of one has no advantage"),
    ],
)
def test_bad_optimizer_and_group_settings_are_refused_before_anything_runs(tiny_model_dir, tiny_dataset, tmp_path, flags, message):
    run_dir = tmp_path / "r"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, *flags))
    assert out.returncode == 1
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not run_dir.exists()


def test_a_zero_learning_rate_warns(tiny_model_dir, tiny_dataset, tmp_path):
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / "r", "--learning-rate", "0", "--max-steps", "1"))
    assert out.returncode == 0, out.stderr
    assert "warning: --learning-rate is 0: the policy will not change" in out.stderr


@pytest.mark.slow
def test_an_unreachable_hub_name_fails_at_once_and_leaves_no_run_directory(tmp_path):
    out = grpo_core("run", "--model", "no-such-org/no-such-model", "--dataset", "default", "--run-dir", str(tmp_path / "r"),
                    env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}, timeout=60)  # fmt: skip
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load model 'no-such-org/no-such-model': it is not a local folder")
    assert "http://127.0.0.1:9 cannot be reached" in lines[0]
    assert not (tmp_path / "r").exists()


def test_overwrite_never_empties_the_working_directory_or_a_folder_that_holds_no_run(tiny_model_dir, tiny_dataset, tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    (project / "model").mkdir()
    (project / "model" / "config.json").write_text('{"model_type": "qwen3"}')  # a model folder's config.json
    before = sorted(str(p.relative_to(project)) for p in project.rglob("*"))
    above = "--overwrite never empties the working directory or a folder above it ({}); choose another --run-dir"
    no_run = "--overwrite only replaces a grpo-core run, and {} holds no run's config.json (it holds {}); choose another --run-dir"
    cases = [
        (".", project, above.format(".")),
        ("..", project / "src", above.format("..")),
        ("model", project, no_run.format("model", "config.json")),
        (str(project), tmp_path, no_run.format(project, "model, notes.txt, src")),
    ]
    for run_dir, cwd, message in cases:
        out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--overwrite"), cwd=cwd)
        assert (out.returncode, out.stderr.strip().splitlines()) == (1, [f"error: {message}"])
        assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == before
    refused = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, project / "model"))
    assert "is not empty: choose another --run-dir" in refused.stderr  # no advice to overwrite what is no run


def test_a_refused_resume_changes_no_file(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "r"
    assert grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "3")).returncode == 0

    def files():  # the lock file is the lock's bookkeeping: taken and given back, it holds no PID
        return {p: (p.read_bytes(), p.stat().st_mtime_ns if p.name != ".lock" else 0) for p in run_dir.rglob("*") if p.is_file()}

    before = files()
    for extra in (["--max-steps", "2"], ["--max-steps", "3"]):
        out = grpo_core_in_process("run", "--resume", str(run_dir), *extra)
        assert out.returncode == 1 and out.stderr.splitlines()[-1].startswith(f"error: the run in {run_dir} is complete at step 3 of")
        assert files() == before


def wait_for_steps(run_dir, proc, steps, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {steps}: {proc.poll()}")


@pytest.mark.slow
def test_a_running_run_holds_its_folder_and_a_killed_one_leaves_a_lock_that_is_taken_over(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "r"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "200", "--epochs", "20", "--checkpoint-every", "1")
    proc = subprocess.Popen([sys.executable, "-m", "grpo_core.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(run_dir, proc, 2)
        assert (run_dir / ".lock").read_text() == f"{proc.pid}\n"
        in_use = f"error: run directory {run_dir} is in use by process {proc.pid} (a grpo-core run holds its lock)"
        second = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--seed", "2", "--overwrite"))
        resumed = grpo_core_in_process("run", "--resume", str(run_dir))
        exported = grpo_core_in_process("export", str(run_dir), str(tmp_path / "out"), "--step", "1")
        for out in (second, resumed, exported):
            assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(in_use), out.stderr
        assert not (tmp_path / "out").exists()
        assert json.loads((run_dir / "config.json").read_text())["seed"] == 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    resumed = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", str(steps_in(run_dir) + 1))
    assert resumed.returncode == 0, resumed.stderr
    assert f"note: {run_dir} was held by process {proc.pid}, which was stopped without ending; taking it over" in resumed.stderr
    assert (run_dir / ".lock").read_text() == ""  # a run that ends clears its PID


def steps_in(run_dir):
    return max(json.loads((c / "state.json").read_text())["step"] for c in (run_dir / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_a_secret_typed_on_the_command_line_is_not_in_what_wandb_records(plugin_site, tiny_model_dir, tiny_dataset, tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "r"
    args = run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward-opt", "api_key=sk-test-123", "--logger", "wandb")
    out = grpo_core(*args, "--max-steps", "1", "--logger-opt", "mode=offline", env={**plugin_site, "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr
    recorded = b"".join(p.read_bytes() for p in (run_dir / "wandb").rglob("*") if p.is_file())
    assert b"api_key=***" in recorded  # W&B keeps the command line: with the secret as config.json shows it
    assert b"sk-test-123" not in recorded + b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())


def tree(folder):
    """Every file under ``folder`` with its bytes (the lock file is the lock's bookkeeping)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_overwrite_replaces_only_what_grpo_core_wrote_and_keeps_the_data_the_run_reads(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "r"
    data = run_dir / "mydata.jsonl"
    args = small_run_args(tiny_model_dir, data, run_dir, "--checkpoint-every", "1")
    run_dir.mkdir()
    data.write_bytes(tiny_dataset.read_bytes())  # a folder holding only what the run reads is a new run's
    assert grpo_core_in_process(*args).returncode == 0
    (run_dir / "notes").mkdir()
    (run_dir / "notes" / "todo.txt").write_text("mine")
    before = tree(run_dir)
    out = grpo_core_in_process(*args, "--overwrite")
    assert (out.returncode, out.stderr.strip().splitlines()) == (
        1,
        [f"error: --overwrite only replaces what grpo-core wrote, and {run_dir} also holds notes, which it did not write: "
         f"move it out of {run_dir}, or choose another --run-dir"],
    )  # fmt: skip
    assert tree(run_dir) == before
    (run_dir / "notes" / "todo.txt").rename(tmp_path / "todo.txt")
    (run_dir / "notes").rmdir()
    before = tree(run_dir)
    # The trained policy as the new run's model: --overwrite would replace it.
    out = grpo_core_in_process(*small_run_args(run_dir / "final", data, run_dir, "--overwrite"))
    assert out.stderr.strip().splitlines() == [
        f"error: --overwrite would replace {run_dir / 'final'}, which this run reads: copy it out of {run_dir} "
        "and name the copy, or choose another --run-dir"
    ]
    assert tree(run_dir) == before
    out = grpo_core_in_process(*args, "--overwrite", "--max-steps", "1")
    assert out.returncode == 0, out.stderr
    assert data.read_bytes() == tiny_dataset.read_bytes()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()] == [1]
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".tmp-")]  # the old run is gone once training began
    resumed = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert steps_in(run_dir) == 2 and data.read_bytes() == tiny_dataset.read_bytes()


def test_overwrite_removes_only_the_files_the_old_run_listed_not_a_users_file_inside_its_folders(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "r"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "1")
    assert grpo_core_in_process(*args).returncode == 0
    listed = json.loads((run_dir / "manifest.json").read_text())["files"]
    assert {"config.json", "summary.json", "final/model.safetensors"} <= set(listed) and ".lock" not in listed
    assert any(f.startswith("checkpoints/step-000001/") for f in listed)
    # Folders named as grpo-core names its own: a logger's the old run never used, checkpoints/, final/.
    (run_dir / "wandb").mkdir()
    for name in ("wandb/keep.txt", "checkpoints/NOTES.txt", "final/analysis.ipynb"):
        (run_dir / name).write_text("mine")
    before = tree(run_dir)
    out = grpo_core_in_process(*args, "--overwrite", "--seed", "1")
    assert (out.returncode, out.stderr.strip().splitlines()) == (
        1,
        [f"error: --overwrite only replaces what grpo-core wrote, and {run_dir} also holds checkpoints/NOTES.txt, "
         f"final/analysis.ipynb, wandb/keep.txt, which it did not write: move them out of {run_dir}, or choose another --run-dir"],
    )  # fmt: skip
    assert tree(run_dir) == before
    for name in ("wandb/keep.txt", "checkpoints/NOTES.txt", "final/analysis.ipynb"):
        (run_dir / name).unlink()
    out = grpo_core_in_process(*args, "--overwrite", "--seed", "1")
    assert out.returncode == 0, out.stderr
    assert json.loads((run_dir / "config.json").read_text())["seed"] == 1


def test_without_a_manifest_overwrite_replaces_only_top_level_files_grpo_core_writes(tmp_path):
    from grpo_core.run_dir import overwrite_refusal

    run_dir = tmp_path / "old"  # a run of an older grpo-core, or one stopped during its start: no manifest.json
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-000001" / "state.json").write_text("{}")
    keys = ("model", "dataset", "backend", "rollout", "reward", "advantage", "loss", "plugin_options")
    (run_dir / "config.json").write_text(json.dumps({**dict.fromkeys(keys, "x"), "plugin_options": {}}))
    entries = ["checkpoints", "config.json"]
    assert "also holds checkpoints/step-000001/state.json, which it did not write" in overwrite_refusal(run_dir, entries)
    assert overwrite_refusal(run_dir, ["config.json"]) is None


def refusing_plugins(tmp_path):
    """Flags of plugins that refuse in their start (on_run_start, once the models have loaded)."""
    (tmp_path / "empty").mkdir(exist_ok=True)
    return {
        "distill": (  # the embedded model's tokenizer is not the tiny model's
            ["--advantage", "distill", "--advantage-opt", "teacher=default"],
            "error: distill: the teacher 'default' and the policy",
        ),
        "reward_model": (
            ["--reward", "reward_model", "--reward-opt", f"model={tmp_path / 'empty'}"],
            "error: reward_model: cannot load",
        ),
    }


@pytest.mark.parametrize("plugin", ["distill", "reward_model"])
def test_a_plugin_refusing_at_start_leaves_the_folder_as_it_was_and_the_corrected_command_runs(
    tiny_model_dir, tiny_dataset, tmp_path, plugin
):
    flags, message = refusing_plugins(tmp_path)[plugin]
    run_dir = tmp_path / "runs" / "new"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, *flags))
    assert out.returncode == 1 and any(line.startswith(message) for line in out.stderr.splitlines()), out.stderr
    assert not (tmp_path / "runs").exists()  # nor the folder made to hold it
    fixed = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir))
    assert fixed.returncode == 0, fixed.stderr

    before = tree(run_dir)
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "1", *flags, "--overwrite"))
    assert out.returncode == 1 and any(line.startswith(message) for line in out.stderr.splitlines()), out.stderr
    assert tree(run_dir) == before  # the run it was to replace is back, whole


def test_a_resumed_run_refused_at_start_keeps_its_folder_and_files_as_they_were(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    from grpo_core.errors import PluginError
    from grpo_core.plugins.loggers import jsonl

    run_dir = tmp_path / "r"
    assert grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--logger", "jsonl")).returncode == 0
    before = tree(run_dir)

    def refuse(*args, **kwargs):  # a logger refusing once config.json and data.json are rewritten
        raise PluginError("the metrics file is read-only")

    monkeypatch.setattr(jsonl, "keep_lines_up_to", refuse)
    out = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "3")
    assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (1, "error: the metrics file is read-only")
    assert tree(run_dir) == before  # config.json does not say max_steps 3


@pytest.mark.parametrize("checkpoint_every", ["1", "0"])  # the last step's own checkpoint, or the run's end's
def test_the_end_of_a_run_keeps_the_trained_policy_when_its_checkpoint_finds_no_space(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, checkpoint_every
):
    import errno

    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    clean = tmp_path / "clean"
    assert grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, clean)).returncode == 0
    real_save = safetensors.torch.save_file

    def disk_full_at_the_last_optimizer_state(obj, path, *args, **kwargs):
        if "/optimizer" in str(path) and ".tmp-step-000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full_at_the_last_optimizer_state)
    run_dir = tmp_path / "r"
    if checkpoint_every == "0":  # a first checkpoint, then none until the end
        assert grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "1")).returncode == 0
        out = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "2", "--checkpoint-every", "0")
    else:
        out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--checkpoint-every", "1"))
    monkeypatch.undo()
    final = run_dir / "final"
    full = (
        r"could not write checkpoint step-000002: OSError: \[Errno 28\] No space left on device; no space left on /\S*: "
        r"needed about [\d.]+ [kMG]B \(the size of step-000001\), free [\d.]+ [kMG]B; the previous checkpoint step-000001 is intact"
    )
    kept = (
        rf"the trained policy of step 2 is saved in {re.escape(str(final))} \(its weights, without the optimizer state: load it as "
        rf"a model, or train on from it with --model {re.escape(str(final))} and another --run-dir\)"
    )
    assert out.returncode == 1
    said = out.stderr.strip().splitlines()[-1]
    # Either way the end writes the last step's checkpoint (checkpoint_every 1 leaves it to the end).
    assert re.fullmatch(f"error: {full}; {kept}", said), out.stderr
    assert json.loads((run_dir / "summary.json").read_text())["checkpoint"] is None
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000001"]
    kept_weights = AutoModelForCausalLM.from_pretrained(final).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(clean / "final").state_dict()
    assert kept_weights.keys() == trained.keys() and all(torch.equal(kept_weights[k], trained[k]) for k in kept_weights)


def test_a_run_directory_too_small_for_its_checkpoints_is_refused_before_the_model_loads_unless_allowed(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch
):
    import os

    from grpo_core.checkpoint import estimated_bytes, human, tensor_shapes

    each, final, _ = estimated_bytes(tensor_shapes(tiny_model_dir), 4, 0)  # float32 on a CPU, full fine-tune
    needed = 2 * each + final  # 2 kept, then final/ beside them (2 checkpoints in all: no third at once)
    free = needed - 1

    class Stat:
        f_frsize, f_bavail = 1, free

    monkeypatch.setattr(os, "statvfs", lambda path: Stat())
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--checkpoint-every", "1"))
    said = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1, out.stderr
    assert said.startswith("error: the run directory cannot hold this run's checkpoints: no space left on "), said
    assert f": needed {human(needed)}, free {human(free)} (each checkpoint about {human(each)} (weights " in said
    assert f"2 to write, final/ {human(final)}: up to {human(needed)} at once" in said
    # One kept: still two at once while the second is written; one checkpoint: final/ beside it.
    options = f"--keep-checkpoints 1: {human(2 * each)}; --checkpoint-every 0 (one checkpoint, at the end): {human(each + final)}"
    assert f"what these options need: {options}; --lora-rank 16 (LoRA adapters only): " in said
    assert said.endswith("; or choose a --run-dir on a larger disk; --allow-low-disk starts it anyway")
    assert "trainer forward" not in out.stderr  # refused before the trainer (its model) was made
    assert list(run_dir.iterdir()) == [run_dir / ".lock"] or not list(run_dir.iterdir())

    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--checkpoint-every", "1", "--allow-low-disk"))
    assert out.returncode == 0, out.stderr
    assert (
        "warning: the run directory cannot hold this run's checkpoints" in out.stderr
        and "(--allow-low-disk: starting anyway)" in out.stderr
    )
    assert (run_dir / "final").is_dir() and [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000001", "step-000002"]
    sizes = [sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in (run_dir / "checkpoints").iterdir()]
    assert all(abs(size - each) < each * 0.15 for size in sizes), (sizes, each)  # the estimate is the size written


def test_the_disk_plan_is_a_start_line(tiny_model_dir, tiny_dataset, tmp_path):
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / "r", "--max-steps", "1"))
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"^disk plan: each checkpoint about [\d.]+ [kM]B \(weights [\d.]+ [kM]B \+ fp32 AdamW moments\), 1 to write, "
        r"final/ [\d.]+ [kM]B: up to [\d.]+ [kM]B at once on the filesystem of \S+, [\d.]+ [kMG]B free$",
        out.stderr,
        re.M,
    ), out.stderr


def test_a_run_dir_that_cannot_be_made_is_one_line_and_exit_1(tiny_model_dir, tiny_dataset, tmp_path):
    (tmp_path / "afile").write_text("")
    run_dir = tmp_path / "afile" / "r"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir))
    assert (out.returncode, out.stderr.strip().splitlines()) == (
        1,
        [f"error: run directory {run_dir} cannot be written: Not a directory ({run_dir}); choose another --run-dir"],
    )


@pytest.mark.parametrize("optimizer_state", ["bf16", "8bit"])
def test_the_disk_plan_sizes_a_checkpoint_as_its_optimizer_state_writes_it(tiny_model_dir, tiny_dataset, tmp_path, optimizer_state):
    from grpo_core.checkpoint import folder_bytes, human

    run_dir = tmp_path / "r"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "1", "--optimizer-state", optimizer_state)
    out = grpo_core_in_process(*args)
    assert out.returncode == 0, out.stderr
    planned = next(line for line in out.stderr.splitlines() if line.startswith("disk plan: each checkpoint about "))
    assert f" + {optimizer_state} AdamW moments), 1 to write" in planned
    written = folder_bytes(run_dir / "checkpoints" / "step-000001")
    number, unit = planned.removeprefix("disk plan: each checkpoint about ").split()[:2]
    each = float(number) * {"kB": 1e3, "MB": 1e6}[unit]
    assert abs(each - written) < 0.1 * written, (planned, human(written))
