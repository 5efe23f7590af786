"""The curriculum group filter: prompts always or never solved rest for a number of passes of the order."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import attrs
import pytest
import torch

from grpo_core import hookimpl, make_plugin, selection
from grpo_core.errors import PluginError
from grpo_core.metrics import computed_only, scope
from grpo_core.plugins_manager import PluginEntry
from grpo_core.train import run
from grpo_core.types import Prompt, Sample
from tests.core.tiny_runs import config, metrics_of, weights_of
from tests.helpers import SIGNAL, grpo_core_in_process, small_run_args


def group(prompt_id, rewards):
    prompt = Prompt(id=prompt_id, text="q")
    return [Sample(prompt, [1, 2], [0.0, -0.5], [0.0, 1.0], "a", "stop", 0, reward=r) for r in rewards]


def observe(curriculum, *groups):
    curriculum.on_step(step=1, metrics={}, state=None, groups=list(groups))


def asked(curriculum, *ids):
    with scope() as recorded:
        kept = [curriculum.keep_prompt(prompt=Prompt(id=i, text="q")) for i in ids]
    return kept, recorded.as_dict()


def test_always_and_never_solved_prompts_rest_for_rest_passes_then_come_back():
    curriculum = make_plugin("curriculum", rest=2)
    observe(curriculum, group("solved", [1.0, 1.0]), group("unsolved", [0.0, 0.2]), group("mixed", [1.0, 0.0]), group("failed", [None]))
    assert curriculum.state_dict() == {"rates": {"mixed": [0.5]}, "resting": {"solved": [2, "solved"], "unsolved": [2, "unsolved"]}}
    kept, metrics = asked(curriculum, "solved", "unsolved", "mixed", "failed", "new")
    assert kept == [False, False, True, True, True]
    assert metrics == {"curriculum/resting": 2.0, "curriculum/passed_over_solved": 1.0, "curriculum/passed_over_unsolved": 1.0}
    assert asked(curriculum, "solved", "unsolved")[0] == [False, False]
    # Back after two passes, measured afresh.
    assert asked(curriculum, "solved", "unsolved") == ([True, True], {"curriculum/resting": 0.0})
    assert curriculum.state_dict()["resting"] == {}


def test_the_threshold_decides_what_solves_a_prompt():
    curriculum = make_plugin("curriculum", threshold=0.5)
    observe(curriculum, group("a", [0.5, 0.7]), group("b", [0.49, 0.1]))
    assert curriculum.state_dict()["resting"] == {"a": [1, "solved"], "b": [1, "unsolved"]}


def test_a_window_needs_that_many_groups_all_solved_or_all_unsolved():
    curriculum = make_plugin("curriculum", window=2)
    observe(curriculum, group("a", [1.0]), group("b", [1.0]))
    assert curriculum.state_dict()["resting"] == {}
    observe(curriculum, group("a", [1.0]), group("b", [0.0]))
    assert curriculum.state_dict() == {"rates": {"b": [1.0, 0.0]}, "resting": {"a": [1, "solved"]}}
    observe(curriculum, group("b", [0.0]))  # b's last two: 0 and 0
    assert curriculum.state_dict()["resting"]["b"] == [1, "unsolved"]


@pytest.mark.parametrize(
    ("options", "message"),
    [(dict(window=0), "window must be >= 1, got 0"), (dict(rest=-1), "rest must be >= 1"), (dict(rest=1.5), "expected an integer")],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("curriculum", **options)


@attrs.define
class LineReward:
    """Row 3k+1 always scores 1, 3k+2 never, 3k half its samples."""

    @hookimpl
    def reward(self, prompt, samples):
        line = int(prompt.id.rsplit(":", 1)[1])
        return [1.0 if line % 3 == 1 else 0.0 if line % 3 == 2 else float(i % 2) for i, _ in enumerate(samples)]


@pytest.fixture(autouse=True)
def line_reward(monkeypatch):
    original = selection.find
    entry = PluginEntry(kind="reward", name="line", target=f"{__name__}:LineReward", distribution="tests", version="0")
    monkeypatch.setattr(selection, "find", lambda name, kind=None: entry if (kind, name) == ("reward", "line") else original(name, kind))


def curriculum_run(tiny_model_dir, tmp_path, run_dir, **kw):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"what is {i} plus 2?"}) + "\n" for i in range(12)))
    base = dict(max_steps=12, epochs=3, reward=["line"], group_filter=["curriculum"], prompt_groups_per_step=2, seed=4)
    return config(tiny_model_dir, rows, run_dir, **{**base, **kw})


@pytest.mark.slow
def test_a_run_passes_over_resting_prompts_counts_them_and_resumes_bitwise(tiny_model_dir, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    summary = run(curriculum_run(tiny_model_dir, tmp_path, whole))
    lines = metrics_of(whole)
    passed_over = [m["sampling/passed_over"] for m in lines]
    # Epoch 1 (6 steps) rolls out all 12 rows; in epoch 2 the 8 always or never solved ones rest, and
    # the 4 mixed ones make 2 steps; epoch 3 brings the rested ones back.
    assert passed_over[:6] == [0] * 6 and sum(passed_over) == 8
    assert sum(m.get("curriculum/passed_over_solved", 0) for m in lines) == 4
    assert sum(m.get("curriculum/passed_over_unsolved", 0) for m in lines) == 4
    assert max(m["curriculum/resting"] for m in lines) == 8
    assert summary["steps"] == 12
    run(curriculum_run(tiny_model_dir, tmp_path, resumed, max_steps=7, checkpoint_every=1))
    saved = json.loads((resumed / "checkpoints" / "step-000007" / "state.json").read_text())
    assert saved["filter_states"]["curriculum"]["resting"] and saved["prompts_taken"] > 14
    run(curriculum_run(tiny_model_dir, tmp_path, resumed, checkpoint_every=1), resume=True)
    assert [computed_only(m) for m in metrics_of(resumed)] == [computed_only(m) for m in lines]
    a, b = weights_of(whole), weights_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_its_state_goes_back_as_it_was_given(tmp_path):
    curriculum = make_plugin("curriculum")
    observe(curriculum, group("a", [1.0]), group("b", [1.0, 0.0]))
    saved = curriculum.state_dict()
    assert json.loads(json.dumps(saved)) == saved == {"rates": {"b": [0.5]}, "resting": {"a": [1, "solved"]}}
    fresh = make_plugin("curriculum")
    fresh.load_state_dict(saved)
    assert asked(fresh, "a", "b")[0] == [False, True]
    assert saved["resting"] == {"a": [1, "solved"]}  # the checkpoint's copy is not the plugin's own


def test_a_filter_with_a_state_but_no_way_to_load_it_is_refused_on_resume():
    from grpo_core.lifecycle import restore_filter_states
    from grpo_core.types import RunState

    @attrs.define
    class Forgetful:
        def state_dict(self):
            return {}

    fake = attrs.make_class("Selection", {"group_filters": attrs.field()})({"forgetful": Forgetful()})
    with pytest.raises(PluginError, match="group filter 'forgetful' has a state_dict but no load_state_dict"):
        restore_filter_states(fake, RunState(run_dir=".", filter_states={"forgetful": {}}))


@pytest.mark.slow
def test_the_async_loop_passes_over_resting_prompts_too(tiny_model_dir, tmp_path):
    run(curriculum_run(tiny_model_dir, tmp_path, tmp_path / "run", loop="async", max_head_offpolicy_versions=0))
    lines = metrics_of(tmp_path / "run")
    by_reason = sum(m.get("curriculum/passed_over_solved", 0) + m.get("curriculum/passed_over_unsolved", 0) for m in lines)
    # Its workers take prompts ahead of the steps that observe them: some rest, never more than the 8.
    assert 0 < sum(m["sampling/passed_over"] for m in lines) == by_reason <= 8


@pytest.mark.slow
def test_without_the_curriculum_every_prompt_is_rolled_out(tiny_model_dir, tmp_path):
    run(curriculum_run(tiny_model_dir, tmp_path, tmp_path / "run", group_filter=[], max_steps=8))
    assert all("sampling/passed_over" not in m and "curriculum/resting" not in m for m in metrics_of(tmp_path / "run"))


@pytest.mark.slow
def test_a_kill_9_and_resume_repeat_the_uninterrupted_run(tiny_model_dir, tiny_dataset, tmp_path):
    def args(run_dir):
        extra = ("--group-filter", "curriculum", "--epochs", "2", "--checkpoint-every", "1", "--logger", "jsonl", "--seed", "3", *SIGNAL)
        # 12 rows, 6 steps an epoch; groups of 2 are often all solved or all not: some rest in epoch 2.
        small = ("--max-rows", "12", "--completions-per-prompt", "2", "--max-steps", "10")
        return [*small_run_args(tiny_model_dir, tiny_dataset, run_dir, *extra), *small]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert grpo_core_in_process(*args(whole)).returncode == 0
    lines = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["sampling/passed_over"] for m in lines) > 0  # the kill lands after the curriculum has skipped
    proc = subprocess.Popen([sys.executable, "-m", "grpo_core.cli", *args(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 8):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert grpo_core_in_process("run", "--resume", str(killed)).returncode == 0
    again = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [computed_only(m) for m in again] == [computed_only(m) for m in lines]
    a, b = weights_of(whole), weights_of(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
