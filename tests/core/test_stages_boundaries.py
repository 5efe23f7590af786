"""Scoring and advantages at the boundaries their code draws (survivors of scripts/mutate.py)."""

from __future__ import annotations

import threading

import attrs
import pytest
import tinker
import torch

from grpo_core import LossInputs, LossOutput, hookimpl
from grpo_core.config import RunConfig
from grpo_core.plugins.advantages.grpo import GRPOAdvantage
from grpo_core.plugins.advantages.igpo import turn_contexts
from grpo_core.plugins_manager import build_manager
from grpo_core.selection import WeightedReward
from grpo_core.stages import compute_advantages, fwd_bwd_chunks, score_groups, train_on_groups
from grpo_core.types import Turn
from tests.core.table_rewards import TableReward, group, selection_of


@attrs.define
class ThreadRecordingReward:
    threads: list = attrs.field(factory=list)

    @hookimpl
    def reward(self, prompt, samples):
        self.threads.append(threading.current_thread())
        return [1.0 for _ in samples]


def test_without_a_timeout_rewards_run_in_the_callers_thread():
    # timeout defaults to 0 = no limit: no worker thread, so a reward may use thread-bound state.
    reward = ThreadRecordingReward()
    score_groups(selection_of(WeightedReward("r", 1.0, reward)), [group(["x", "y"])], max_failures_in_a_row=10)
    assert reward.threads == [threading.current_thread()]


def test_truncated_frac_counts_the_samples_that_hit_max_tokens():
    samples = group(["x", "y", "x", "y"])
    samples[2].finish_reason = "length"
    reward = ThreadRecordingReward()
    metrics = score_groups(selection_of(WeightedReward("r", 1.0, reward)), [samples], max_failures_in_a_row=10)
    assert metrics["completion/truncated_frac"] == 0.25


def test_an_empty_group_is_counted_as_skipped_not_failed():
    scored = group(["x", "y"])
    scored[0].reward, scored[1].reward = 1.0, 0.0
    kept, metrics = compute_advantages(build_manager([GRPOAdvantage()]), [[], scored, []], drop_zero_variance=True)
    assert len(kept) == 1
    assert metrics["groups/skipped"] == 2.0 and metrics["groups/dropped_failed"] == 0.0 and metrics["groups/kept"] == 1.0


def test_two_turns_have_two_contexts_to_score():
    sample = group(["x"])[0]
    sample.tokens = list(range(12))
    sample.turns = [Turn(3, 6, 9), Turn(9, 12, 12)]
    assert turn_contexts(sample) == [3, 9]


@attrs.define
class FakeTrainer:
    """A trainer whose logprob of a target token t is −t/10: the step's data path, without a model."""

    version: int = 0
    forwards: int = 0
    optim_calls: list = attrs.field(factory=list)

    def logprobs(self, datums):
        return [torch.tensor([-t / 10 for t in d.loss_fn_inputs["target_tokens"].tolist()], dtype=torch.float32) for d in datums]

    def forward(self, datums):
        self.forwards += 1
        return [lp - 1.0 for lp in self.logprobs(datums)]  # an older policy: 1 nat below

    def forward_backward_custom(self, datums, loss_fn):
        logprobs = [lp.requires_grad_() for lp in self.logprobs(datums)]
        loss, metrics = loss_fn(datums, logprobs)
        return tinker.ForwardBackwardOutput(
            loss_fn_output_type="TorchLossReturn", loss_fn_outputs=[], metrics={**metrics, "loss": float(loss)}
        )

    def optim_step(self, adam_params):
        self.optim_calls.append(adam_params)
        return {"optim/grad_norm": 0.5}


@attrs.define
class InputsSpy:
    seen: list = attrs.field(factory=list)

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        self.seen.append(inputs)
        trained = float(sum(m.sum() for m in inputs.mask))
        return LossOutput(loss=torch.tensor(float(len(inputs.logprobs))), metrics={"loss/policy": 1.0, "loss/mean_seen": trained})


def step_samples(policy_version=0):
    samples = group(["x", "y", "z"])
    masks = [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]  # the last one has nothing to train
    for i, s in enumerate(samples):
        s.tokens = [10 + i, 20 + i, 30 + i]
        s.loss_mask = masks[i]
        s.sampling_logprobs = [0.0, -0.5 - i, -0.25 - i]
        s.advantages = [9.0, 1.0 + i, -1.0 - i]
        s.policy_version = policy_version
    return samples


def train(samples, trainer=None, reference=None, **config):
    spy = InputsSpy()
    trainer = trainer or FakeTrainer()
    metrics = train_on_groups(build_manager([spy]), trainer, reference, [samples], RunConfig(**config), 0.01)
    return spy.seen, metrics, trainer


