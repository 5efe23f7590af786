import math

import pytest
import torch

from grpo_core import LossInputs, call_loss, make_plugin

from .reference import AGGS, SCENARIOS, TIS_MODES, assert_matches_reference, check_all_scenarios, scenario


@pytest.mark.parametrize("tis", list(TIS_MODES))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "options",
    [{}, {"kl_beta": 0.05, "kl_estimator": "k1"}, {"ratio_log_cap": 0.5}, {"eps_low": 1.0}],
    ids=["default", "kl_k1", "ratio_log_cap", "no_lower_bound"],
)
def test_matches_reference(options, agg, tis):
    check_all_scenarios("cispo", options, agg, tis)


def test_ratio_carries_no_gradient():
    # gradient = −sg(clip(r, 0.8, 1.28))·A·w / Σm, even far outside the clip range
    lp = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-3.0, 3.0, 0.1, -0.1, 0.0], dtype=torch.float64)
    sampling = old - torch.tensor([1.0, -1.0, 0.0, 0.5, 0.0], dtype=torch.float64)  # w = min(e^{Δ}, 2)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    inputs = LossInputs(logprobs=[lp], old_logprobs=[old], sampling_logprobs=[sampling], mask=[mask], advantages=[adv])
    out = call_loss([make_plugin("cispo"), make_plugin("tis", cap=2.0)], inputs)
    out.loss.backward()
    r = torch.exp(lp.detach() - old)
    w = torch.exp(old - sampling).clamp(max=2.0)
    expected = -r.clamp(0.8, 1.28) * adv * w * mask / mask.sum()
    torch.testing.assert_close(lp.grad, expected, atol=1e-12, rtol=0)
    assert expected[0] != 0 and expected[1] != 0  # ratios e^{3}, e^{−3}: weight clipped, gradient kept
    assert out.loss.item() == pytest.approx(0.0)  # π = 0 everywhere: the value is 0, the gradient is not
    # of the 4 trained tokens, r = e^{−3} is clipped low and r = e^{3} high
    assert out.metrics["loss/clip_frac_low"] == pytest.approx(0.25)
    assert out.metrics["loss/clip_frac_high"] == pytest.approx(0.25)


def test_call_loss_with_tis_equals_reference():
    plugins = [make_plugin("cispo"), make_plugin("tis", cap=2.0)]
    for s in SCENARIOS:
        out = assert_matches_reference("cispo", scenario(s), {}, {"level": "token", "cap": 2.0}, plugins=plugins)
        assert {
            "tis/weight_mean",
            "tis/clip_frac",
            "loss/policy",
            "loss/clip_frac_low",
            "loss/clip_frac_high",
            "loss/ratio_mean",
            "loss/active_tokens",
        } <= set(out.metrics)


def test_defaults_follow_the_spec():
    loss = make_plugin("cispo")
    assert (loss.eps_low, loss.eps_high, loss.agg, loss.ratio_log_cap) == (0.2, 0.28, "token-mean", 20.0)
    assert loss.needs_reference is False
    assert make_plugin("cispo", kl_beta=0.01).needs_reference is True


@pytest.mark.parametrize("eps_low", [1.0, 1e6])
def test_eps_low_of_one_or_more_means_no_lower_bound(eps_low):
    # MiniMax-M1 runs CISPO with no lower bound: a token with r = e^{−3} is weighted by r itself,
    # not raised to 1 − eps_low; the upper bound still holds (e^{3} -> 1.28).
    lp = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([3.0, -3.0], dtype=torch.float64)
    inputs = LossInputs(
        logprobs=[lp],
        old_logprobs=[old],
        sampling_logprobs=[old],
        mask=[torch.ones(2, dtype=torch.float64)],
        advantages=[torch.ones(2, dtype=torch.float64)],
    )
    out = call_loss([make_plugin("cispo", eps_low=eps_low, agg="token-sum")], inputs)
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([-math.exp(-3.0), -1.28])
    assert out.metrics["loss/clip_frac_low"] == 0.0 and out.metrics["loss/clip_frac_high"] == 0.5
    default = call_loss(
        [make_plugin("cispo", agg="token-sum")],
        LossInputs(
            logprobs=[lp.detach().clone().requires_grad_()],
            old_logprobs=[old],
            sampling_logprobs=[old],
            mask=[torch.ones(2, dtype=torch.float64)],
            advantages=[torch.ones(2, dtype=torch.float64)],
        ),
    )
    assert default.metrics["loss/clip_frac_low"] == 0.5  # with eps_low = 0.2 the same token is raised to 0.8
