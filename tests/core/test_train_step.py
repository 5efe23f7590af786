"""A step split into several forward/backward calls trains exactly like one call."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from grpo_core import LossInputs, LossOutput, Prompt, Sample, hookimpl, make_plugin
from grpo_core.config import RunConfig
from grpo_core.loss import AGGREGATIONS
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import fwd_bwd_chunks, train_on_groups
from tests.core.off_policy import LOSS_CONFIGS, off_policy_samples, samples_for


def test_greedy_chunks():
    assert fwd_bwd_chunks(10, 1, None) == [range(0, 10)]
    assert fwd_bwd_chunks(10, 1, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert fwd_bwd_chunks(10, 3, 4) == [range(0, 4), range(4, 10)]
    assert fwd_bwd_chunks(8, 3, 4) == [range(0, 4), range(4, 8)]
    assert fwd_bwd_chunks(1, 3, 4) == [range(0, 1)]


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("loss_name", ["grpo", "gspo", "cispo"])
def test_split_step_gradient_equals_one_call(tiny_model_dir, agg, loss_name, monkeypatch):
    from grpo_core.engine.trainer import LocalTrainer

    captured: dict = {}
    monkeypatch.setattr(
        LocalTrainer,
        "optim_step",
        lambda self, params: captured.update({n: p.grad.clone() for n, p in self.model.named_parameters()}) or {},
    )
    grads = []
    for max_per_call in (None, 3):
        config = RunConfig(model=str(tiny_model_dir), max_samples_per_fwd_bwd=max_per_call, max_completion_tokens=8, grad_clip_norm=0.0)
        trainer = LocalBackend().make_trainer(config=config)
        loss = make_plugin(f"loss.{loss_name}", agg=agg, **({"kl_beta": 0.0} if loss_name == "grpo" else {}))
        metrics = train_on_groups(build_manager([loss]), trainer, None, [samples_for(trainer.tokenizer)], config, 1e-3)
        grads.append((dict(captured), metrics))
    (one, metrics_one), (split, metrics_split) = grads
    for key in ("loss/total", "loss/policy", "loss/active_tokens"):
        assert metrics_split[key] == pytest.approx(metrics_one[key], rel=1e-5, abs=1e-6), key
    for name in one:
        assert torch.allclose(one[name], split[name], atol=1e-5, rtol=1e-4), name


def fresh_trainer(tiny_model_dir, **config):
    config = RunConfig(model=str(tiny_model_dir), max_completion_tokens=8, grad_clip_norm=0.0, **config)
    return config, LocalBackend().make_trainer(config=config)


@attrs.define
class NormalizerSpy:
    """A loss that records the step normalizers each forward/backward call receives."""

    seen: list = attrs.field(factory=list)

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        self.seen.append((len(inputs.logprobs), inputs.num_sequences, inputs.num_tokens))
        return LossOutput(loss=sum(lp.sum() for lp in inputs.logprobs) * 0.0, metrics={"loss/policy": 0.0})


@pytest.mark.parametrize("max_per_call", [None, 3])
def test_num_sequences_counts_only_sequences_with_a_trained_token(tiny_model_dir, max_per_call):
    config, trainer = fresh_trainer(tiny_model_dir, max_samples_per_fwd_bwd=max_per_call)
    samples = samples_for(trainer.tokenizer)
    spy = NormalizerSpy()
    train_on_groups(build_manager([spy]), trainer, None, [samples], config, 1e-3)
    trained_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
    calls = [7] if max_per_call is None else [3, 3, 1]
    # 7 sequences, one of them all-masked: N = 6 in every call, Σm the whole step's.
    assert spy.seen == [(n, 6, trained_tokens) for n in calls]


@pytest.mark.parametrize("anchor", ["sampling", "stale"])
@pytest.mark.parametrize("loss_name", list(LOSS_CONFIGS))
def test_every_metric_of_a_split_step_equals_the_one_call_value(tiny_model_dir, loss_name, anchor):
    # anchor=sampling: π_old = π_s, so ratios (and the clip fractions) move; stale samples: π_old is
    # the trainer's forward, so the TIS weights move. A reference with other weights moves kl/*.
    results = []
    for max_per_call in (None, 3):
        config, trainer = fresh_trainer(
            tiny_model_dir, max_samples_per_fwd_bwd=max_per_call, anchor="sampling" if anchor == "sampling" else "old_policy"
        )
        samples = off_policy_samples(trainer.tokenizer)
        if anchor == "stale":
            for s in samples:
                s.policy_version = -1
        # In memory: its weights are changed in place below (an offloaded one's wait in a file).
        reference = LocalBackend(reference="memory").make_reference(config=config, trainer=trainer)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in reference.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        plugins = [make_plugin(f"loss.{loss_name}", **LOSS_CONFIGS[loss_name]), make_plugin("tis", cap=1.5, icepop=3.0)]
        results.append(train_on_groups(build_manager(plugins), trainer, reference, [samples], config, 1e-3))
    one, split = results
    assert set(one) == set(split)
    moving = ["kl/mean", "loss/policy"] + (
        ["loss/ratio_mean"] if anchor == "sampling" else ["tis/weight_mean", "tis/clip_frac", "tis/icepop_frac"]
    )
    for key in moving:  # the inputs make these metrics informative, not 0 or 1 by construction
        assert one[key] not in (0.0, 1.0), key
    differ = {key: (split[key], one[key]) for key in one if split[key] != pytest.approx(one[key], rel=1e-4, abs=1e-6)}
    assert not differ, differ


def two_completions(tokenizer):
    """One prompt, a completion to reinforce (A = +1) and one to discourage (A = −1)."""
    prompt = tokenizer("Question: what is 3 plus 4?\nAnswer:")["input_ids"]
    good, bad = tokenizer(" 3 + 4 = 7\n#### 7")["input_ids"], tokenizer(" 12 plus 9")["input_ids"]
    return [
        Sample(prompt=Prompt(id="p", text="q"), tokens=prompt + c, sampling_logprobs=[0.0] * (len(prompt) + len(c)),
               loss_mask=[0.0] * len(prompt) + [1.0] * len(c), text="", finish_reason="stop", policy_version=0,
               advantages=[adv] * (len(prompt) + len(c)))
        for c, adv in ((good, 1.0), (bad, -1.0))
    ]  # fmt: skip


def completion_logprob(trainer, sample) -> float:
    from grpo_core.backend import sample_to_datum

    lp = trainer.forward([sample_to_datum(sample)])[0]
    return float((lp * torch.tensor(sample.loss_mask[1:])).sum())


@pytest.mark.parametrize("tis", [False, True], ids=["alone", "with_tis"])
@pytest.mark.parametrize("loss_name", ["grpo", "importance_sampling", "reinforce", "dapo", "dro", "gspo", "cispo"])
def test_one_step_of_every_loss_moves_the_policy_toward_higher_reward(tiny_model_dir, loss_name, tis):
    config, trainer = fresh_trainer(tiny_model_dir)
    samples = two_completions(trainer.tokenizer)
    for s in samples:  # the sampler's logprobs: the policy's own, a little off (TIS weights ≠ 1)
        from grpo_core.backend import sample_to_datum

        lp = trainer.forward([sample_to_datum(s)])[0].tolist()
        s.sampling_logprobs = [0.0] + [x + 0.1 for x in lp]
    loss = make_plugin(f"loss.{loss_name}")
    reference = LocalBackend().make_reference(config=config, trainer=trainer) if loss.needs_reference else None
    plugins = [loss] + ([make_plugin("tis", cap=5.0)] if tis else [])
    before = [completion_logprob(trainer, s) for s in samples]
    metrics = train_on_groups(build_manager(plugins), trainer, reference, [samples], config, 1e-2)
    after = [completion_logprob(trainer, s) for s in samples]
    assert trainer.version == 1 and metrics["optim/grad_norm"] > 0
    assert after[0] > before[0] + 0.05, (before, after)  # A > 0: more likely
    assert after[1] < before[1] - 0.05, (before, after)  # A < 0: less likely
    if tis:
        assert metrics["tis/weight_mean"] == pytest.approx(math.exp(-0.1), rel=1e-4)
