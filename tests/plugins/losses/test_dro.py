import pytest
import torch

from grpo_core import LossInputs, call_loss, make_plugin

from .reference import AGGS, TIS_MODES, check_all_scenarios, make_inputs, scenario


@pytest.mark.parametrize("tis", list(TIS_MODES))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("options", [{}, {"beta": 0.5}], ids=["default", "beta_0.5"])
def test_matches_reference(options, agg, tis):
    check_all_scenarios("dro", options, agg, tis)


def test_concrete_value_and_gradient():
    # −A·π + ½β(π − π_old)², β = 0.5: token 0: −1·(−1) + 0.25·1 ; token 1: −1·(−2) + 0
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logprobs=[lp],
        old_logprobs=[torch.tensor([-2.0, -2.0], dtype=torch.float64)],
        sampling_logprobs=[torch.tensor([-2.0, -2.0], dtype=torch.float64)],
        mask=[torch.ones(2, dtype=torch.float64)],
        advantages=[torch.ones(2, dtype=torch.float64)],
    )
    out = call_loss([make_plugin("dro", beta=0.5)], inputs)
    assert out.loss.item() == pytest.approx(1.25 + 2.0)
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1.0 + 0.5, -1.0])
    assert out.metrics["loss/policy"] == pytest.approx(3.0)
    assert out.metrics["loss/dro_penalty"] == pytest.approx(0.125)


def test_tis_never_weights_the_quadratic_term():
    seqs = [dict(s, adv=[0.0] * len(s["adv"])) for s in scenario("far")]
    loss = make_plugin("dro")
    plain = call_loss([loss], make_inputs(seqs)).loss.item()
    weighted = call_loss([loss, make_plugin("tis")], make_inputs(seqs)).loss.item()
    assert plain > 0 and weighted == pytest.approx(plain, abs=1e-12)


def test_needs_no_reference():
    assert make_plugin("dro").needs_reference is False
    call_loss([make_plugin("dro")], make_inputs(scenario("mixed"), with_ref=False))
