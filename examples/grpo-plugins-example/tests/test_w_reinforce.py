import math

import pytest
import torch

from grpo_core import LossInputs, PluginError, call_loss, make_plugin
from grpo_core.loss import AGGREGATIONS

# Two sequences of different lengths, advantages of both signs, the last token of each
# sequence masked out; π differs from π_old, so the ratio is not 1.
LOGPROBS = [[-0.5, -1.0, -2.0, -0.1], [-0.3, -0.7, -1.5]]
OLD = [[-0.6, -0.9, -2.0, -0.4], [-0.3, -1.0, -1.2]]
ADVANTAGES = [[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
REF = [[-0.5, -1.2, -1.8, -0.1], [-0.4, -0.7, -1.4]]


def inputs(advantages=ADVANTAGES, with_ref: bool = False) -> LossInputs:
    t = lambda rows: [torch.tensor(r, dtype=torch.float64) for r in rows]  # noqa: E731
    return LossInputs(
        logprobs=[x.requires_grad_() for x in t(LOGPROBS)],
        old_logprobs=t(OLD),
        sampling_logprobs=t(OLD),
        mask=t(MASK),
        advantages=t(advantages),
        ref_logprobs=t(REF) if with_ref else None,
        max_tokens=4,
    )


def by_hand(positive_weight: float) -> tuple[float, list[list[float]]]:
    """token-mean of −λ_t·A_t·r_t over trained tokens, and its gradient in π."""
    n = sum(sum(m) for m in MASK)
    value, grads = 0.0, []
    for lp, old, adv, mask in zip(LOGPROBS, OLD, ADVANTAGES, MASK):
        row = []
        for p, o, a, m in zip(lp, old, adv, mask):
            lam = positive_weight if a > 0 else 1.0
            term = -lam * a * math.exp(p - o)  # d/dπ of r = r
            value += m * term / n
            row.append(m * term / n)
        grads.append(row)
    return value, grads


@pytest.mark.parametrize("positive_weight", [0.1, 0.0, 1.0, 2.5])
def test_value_and_gradient_match_the_formula(positive_weight):
    x = inputs()
    out = call_loss([make_plugin("w_reinforce", positive_weight=positive_weight)], x)
    out.loss.backward()
    value, grads = by_hand(positive_weight)
    assert out.loss.item() == pytest.approx(value, rel=1e-12)
    for lp, expected in zip(x.logprobs, grads):
        torch.testing.assert_close(lp.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_zero_positive_weight_trains_only_on_negative_advantages():
    x = inputs()
    call_loss([make_plugin("w_reinforce", positive_weight=0.0)], x).loss.backward()
    assert torch.count_nonzero(x.logprobs[0].grad) == 0  # every token of sequence 0 has A > 0
    assert torch.count_nonzero(x.logprobs[1].grad) == 2  # its two trained tokens, A < 0


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("tis", [False, True])
@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
def test_weight_one_is_importance_sampling(agg, tis, kl_beta):
    wrappers = [make_plugin("tis", cap=1.2)] if tis else []
    ours = call_loss([make_plugin("w_reinforce", positive_weight=1.0, agg=agg, kl_beta=kl_beta), *wrappers], inputs(with_ref=True))
    theirs = call_loss([make_plugin("importance_sampling", agg=agg, kl_beta=kl_beta), *wrappers], inputs(with_ref=True))
    assert ours.loss.item() == pytest.approx(theirs.loss.item(), rel=1e-12)
    for key in ("loss/policy", "loss/active_tokens", "loss/ratio_mean"):
        assert ours.metrics[key] == pytest.approx(theirs.metrics[key], rel=1e-12), key


def test_agg_option_is_used():
    token_sum = call_loss([make_plugin("w_reinforce", agg="token-sum")], inputs()).loss.item()
    token_mean = call_loss([make_plugin("w_reinforce")], inputs()).loss.item()
    assert token_sum == pytest.approx(token_mean * 5)  # 5 trained tokens


def test_kl_penalty_is_added_and_needs_a_reference():
    plain = call_loss([make_plugin("w_reinforce")], inputs(with_ref=True))
    with_kl = call_loss([make_plugin("w_reinforce", kl_beta=0.5, kl_estimator="k1")], inputs(with_ref=True))
    # k1 = π − π_ref on the trained tokens, token-mean over 5 tokens
    kl = (0.0 + 0.2 - 0.2 + 0.1 + 0.0) / 5
    assert with_kl.metrics["loss/kl"] == pytest.approx(kl)
    assert with_kl.loss.item() == pytest.approx(plain.loss.item() + 0.5 * kl)
    assert make_plugin("w_reinforce", kl_beta=0.5).needs_reference is True
    assert make_plugin("w_reinforce").needs_reference is False
    with pytest.raises(ValueError, match="ref_logprobs is None"):
        call_loss([make_plugin("w_reinforce", kl_beta=0.5)], inputs())


def test_positive_frac_counts_trained_tokens_with_positive_advantage():
    out = call_loss([make_plugin("w_reinforce")], inputs())
    assert out.metrics["loss/positive_frac"] == pytest.approx(3 / 5)
    zero = call_loss([make_plugin("w_reinforce")], inputs(advantages=[[0.0] * 4, [-1.0] * 3]))
    assert zero.metrics["loss/positive_frac"] == 0.0  # A = 0 is not positive
    # only sequence 1 (A = −1, weight 1) contributes: r = e^0 and e^0.3 on its trained tokens
    assert zero.loss.item() == pytest.approx((1.0 + math.exp(0.3)) / 5)


def test_tis_weights_only_the_policy_term():
    # π_old − π_s = 0.5 on every token: w = min(e^0.5, 1.2) = 1.2
    x = inputs(with_ref=True)
    x.sampling_logprobs = [o - 0.5 for o in x.old_logprobs]
    plain = call_loss([make_plugin("w_reinforce", kl_beta=0.5)], inputs(with_ref=True))
    wrapped = call_loss([make_plugin("w_reinforce", kl_beta=0.5), make_plugin("tis", cap=1.2)], x)
    assert wrapped.metrics["loss/policy"] == pytest.approx(1.2 * plain.metrics["loss/policy"])
    assert wrapped.metrics["loss/kl"] == pytest.approx(plain.metrics["loss/kl"])


def test_defaults():
    loss = make_plugin("loss.w_reinforce")
    assert (loss.positive_weight, loss.agg, loss.kl_beta) == (0.1, "token-mean", 0.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"positive_weight": -0.1}, "positive_weight must be >= 0"), ({"agg": "mean"}, "agg must be one of")],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("w_reinforce", **options)
