import math

import pytest
import torch

from grpo_core import LossInputs, PluginError, call_loss, make_plugin

from .reference import AGGS, SCENARIOS, TIS_MODES, assert_matches_reference, check_all_scenarios, make_inputs, scenario

VARIANTS = {
    "default": {},
    "no_kl": {"kl_beta": 0.0},
    "k1_eps": {"eps_low": 0.1, "eps_high": 0.3, "kl_beta": 0.1, "kl_estimator": "k1"},
    "ratio_log_cap": {"ratio_log_cap": 0.5},
    "no_lower_clip": {"eps_low": 1.0},
}


@pytest.mark.parametrize("tis", list(TIS_MODES))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(variant, agg, tis):
    check_all_scenarios("grpo", VARIANTS[variant], agg, tis)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("tis", ["off", "token"])
def test_kl_estimators(estimator, tis):
    options = {"kl_beta": 0.3, "kl_estimator": estimator}
    plugins = [make_plugin("loss.grpo", **options)] + ([make_plugin("tis")] if tis == "token" else [])
    for s in SCENARIOS:
        out = assert_matches_reference("grpo", scenario(s), options, TIS_MODES[tis], plugins=plugins)
        assert "loss/kl" in out.metrics


def test_kl_values_on_concrete_numbers():
    # π − π_ref = 0.5 on one token: k1 = 0.5, k2 = 0.125, k3 = e^{−0.5} + 0.5 − 1.
    expected = {"k1": 0.5, "k2": 0.125, "k3": math.exp(-0.5) - 0.5}
    for estimator, kl in expected.items():
        lp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
        inputs = LossInputs(
            logprobs=[lp],
            old_logprobs=[lp.detach()],
            sampling_logprobs=[lp.detach()],
            ref_logprobs=[torch.tensor([-1.5], dtype=torch.float64)],
            mask=[torch.ones(1, dtype=torch.float64)],
            advantages=[torch.zeros(1, dtype=torch.float64)],
        )
        out = call_loss([make_plugin("loss.grpo", kl_beta=2.0, kl_estimator=estimator)], inputs)
        assert out.loss.item() == pytest.approx(2.0 * kl)
        assert out.metrics["loss/kl"] == pytest.approx(kl)


def test_kl_beta_zero_needs_no_reference():
    loss = make_plugin("loss.grpo", kl_beta=0.0)
    assert loss.needs_reference is False
    out = call_loss([loss], make_inputs(scenario("mixed"), with_ref=False))
    assert "loss/kl" not in out.metrics
    assert make_plugin("loss.grpo").needs_reference is True  # default kl_beta=0.001


def test_kl_without_reference_is_a_clear_error():
    with pytest.raises(ValueError, match=r"kl_beta > 0.*ref_logprobs.*kl_beta=0"):
        call_loss([make_plugin("loss.grpo")], make_inputs(scenario("mixed"), with_ref=False))


def test_tis_never_weights_the_kl_term():
    # Zero advantages: only the KL term is left, so TIS must not change the loss.
    seqs = [dict(s, adv=[0.0] * len(s["adv"])) for s in scenario("far")]
    loss = make_plugin("loss.grpo", kl_beta=0.5)
    plain = call_loss([loss], make_inputs(seqs)).loss.item()
    weighted = call_loss([loss, make_plugin("tis", cap=2.0)], make_inputs(seqs)).loss.item()
    assert plain != 0.0 and weighted == pytest.approx(plain, abs=1e-12)


def test_clip_fractions():
    # r = e^{±1}: A > 0 with r > 1.2 clips high; A < 0 with r < 0.8 clips low; the others do not.
    lp = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logprobs=[lp],
        old_logprobs=[torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64)],
        sampling_logprobs=[torch.zeros(4, dtype=torch.float64)],
        mask=[torch.ones(4, dtype=torch.float64)],
        advantages=[torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)],
    )
    out = call_loss([make_plugin("loss.grpo", kl_beta=0.0, agg="token-sum")], inputs)
    assert out.metrics["loss/clip_frac_high"] == pytest.approx(0.25)
    assert out.metrics["loss/clip_frac_low"] == pytest.approx(0.25)
    # clipped tokens: −1.2·1 and 0.8·1 (no gradient); unclipped: e^{1}·1 and −e^{−1}·1
    assert out.loss.item() == pytest.approx(-1.2 + 0.8 + math.e - math.exp(-1))
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, math.e, -math.exp(-1)])
    assert out.metrics["loss/policy"] == pytest.approx(out.loss.item())


@pytest.mark.parametrize(
    "options",
    [
        {"agg": "x"},
        {"eps_low": "abc"},
        {"kl_estimator": "k4"},
        {"kl_beta": -1.0},
        {"eps_low": -0.1},
        {"ratio_log_cap": 0.0},
        {"epsilon": 0.2},
    ],
)
def test_bad_options_raise_plugin_error(options):
    with pytest.raises(PluginError):
        make_plugin("loss.grpo", **options)


def test_string_options_are_parsed():
    loss = make_plugin("loss.grpo", eps_high="0.28", kl_beta="0", agg="token-mean")
    assert (loss.eps_high, loss.kl_beta, loss.agg) == (0.28, 0.0, "token-mean")


def test_eps_low_of_one_or_more_removes_the_lower_clip():
    # A < 0 and r = e^{−3}: eps_low = 0.2 clips (r < 0.8, no gradient); eps_low ≥ 1 puts the
    # lower bound at or below 0, which no ratio reaches: the token keeps −r·A and its gradient.
    r = math.exp(-3.0)
    for eps_low, value, grad, clipped in [(0.2, 0.8, 0.0, 1.0), (1.0, r, r, 0.0), (4.0, r, r, 0.0)]:
        lp = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
        inputs = LossInputs(
            logprobs=[lp],
            old_logprobs=[torch.tensor([3.0], dtype=torch.float64)],
            sampling_logprobs=[torch.tensor([3.0], dtype=torch.float64)],
            mask=[torch.ones(1, dtype=torch.float64)],
            advantages=[torch.tensor([-1.0], dtype=torch.float64)],
        )
        out = call_loss([make_plugin("loss.grpo", eps_low=eps_low, kl_beta=0.0)], inputs)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(value), eps_low
        assert lp.grad.item() == pytest.approx(grad), eps_low
        assert out.metrics["loss/clip_frac_low"] == clipped


def test_ratio_log_cap_clips_the_token_log_ratio():
    # π − π_old = 2 with ratio_log_cap = 1: r = e^{1}, no gradient; −0.5 is inside: r = e^{−0.5}.
    lp = torch.tensor([0.0, 0.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-2.0, 0.5], dtype=torch.float64)
    inputs = LossInputs(
        logprobs=[lp],
        old_logprobs=[old],
        sampling_logprobs=[old],
        mask=[torch.ones(2, dtype=torch.float64)],
        advantages=[torch.tensor([-1.0, -1.0], dtype=torch.float64)],
    )
    out = call_loss([make_plugin("loss.grpo", ratio_log_cap=1.0, eps_low=0.9, eps_high=5.0, kl_beta=0.0, agg="token-sum")], inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(math.e + math.exp(-0.5))
    assert lp.grad.tolist() == pytest.approx([0.0, math.exp(-0.5)])
    assert out.metrics["loss/ratio_mean"] == pytest.approx((math.e + math.exp(-0.5)) / 2)
    assert make_plugin("loss.grpo").ratio_log_cap == 20.0
