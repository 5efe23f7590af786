import pytest
import torch

from grpo_core import LossInputs, call_loss, make_plugin

from .reference import AGGS, TIS_MODES, check_all_scenarios, make_inputs, scenario


@pytest.mark.parametrize("tis", list(TIS_MODES))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("options", [{}, {"kl_beta": 0.05, "kl_estimator": "k2"}], ids=["default", "kl_k2"])
def test_matches_reference(options, agg, tis):
    check_all_scenarios("reinforce", options, agg, tis)


def test_concrete_value_and_gradient():
    # −A·π summed over trained tokens, averaged over the 2 trained sequences.
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-0.5], requires_grad=True)]
    inputs = LossInputs(
        logprobs=lp,
        old_logprobs=[x.detach() for x in lp],
        sampling_logprobs=[x.detach() for x in lp],
        mask=[torch.tensor([1.0, 1.0]), torch.tensor([1.0])],
        advantages=[torch.tensor([1.0, 1.0]), torch.tensor([-2.0])],
    )
    out = call_loss([make_plugin("reinforce")], inputs)
    assert out.loss.item() == pytest.approx(((1 + 2) + (-1.0)) / 2)
    out.loss.backward()
    assert lp[0].grad.tolist() == pytest.approx([-0.5, -0.5])
    assert lp[1].grad.tolist() == pytest.approx([1.0])
    assert out.metrics["loss/active_tokens"] == 3.0
    assert out.metrics["loss/ratio_mean"] == pytest.approx(1.0)
    assert "loss/kl" not in out.metrics


def test_needs_reference_follows_kl_beta():
    assert make_plugin("reinforce").needs_reference is False
    assert make_plugin("reinforce", kl_beta=0.1).needs_reference is True


def test_kl_without_reference_is_a_clear_error():
    with pytest.raises(ValueError, match="ref_logprobs"):
        call_loss([make_plugin("reinforce", kl_beta=0.1)], make_inputs(scenario("mixed"), with_ref=False))
