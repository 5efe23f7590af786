import math

import attrs
import pytest
import torch

from grpo_core import LossInputs, LossOutput, PluginError, call_loss, hookimpl, make_plugin

from .reference import SCENARIOS, assert_matches_reference, make_inputs, scenario


@attrs.define
class Spy:
    """A loss that records the TIS weights it sees and returns Σ π (so w is observable)."""

    seen: list = attrs.field(factory=list)

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        self.seen.append(None if inputs.tis_weights is None else [w.clone() for w in inputs.tis_weights])
        return LossOutput(loss=sum(x.sum() for x in inputs.logprobs), metrics={"loss/policy": 0.0})


def _inputs(delta, mask):
    """One sequence with π_old − π_s = delta."""
    n = len(delta)
    old = torch.full((n,), -1.0, dtype=torch.float64)
    return LossInputs(
        logprobs=[torch.zeros(n, dtype=torch.float64, requires_grad=True)],
        old_logprobs=[old],
        sampling_logprobs=[old - torch.tensor(delta, dtype=torch.float64)],
        mask=[torch.tensor(mask, dtype=torch.float64)],
        advantages=[torch.ones(n, dtype=torch.float64)],
    )


def _weights(tis, inputs):
    spy = Spy()
    out = call_loss([spy, tis], inputs)
    return spy.seen[0][0].tolist(), out.metrics


def test_token_level_weights_and_metrics():
    delta = [0.0, math.log(1.5), math.log(3.0), -1.0, 5.0]
    w, metrics = _weights(make_plugin("tis", cap=2.0), _inputs(delta, [1, 1, 1, 1, 0]))
    assert w == pytest.approx([1.0, 1.5, 2.0, math.exp(-1.0), 1.0])  # the masked token gets 1
    assert metrics["tis/weight_mean"] == pytest.approx((1.0 + 1.5 + 2.0 + math.exp(-1.0)) / 4)
    assert metrics["tis/clip_frac"] == pytest.approx(0.25)


def test_token_level_log_ratio_is_clamped_at_20():
    w, _ = _weights(make_plugin("tis", cap=1e12), _inputs([30.0, -30.0], [1, 1]))
    assert w == pytest.approx([math.exp(20), math.exp(-20)])


def test_sequence_level_uses_the_masked_mean_log_ratio():
    delta = [0.2, 0.4, 9.0, 0.0]
    w, metrics = _weights(make_plugin("tis", level="sequence", cap=2.0), _inputs(delta, [1, 1, 0, 1]))
    assert w == pytest.approx([math.exp(0.2), math.exp(0.2), 1.0, math.exp(0.2)])  # untrained: 1
    assert metrics["tis/clip_frac"] == 0.0
    w, metrics = _weights(make_plugin("tis", level="sequence", cap=1.1), _inputs(delta, [1, 1, 0, 1]))
    assert w == pytest.approx([1.1, 1.1, 1.0, 1.1])
    assert metrics["tis/clip_frac"] == 1.0 and metrics["tis/weight_mean"] == pytest.approx(1.1)


def test_all_masked_sequence_gets_finite_weights():
    for level in ("token", "sequence"):
        w, metrics = _weights(make_plugin("tis", level=level), _inputs([800.0, -800.0], [0, 0]))
        assert w == [1.0, 1.0]
        assert metrics["tis/weight_mean"] == 0.0 and metrics["tis/clip_frac"] == 0.0


def test_icepop_zeroes_tokens_outside_the_band():
    # ratios 1, 1.5, 3 (outside [1/2, 2]), 1/3 (outside), 0.6 (inside)
    delta = [0.0, math.log(1.5), math.log(3.0), -math.log(3.0), math.log(0.6)]
    w, metrics = _weights(make_plugin("tis", cap=1.2, icepop=2.0), _inputs(delta, [1, 1, 1, 1, 1]))
    assert w == pytest.approx([1.0, 1.2, 0.0, 0.0, 0.6])
    assert metrics["tis/icepop_frac"] == pytest.approx(0.4)
    assert metrics["tis/clip_frac"] == pytest.approx(0.4)  # 1.5 and 3 exceed the cap
    assert metrics["tis/weight_mean"] == pytest.approx(2.8 / 5)


def test_weights_carry_no_gradient():
    inputs = make_inputs(scenario("far"))
    for x in inputs.old_logprobs + inputs.sampling_logprobs:
        x.requires_grad_()
    out = call_loss([make_plugin("cispo"), make_plugin("tis")], inputs)
    out.loss.backward()
    assert all(x.grad is None for x in inputs.sampling_logprobs)
    assert all(x.grad is None for x in inputs.old_logprobs)  # CISPO's ratio is stop-gradient too
    assert all(x.grad is not None for x in inputs.logprobs)


def test_inputs_are_restored_after_the_call():
    inputs = make_inputs(scenario("mixed"))
    spy = Spy()
    call_loss([make_plugin("tis"), spy], inputs)
    assert spy.seen[0] is not None and len(spy.seen[0]) == len(inputs.logprobs)
    assert [w.shape for w in spy.seen[0]] == [x.shape for x in inputs.logprobs]
    assert all(not w.requires_grad for w in spy.seen[0])
    assert inputs.tis_weights is None


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_registration_order_does_not_matter(level):
    seqs = scenario("far")
    a = call_loss([make_plugin("tis", level=level), make_plugin("dapo")], make_inputs(seqs))
    b = call_loss([make_plugin("dapo"), make_plugin("tis", level=level)], make_inputs(seqs))
    assert a.loss.item() == b.loss.item() and a.metrics == b.metrics


def test_every_scenario_with_sequence_level_and_grpo():
    plugins = [make_plugin("loss.grpo"), make_plugin("tis", level="sequence", cap=3.0)]
    for s in SCENARIOS:
        assert_matches_reference("grpo", scenario(s), {}, {"level": "sequence", "cap": 3.0}, plugins=plugins)


def test_tis_alone_is_not_a_loss():
    with pytest.raises(ValueError, match="no loss plugin"):
        call_loss([make_plugin("tis")], make_inputs(scenario("single")))


@pytest.mark.parametrize(
    "options",
    [{"cap": 0.0}, {"cap": "abc"}, {"level": "batch"}, {"icepop": 0.5}, {"icepop": 2.0, "level": "sequence"}, {"caps": 2.0}],
)
def test_bad_options_raise_plugin_error(options):
    with pytest.raises(PluginError):
        make_plugin("tis", **options)


def test_defaults_follow_the_spec():
    tis = make_plugin("tis")
    assert (tis.cap, tis.level, tis.icepop) == (2.0, "token", None)
    assert tis.needs_reference is False
