import math

import pytest
import torch

from grpo_core import LossInputs, call_loss, make_plugin

from .reference import AGGS, TIS_MODES, check_all_scenarios


@pytest.mark.parametrize("tis", list(TIS_MODES))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "options",
    [{}, {"eps_low": 0.2, "eps_high": 0.2}, {"seq_ratio_log_cap": 0.05}, {"eps_low": 1.0, "eps_high": 0.2}],
    ids=["default", "wide_clip", "seq_ratio_log_cap", "no_lower_clip"],
)
def test_matches_reference(options, agg, tis):
    check_all_scenarios("gspo", options, agg, tis)


def _single(old, adv, mask):
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    return LossInputs(
        logprobs=[lp],
        old_logprobs=[torch.tensor(old, dtype=torch.float64)],
        sampling_logprobs=[torch.tensor(old, dtype=torch.float64)],
        mask=[torch.tensor(mask, dtype=torch.float64)],
        advantages=[torch.tensor(adv, dtype=torch.float64)],
    )


def test_token_form_has_sequence_value_and_per_token_gradient():
    # Trained tokens 0..2 (token 3 is masked); log s = mean(π − π_old) over them = 0.1.
    old = [-1.2, -2.0, -0.6, 5.0]
    adv = [1.0, -2.0, 0.5, 7.0]
    mask = [1.0, 1.0, 1.0, 0.0]
    s = math.exp((0.2 + 0.0 + 0.1) / 3)
    inputs = _single(old, adv, mask)
    out = call_loss([make_plugin("gspo", eps_low=0.5, eps_high=0.5, agg="token-sum")], inputs)
    # value: every token sees the sequence ratio s (not its own ratio)
    assert out.loss.item() == pytest.approx(-s * (1.0 - 2.0 + 0.5))
    assert out.metrics["loss/ratio_mean"] == pytest.approx(s)
    out.loss.backward()
    # gradient: s_i·∇π_t per token, i.e. −A_t·s (a sequence-level ratio would give −mean(A)·s)
    assert inputs.logprobs[0].grad.tolist() == pytest.approx([-1.0 * s, 2.0 * s, -0.5 * s, 0.0])


def test_clip_acts_on_the_sequence_ratio():
    # log s = 0.3/4 > log(1 + 4e-4): every token with A > 0 is clipped (no gradient), even a
    # token whose own ratio is 1; tokens with A < 0 keep the unclipped −s·A.
    inputs = _single([-1.2, -2.0, -0.6, -3.0], [1.0, 1.0, -1.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    s = math.exp((0.2 + 0.0 + 0.1 + 0.0) / 4)
    out = call_loss([make_plugin("gspo", agg="token-sum")], inputs)
    assert out.loss.item() == pytest.approx(-3 * 1.0004 + s)
    out.loss.backward()
    assert inputs.logprobs[0].grad.tolist() == pytest.approx([0.0, 0.0, s, 0.0])
    assert out.metrics["loss/clip_frac_high"] == pytest.approx(0.75)


def test_defaults_follow_the_spec():
    loss = make_plugin("gspo")
    assert (loss.eps_low, loss.eps_high, loss.agg, loss.seq_ratio_log_cap) == (3e-4, 4e-4, "seq-mean-token-mean", 20.0)
    assert not hasattr(loss, "ratio_log_cap")  # GSPO clips the sequence ratio, never a token ratio
    assert loss.needs_reference is False


def test_seq_ratio_log_cap_clips_the_sequence_log_ratio():
    # log s = mean(π − π_old) = 0.1 over 3 tokens, capped at 0.05: s = e^{0.05} for every token,
    # with its gradient s·∇π_t (GSPO's token form keeps the gradient under the cap).
    inputs = _single([-1.2, -2.0, -0.6, 5.0], [1.0, -2.0, 0.5, 7.0], [1.0, 1.0, 1.0, 0.0])
    s = math.exp(0.05)
    out = call_loss([make_plugin("gspo", eps_low=0.5, eps_high=0.5, seq_ratio_log_cap=0.05, agg="token-sum")], inputs)
    assert out.loss.item() == pytest.approx(-s * (1.0 - 2.0 + 0.5))
    assert out.metrics["loss/ratio_mean"] == pytest.approx(s)
