import math

import pytest
import torch

from grpo_core import LossInputs, PluginError, call_loss, make_plugin

from .reference import AGGS, TIS_MODES, check_all_scenarios


@pytest.mark.parametrize("tis", list(TIS_MODES))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "options",
    [{}, {"dual_clip": 3.0}, {"ratio_log_cap": 0.5}, {"eps_low": 1.5, "dual_clip": 2.0}],
    ids=["default", "dual_clip", "ratio_log_cap", "no_lower_clip"],
)
def test_matches_reference(options, agg, tis):
    check_all_scenarios("dapo", options, agg, tis)


def _run(dual_clip):
    # log r = 2 (r ≈ 7.39 > c = 3) and log r = −2 (r ≈ 0.135), each with A = +1 and A = −1.
    lp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logprobs=[lp],
        old_logprobs=[torch.tensor([-2.0, -2.0, 2.0, 2.0], dtype=torch.float64)],
        sampling_logprobs=[torch.zeros(4, dtype=torch.float64)],
        mask=[torch.ones(4, dtype=torch.float64)],
        advantages=[torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)],
    )
    out = call_loss([make_plugin("dapo", dual_clip=dual_clip, agg="token-sum")], inputs)
    out.loss.backward()
    return out, lp.grad.tolist()


def test_dual_clip_binds_only_for_negative_advantages():
    r_hi, r_lo = math.exp(2), math.exp(-2)
    plain, plain_grad = _run(None)
    dual, dual_grad = _run(3.0)
    # without dual clip: [−1.28 (clipped high), r_hi (unbounded), −r_lo, 0.8 (clipped low)]
    assert plain.loss.item() == pytest.approx(-1.28 + r_hi - r_lo + 0.8)
    assert plain_grad == pytest.approx([0.0, r_hi, -r_lo, 0.0])
    # with c = 3 only the A < 0, r > 3 token changes: capped at −c·A = 3, no gradient there.
    # A > 0 with a small ratio keeps −r·A (a dual clip there would have given −3).
    assert dual.loss.item() == pytest.approx(-1.28 + 3.0 - r_lo + 0.8)
    assert dual_grad == pytest.approx([0.0, 0.0, -r_lo, 0.0])
    assert dual.metrics["loss/clip_frac_dual"] == pytest.approx(0.25)


def test_defaults_follow_the_spec():
    loss = make_plugin("dapo")
    assert (loss.eps_low, loss.eps_high, loss.dual_clip, loss.agg, loss.ratio_log_cap) == (0.2, 0.28, None, "token-mean", 20.0)
    assert loss.needs_reference is False


@pytest.mark.parametrize("value", [1.0, 0.5, "abc"])
def test_dual_clip_must_exceed_one(value):
    with pytest.raises(PluginError):
        make_plugin("dapo", dual_clip=value)
