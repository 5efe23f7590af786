"""--ppo-epochs E with --minibatches-per-step K: E·K optimizer steps per step, all against the
step-start π_old, checked against a hand computation on a linear toy policy."""

from __future__ import annotations

import types

import attrs
import pytest
import torch

from grpo_core import LossOutput, Prompt, Sample, hookimpl
from grpo_core.config import RunConfig
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import train_step, updates_per_step

VOCAB = 5
LR = 0.5


class ToyTrainer:
    """A policy whose next-token distribution is softmax(w), whatever the context; SGD on w."""

    tokenizer = None

    def __init__(self) -> None:
        self.w = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
        self.version = 0
        self.forwards = 0

    def logprobs(self, datum) -> torch.Tensor:
        return torch.log_softmax(self.w, 0)[torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())]

    def forward(self, datums):
        self.forwards += 1
        with torch.no_grad():
            return [self.logprobs(d) for d in datums]

    def forward_backward_custom(self, datums, loss_fn):
        loss, metrics = loss_fn(datums, [self.logprobs(d) for d in datums])
        loss.backward()
        return types.SimpleNamespace(metrics={"loss": float(loss.detach()), **metrics})

    def optim_step(self, adam_params):
        with torch.no_grad():
            self.w -= adam_params.learning_rate * self.w.grad
        self.w.grad = None
        self.version += 1
        return {}


@attrs.define
class RatioLoss:
    """-Σ ratio·A over trained tokens / the step's tokens, ratio = exp(logprob - π_old)."""

    ratios: list[float] = attrs.field(factory=list)

    @hookimpl
    def loss(self, inputs):
        terms = [
            (torch.exp(lp - old) * adv * mask).sum()
            for lp, old, adv, mask in zip(inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask)
        ]
        with torch.no_grad():
            self.ratios.append([float(torch.exp(lp - old).mean()) for lp, old in zip(inputs.logprobs, inputs.old_logprobs)])
        return LossOutput(loss=-sum(terms) / inputs.num_tokens, metrics={})


def group(tokens_and_advantages):
    prompt = Prompt(id="p", text="x")
    return [
        Sample(
            prompt=prompt, tokens=tokens, sampling_logprobs=[-1.0] * len(tokens), loss_mask=[0.0] + [1.0] * (len(tokens) - 1),
            text="", finish_reason="stop", policy_version=0, advantages=[adv] * len(tokens),
        )
        for tokens, adv in tokens_and_advantages
    ]  # fmt: skip


GROUPS = [group([([0, 1, 2], 1.0), ([0, 3], -1.0)]), group([([0, 4, 4], 0.5), ([0, 2], -0.5)])]


def hand_computed_w(epochs: int, minibatches: int) -> torch.Tensor:
    """SGD on the loss of each minibatch in turn, ratios against softmax(w) of the step's start."""
    w = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5], dtype=torch.float64)
    old = torch.log_softmax(w, 0)
    shares = [GROUPS] if minibatches == 1 else [[g] for g in GROUPS]
    for _ in range(epochs):
        for share in shares:
            samples = [s for g in share for s in g]
            num_tokens = sum(len(s.tokens) - 1 for s in samples)
            # d/dw of -Σ_t A·exp(lp_t - old_t) / N, with d lp_t / dw = onehot(t) - softmax(w)
            p = torch.softmax(w, 0)
            grad = torch.zeros(VOCAB, dtype=torch.float64)
            for s in samples:
                for t in s.tokens[1:]:
                    ratio = torch.exp(torch.log(p[t]) - old[t])
                    grad -= s.advantages[0] * ratio * (torch.nn.functional.one_hot(torch.tensor(t), VOCAB) - p) / num_tokens
            w = w - LR * grad
    return w


@pytest.mark.parametrize("epochs, minibatches", [(2, 2), (3, 1), (1, 2), (1, 1)])
def test_epochs_times_minibatches_updates_against_the_step_start_policy(epochs, minibatches):
    config = RunConfig(ppo_epochs=epochs, minibatches_per_step=minibatches, prompt_groups_per_step=2)
    trainer, loss = ToyTrainer(), RatioLoss()
    metrics = train_step(build_manager([loss]), trainer, None, GROUPS, config, LR)
    assert updates_per_step(config) == epochs * minibatches
    assert metrics["optim/updates"] == epochs * minibatches == trainer.version
    assert torch.allclose(trainer.w.detach(), hand_computed_w(epochs, minibatches), atol=1e-12)
    # The first update is on-policy (ratio 1); every later one sees the moved policy against π_old.
    assert loss.ratios[0] == pytest.approx([1.0] * len(loss.ratios[0]))
    assert all(any(abs(r - 1.0) > 1e-6 for r in ratios) for ratios in loss.ratios[1:])
    # π_old is one forward at the step's start, not one per pass.
    assert trainer.forwards == (1 if epochs * minibatches > 1 else 0)


def test_the_hand_computation_tells_epochs_apart():
    assert not torch.allclose(hand_computed_w(2, 2), hand_computed_w(1, 2))
    assert not torch.allclose(hand_computed_w(2, 1), hand_computed_w(1, 2))


def truncated(sample):
    return attrs.evolve(sample, finish_reason="length")


def test_mask_truncated_trains_as_if_the_truncated_samples_were_absent():
    with_cut = [[GROUPS[0][0], truncated(GROUPS[0][1])], [truncated(GROUPS[1][0]), GROUPS[1][1]]]
    without_cut = [[GROUPS[0][0]], [GROUPS[1][1]]]

    def trained_w(groups, mask_truncated):
        trainer = ToyTrainer()
        config = RunConfig(mask_truncated=mask_truncated, ppo_epochs=2, prompt_groups_per_step=2)
        metrics = train_step(build_manager([RatioLoss()]), trainer, None, groups, config, LR)
        return trainer.w.detach(), metrics

    masked, metrics = trained_w(with_cut, True)
    assert metrics["completion/masked_truncated"] == 2
    assert torch.allclose(masked, trained_w(without_cut, False)[0], atol=1e-12)
    ignored, metrics = trained_w(with_cut, False)
    assert not torch.allclose(masked, ignored) and "completion/masked_truncated" not in metrics
    # The step's samples keep their loss mask (loggers show them as sampled).
    assert all(any(s.loss_mask) for g in with_cut for s in g)
