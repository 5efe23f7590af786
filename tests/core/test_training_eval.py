"""--eval-every: held-out evaluation at step 0, every N steps and at the end, through every logger."""

from __future__ import annotations

import attrs
import pytest
import torch

from grpo_core import PluginError, hookimpl, selection
from grpo_core.config import RunConfig
from grpo_core.data import load_dataset
from grpo_core.lifecycle import sampling_params
from grpo_core.measure import training_eval
from grpo_core.metrics import computed_only
from grpo_core.plugins_manager import PluginEntry
from grpo_core.selection import select_plugins
from grpo_core.train import run
from tests.core.tiny_runs import config, metrics_of, weights_of

KILL_AT_STEP: dict[str, int] = {}


@attrs.define
class KillAfterStep:
    """Ends the process the hard way (no failure checkpoint, as a SIGKILL would) at KILL_AT_STEP["step"]."""

    @hookimpl
    def on_step(self, step, metrics, state):
        if KILL_AT_STEP.get("step") == step:
            raise SystemExit("killed")


@attrs.define
class EvalRecorder:
    """A logger that keeps what it was given in RECORDED."""

    @hookimpl
    def on_step(self, step, metrics, state):
        RECORDED.append((step, dict(metrics)))


RECORDED: list = []


@pytest.fixture(autouse=True)
def test_plugins(monkeypatch):
    original = selection.find
    ours = {
        ("logger", "kill"): f"{__name__}:KillAfterStep",
        ("logger", "recorder"): f"{__name__}:EvalRecorder",
        ("reward", "length"): "tests.core.tiny_runs:LengthReward",
    }

    def find(name, kind=None):
        if (kind, name) in ours:
            return PluginEntry(kind=kind, name=name, target=ours[kind, name], distribution="tests", version="0")
        return original(name, kind)

    monkeypatch.setattr(selection, "find", find)
    KILL_AT_STEP.clear()
    RECORDED.clear()


def eval_config(tiny_model_dir, tiny_dataset, run_dir, **kw):
    base = dict(eval_every=2, eval_dataset=str(tiny_dataset), eval_prompts=3, eval_samples=2, max_steps=3)
    return config(tiny_model_dir, tiny_dataset, run_dir, **{**base, **kw})


def evals(run_dir):
    return [(m["step"], m) for m in metrics_of(run_dir) if "eval/pass@1" in m]