def test_train_on_groups_hands_the_loss_the_target_positions_of_each_sample():
    samples = step_samples()
    [inputs], metrics, trainer = train(samples)
    # Position 0 is the first prompt token: it is never a target, so everything drops it.
    assert [m.tolist() for m in inputs.mask] == [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]
    assert [a.tolist() for a in inputs.advantages] == [[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]]
    assert [s.tolist() for s in inputs.sampling_logprobs] == [[-0.5, -0.25], [-1.5, -1.25], [-2.5, -2.25]]
    assert inputs.ref_logprobs is None
    assert (inputs.num_sequences, inputs.num_tokens, inputs.max_tokens) == (2, 3.0, RunConfig().max_completion_tokens)
    # On-policy (every sample from the trainer's version): the ratio anchors on the detached logprobs.
    assert trainer.forwards == 0
    assert [o.tolist() for o in inputs.old_logprobs] == [lp.tolist() for lp in inputs.logprobs]
    assert metrics["train/samples"] == 3.0 and metrics["loss/total"] == 3.0 and metrics["optim/grad_norm"] == 0.5
    assert trainer.optim_calls[0].learning_rate == 0.01


def test_train_on_groups_anchors_off_policy_samples_on_the_old_policy_or_the_sampler():
    [inputs], _, trainer = train(step_samples(policy_version=0), FakeTrainer(version=1))
    assert trainer.forwards == 1
    assert inputs.old_logprobs[0].tolist() == pytest.approx([-2.0 - 1.0, -3.0 - 1.0])
    [inputs], _, trainer = train(step_samples(policy_version=0), FakeTrainer(version=1), anchor="sampling")
    assert trainer.forwards == 0
    assert [o.tolist() for o in inputs.old_logprobs] == [s.tolist() for s in inputs.sampling_logprobs]


def test_train_on_groups_passes_the_reference_logprobs():
    reference = FakeTrainer()
    [inputs], _, _ = train(step_samples(), reference=reference)
    assert reference.forwards == 1
    assert inputs.ref_logprobs[1].tolist() == pytest.approx([-2.1 - 1.0, -3.1 - 1.0])


def test_a_split_step_sums_step_totals_and_weighs_means_by_trained_tokens():
    seen, metrics, _ = train(step_samples(), max_samples_per_fwd_bwd=1)
    assert [len(i.logprobs) for i in seen] == [1, 1, 1]
    assert all((i.num_sequences, i.num_tokens) == (2, 3.0) for i in seen)
    assert metrics["loss/total"] == 3.0  # three calls of loss 1
    assert metrics["loss/policy"] == 3.0  # a step total: summed over the calls
    # a mean: each call's value weighed by its trained tokens (2, 1, 0), over the step's 3
    assert metrics["loss/mean_seen"] == pytest.approx((2.0 * 2 + 1.0 * 1 + 0.0 * 0) / 3)


def test_a_step_with_no_samples_is_skipped_without_an_optimizer_step():
    trainer = FakeTrainer()
    metrics = train_on_groups(build_manager([InputsSpy()]), trainer, None, [[], []], RunConfig(), 0.01)
    assert dict(metrics) == {"train/skipped": 1.0, "optim/updates": 0.0} and trainer.optim_calls == []


def test_a_step_of_one_trained_token_reports_its_means_unscaled():
    samples = step_samples()[1:2]  # one trained token
    _, metrics, _ = train(samples)
    assert metrics["loss/mean_seen"] == 1.0 and metrics["loss/policy"] == 1.0


def test_a_short_tail_joins_the_last_call_of_many():
    assert fwd_bwd_chunks(13, 3, 4) == [range(0, 4), range(4, 8), range(8, 13)]
    assert fwd_bwd_chunks(11, 3, 4) == [range(0, 4), range(4, 8), range(8, 11)]  # a tail of min_size stays
    assert fwd_bwd_chunks(5, 3, 4) == [range(0, 5)]  # two calls become one


def test_reward_std_of_one_and_of_two_samples():
    table = TableReward({"x": 1.0, "y": 0.0})
    one = score_groups(selection_of(WeightedReward("r", 1.0, table)), [group(["x"])], max_failures_in_a_row=10)
    assert one["reward/std"] == 0.0 and one["reward/total"] == 1.0 and one["reward/failed"] == 0.0
    two = score_groups(selection_of(WeightedReward("r", 1.0, table)), [group(["x", "y"])], max_failures_in_a_row=10)
    assert two["reward/std"] == 0.5 and two["reward/total"] == 0.5