def test_eval_at_step_0_every_n_steps_and_at_the_end_through_every_logger(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(eval_config(tiny_model_dir, tiny_dataset, r, logger=["jsonl", "recorder", "console"]))
    assert [step for step, _ in evals(r)] == [0, 2, 3]
    assert [step for step, m in RECORDED if "eval/pass@1" in m] == [0, 2, 3]
    assert [m["step"] for m in metrics_of(r)] == [0, 1, 2, 3]
    step0 = metrics_of(r)[0]
    assert set(step0) == {"step", "eval/pass@1", "eval/greedy_reward_mean", "eval/reward_mean", "eval/sampled_pass@1",
                          "eval/pass@2", "eval/reward_failed", "eval/prompts", "time/eval"}  # fmt: skip
    for _, m in evals(r):
        assert m["eval/prompts"] == 3 and m["eval/reward_failed"] == 0
        assert m["eval/reward_mean"] > 0 and m["eval/greedy_reward_mean"] > 0
        assert (3 * m["eval/pass@1"]).is_integer()  # one greedy sample of each of 3 prompts
        assert 0 <= m["eval/sampled_pass@1"] <= m["eval/pass@2"] <= 1


def test_the_pass_threshold_and_greedy_decoding_are_honoured(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(eval_config(tiny_model_dir, tiny_dataset, r, eval_pass_threshold=0.0, max_steps=1, eval_samples=3))
    for _, m in evals(r):
        assert m["eval/pass@1"] == m["eval/sampled_pass@1"] == m["eval/pass@3"] == 1.0
    never = tmp_path / "never"
    run(eval_config(tiny_model_dir, tiny_dataset, never, eval_pass_threshold=1e9, max_steps=1, eval_samples=3))
    for _, m in evals(never):
        assert m["eval/pass@1"] == m["eval/sampled_pass@1"] == m["eval/pass@3"] == 0.0


def test_a_run_with_evaluation_trains_exactly_as_one_without(tiny_model_dir, tiny_dataset, tmp_path):
    plain, evaluated = tmp_path / "plain", tmp_path / "evaluated"
    run(config(tiny_model_dir, tiny_dataset, plain, max_steps=3))
    run(eval_config(tiny_model_dir, tiny_dataset, evaluated, eval_every=1))
    wa, wb = weights_of(plain), weights_of(evaluated)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    trained = [{k: v for k, v in computed_only(m).items() if not k.startswith("eval/")} for m in metrics_of(evaluated)[1:]]
    assert trained == [computed_only(m) for m in metrics_of(plain)]


def test_a_killed_and_resumed_run_logs_each_eval_step_once(tiny_model_dir, tiny_dataset, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    kw = dict(max_steps=6, eval_every=5, checkpoint_every=2, logger=["kill", "jsonl"])
    run(eval_config(tiny_model_dir, tiny_dataset, whole, **kw))
    KILL_AT_STEP["step"] = 5
    with pytest.raises(SystemExit):
        run(eval_config(tiny_model_dir, tiny_dataset, killed, **kw))
    assert max(m["step"] for m in metrics_of(killed)) == 5  # the eval of step 5 was logged, its checkpoint not written
    KILL_AT_STEP.clear()
    run(eval_config(tiny_model_dir, tiny_dataset, killed, **kw), resume=True)
    assert [step for step, _ in evals(killed)] == [0, 5, 6]
    assert [m["step"] for m in metrics_of(killed)] == list(range(7))

    def values(run_dir):
        return [{k: v for k, v in m.items() if k.startswith("eval/")} for _, m in evals(run_dir)]

    assert values(killed) == values(whole)


def test_eval_in_the_async_loop(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(eval_config(tiny_model_dir, tiny_dataset, r, loop="async"))
    assert [step for step, _ in evals(r)] == [0, 2, 3]
    assert all(m["eval/reward_mean"] > 0 and m["eval/prompts"] == 3 for _, m in evals(r))


def test_eval_needs_held_out_rows_when_the_task_is_not_embedded(tiny_model_dir, tiny_dataset, tmp_path):
    with pytest.raises(PluginError, match="pass --eval-dataset with the held-out rows"):
        run(eval_config(tiny_model_dir, tiny_dataset, tmp_path / "r", eval_dataset=None))
    with pytest.raises(PluginError, match="dataset file not found"):
        run(eval_config(tiny_model_dir, tiny_dataset, tmp_path / "r", eval_dataset=str(tmp_path / "none.jsonl")))
    assert not (tmp_path / "r").exists()  # refused before the run directory was made


def test_the_embedded_task_evaluates_on_its_test_split():
    config = RunConfig(eval_every=4, eval_prompts=5)
    chosen = select_plugins(config)
    tokenizer, max_context = chosen.manager.hook.load_tokenizer(config=config)
    evaluator = training_eval(config, chosen, tokenizer, max_context, 10, sampling_params(config))
    test_split = load_dataset(RunConfig(dataset="default:test", max_rows=5)).prompts
    assert [p.id for p in evaluator.prompts] == [p.id for p in test_split]
    assert [step for step in range(11) if evaluator.due(step)] == [0, 4, 8, 10]
    assert evaluator.params.max_tokens == config.max_completion_tokens and evaluator.num_samples == config.eval_samples


@attrs.define
class FailingReward:
    """Fails every sample (None)."""

    @hookimpl
    def reward(self, prompt, samples):
        return [None] * len(samples)


def test_eval_scores_never_count_in_the_trainings_failures_in_a_row(tiny_model_dir, tiny_dataset, monkeypatch):
    from grpo_core.measure import measure

    original = selection.find
    entry = PluginEntry(kind="reward", name="failing", target=f"{__name__}:FailingReward", distribution="tests", version="0")
    monkeypatch.setattr(selection, "find", lambda name, kind=None: entry if (kind, name) == ("reward", "failing") else original(name, kind))
    config = RunConfig(model=str(tiny_model_dir), dataset=str(tiny_dataset), reward={"failing": 1.0}, max_completion_tokens=3)
    chosen = select_plugins(config)
    trainer = chosen.manager.hook.make_trainer(config=config)
    sampler = chosen.manager.hook.make_sampler(config=config, trainer=trainer)
    prompts = load_dataset(attrs.evolve(config, max_rows=3)).prompts
    result = measure(chosen, sampler, prompts, 2, sampling_params(config), 2, 1.0, 0.0)
    assert result["reward/failed"] == 6 and result["pass@1"] == 0.0
    # The training's count lives in its RunState (reward_failures), which an evaluation never gets:
    # nothing shared to save and put back around it.
    assert not {"reward_failures_in_a_row", "last_reward_error"} & set(attrs.fields_dict(type(chosen)))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(eval_every=0, eval_samples=8), "--eval-samples would do nothing"),
        (
            dict(eval_every=0, eval_dataset="default:test", eval_prompts=3),
            "--eval-dataset, --eval-prompts, --eval-samples would do nothing",
        ),
        (dict(weight_sync_interval=2), "--weight-sync-interval 2 leaves behind the trained one"),
        (dict(weight_sync_interval=0), "--weight-sync-interval 0 leaves behind the trained one"),
    ],
)
def test_settings_an_evaluation_cannot_honour_are_refused(tiny_model_dir, tiny_dataset, tmp_path, kw, message):
    with pytest.raises(PluginError, match=message):
        run(eval_config(tiny_model_dir, tiny_dataset, tmp_path / "r", **kw))
