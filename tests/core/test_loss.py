"""The loss contract: aggregation, split-step equivalence, LossInputs validation, the catalog."""

import math
import random
import re
from pathlib import Path

import attrs
import pytest
import torch

from grpo_core import LossInputs, LossOutput, PluginError, call_loss, make_plugin
from grpo_core.loss import AGGREGATIONS, SUMMED_LOSS_METRICS, aggregate

REPO = Path(__file__).resolve().parents[2]
LOSSES = ["reinforce", "importance_sampling", "grpo", "dapo", "gspo", "cispo", "dro"]
DEFAULTS = {  # as docs/losses.md states them
    "reinforce": {"agg": "seq-mean-token-sum", "kl_beta": 0.0, "kl_estimator": "k3"},
    "importance_sampling": {"clip_rho": None, "ratio_log_cap": 20.0, "agg": "seq-mean-token-sum", "kl_beta": 0.0, "kl_estimator": "k3"},
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "ratio_log_cap": 20.0, "kl_beta": 0.001, "kl_estimator": "k3", "agg": "seq-mean-token-sum"},
    "dapo": {
        "eps_low": 0.2,
        "eps_high": 0.28,
        "ratio_log_cap": 20.0,
        "dual_clip": None,
        "agg": "token-mean",
        "kl_beta": 0.0,
        "kl_estimator": "k3",
    },
    "gspo": {
        "eps_low": 3e-4,
        "eps_high": 4e-4,
        "seq_ratio_log_cap": 20.0,
        "agg": "seq-mean-token-mean",
        "kl_beta": 0.0,
        "kl_estimator": "k3",
    },
    "cispo": {"eps_low": 0.2, "eps_high": 0.28, "ratio_log_cap": 20.0, "agg": "token-mean", "kl_beta": 0.0, "kl_estimator": "k3"},
    "dro": {"beta": 0.05, "agg": "seq-mean-token-sum"},
}
FORMULAS = {  # the per-token term each loss's help (its docstring) states
    "reinforce": "−A·w·log π",
    "importance_sampling": "−A·w·ρ with ρ = π/π_old",
    "grpo": "max(−r·A, −clip(r, 1−eps_low, 1+eps_high)·A)·w + kl_beta·KL(π‖π_ref)",
    "dapo": "max(−r·A, −clip(r, 1−eps_low, 1+eps_high)·A)·w",
    "gspo": "max(−s·A, −clip(s, 1−eps_low, 1+eps_high)·A)·w",
    "cispo": "−sg(clip(r, 1−eps_low, 1+eps_high))·A·w·log π",
    "dro": "−A·w·log π plus a quadratic pull ½·beta·(log π − log π_old)²",
}


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def concrete_inputs(**kw):
    # Sequence 0: 2 of 3 tokens trained; sequence 1: 1 of 2; sequence 2: none (all masked).
    lp = [t([1.0, 2.0, 3.0]), t([4.0, 5.0]), t([7.0, 7.0, 7.0, 7.0])]
    mask = [t([1.0, 1.0, 0.0]), t([1.0, 0.0]), t([0.0, 0.0, 0.0, 0.0])]
    return LossInputs(logprobs=lp, old_logprobs=lp, sampling_logprobs=lp, mask=mask, advantages=lp, **kw)


@pytest.mark.parametrize(
    "agg, expected",
    [
        ("token-sum", 1 + 2 + 4),
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", 7 / 2),  # the all-masked sequence does not count in N
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", 7 / (2 * 4)),
    ],
)
def test_aggregation_on_concrete_numbers(agg, expected):
    padded = concrete_inputs(max_tokens=4).padded()
    assert padded.num_sequences == 2 and padded.num_tokens == 3.0
    assert aggregate(padded.logprobs_B_T, padded, agg).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "agg, expected",
    [
        ("token-sum", 7),
        ("token-mean", 7 / 10),
        ("seq-mean-token-sum", 7 / 5),
        ("seq-mean-token-mean", (1.5 + 4) / 5),
        ("seq-mean-token-sum-norm", 7 / (5 * 8)),
    ],
)
def test_aggregation_uses_the_step_normalizers(agg, expected):
    padded = concrete_inputs(num_sequences=5, num_tokens=10.0, max_tokens=8).padded()
    assert aggregate(padded.logprobs_B_T, padded, agg).item() == pytest.approx(expected)


def test_aggregation_errors():
    padded = concrete_inputs().padded()
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(padded.logprobs_B_T, padded, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown agg"):
        aggregate(padded.logprobs_B_T, padded, "mean")


def test_nothing_trained_gives_zero_for_every_mode():
    lp = [t([1.0, 2.0]).requires_grad_()]
    inputs = LossInputs(
        logprobs=lp,
        old_logprobs=[t([1.0, 2.0])],
        sampling_logprobs=[t([1.0, 2.0])],
        mask=[t([0.0, 0.0])],
        advantages=[t([1.0, 1.0])],
        max_tokens=4,
    )
    for agg in AGGREGATIONS:
        out = call_loss([make_plugin("cispo", agg=agg)], inputs)
        assert out.loss.item() == 0.0
        out.loss.backward()
        assert lp[0].grad.abs().sum().item() == 0.0


# --- split-step equivalence -------------------------------------------------------------------


def random_batch(seed):
    rng = random.Random(seed)
    seqs = []
    for i in range(7):
        n = rng.randint(1, 40)
        p = [rng.uniform(-4.0, -0.05) for _ in range(n)]
        old = [x + rng.gauss(0, 0.4) for x in p]
        mask = [0.0 if (i == 3 or t < rng.randint(0, n // 2)) else 1.0 for t in range(n)]  # seq 3 all masked
        seqs.append(
            {
                "logprobs": p,
                "old": old,
                "sampling": [x + rng.gauss(0, 0.4) for x in old],
                "ref": [x + rng.gauss(0, 0.4) for x in p],
                "mask": mask,
                "adv": [rng.gauss(0, 1)] * n if i % 2 else [rng.gauss(0, 1) for _ in range(n)],
            }
        )
    return seqs


def build(seqs, **kw):
    return LossInputs(
        logprobs=[t(s["logprobs"]).requires_grad_() for s in seqs],
        old_logprobs=[t(s["old"]) for s in seqs],
        sampling_logprobs=[t(s["sampling"]) for s in seqs],
        ref_logprobs=[t(s["ref"]) for s in seqs],
        mask=[t(s["mask"]) for s in seqs],
        advantages=[t(s["adv"]) for s in seqs],
        max_tokens=40,
        **kw,
    )


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_split_step_gives_the_gradient_of_one_call(name, agg):
    seqs = random_batch(0)
    plugins = [make_plugin(name, kind="loss", agg=agg), make_plugin("tis")]
    whole = build(seqs)
    out = call_loss(plugins, whole)
    out.loss.backward()

    num_sequences = sum(1 for s in seqs if sum(s["mask"]) > 0)
    num_tokens = sum(sum(s["mask"]) for s in seqs)
    halves = [
        build(seqs[:4], num_sequences=num_sequences, num_tokens=num_tokens),
        build(seqs[4:], num_sequences=num_sequences, num_tokens=num_tokens),
    ]
    total = 0.0
    parts = []
    for half in halves:
        part = call_loss(plugins, half)
        part.loss.backward()
        total += part.loss.item()
        parts.append(part.metrics)
    split_grads = [x.grad for half in halves for x in half.logprobs]
    assert total == pytest.approx(out.loss.item(), abs=1e-10)
    for a, b in zip(whole.logprobs, split_grads):
        torch.testing.assert_close(b, a.grad, atol=1e-12, rtol=0)
    # Every metric of the step: shares add up, means combine weighted by trained tokens.
    assert set(parts[0]) == set(parts[1]) == set(out.metrics)
    assert combine_metrics(parts) == pytest.approx(out.metrics, rel=1e-9, abs=1e-12)


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from its calls' metrics (the rule docs/losses.md states)."""
    tokens = [p["loss/active_tokens"] for p in parts]
    return {
        key: sum(p[key] for p in parts)
        if key in SUMMED_LOSS_METRICS
        else sum(p[key] * n for p, n in zip(parts, tokens)) / max(sum(tokens), 1.0)
        for key in parts[0]
    }


def test_splitting_by_sequences_instead_of_tokens_would_change_the_means():
    # The halves hold different token counts: weighting their means by sequence count is wrong.
    seqs = random_batch(0)
    plugins = [make_plugin("cispo"), make_plugin("tis")]
    whole = call_loss(plugins, build(seqs)).metrics
    parts = [call_loss(plugins, build(seqs[:4])).metrics, call_loss(plugins, build(seqs[4:])).metrics]
    by_sequences = (parts[0]["loss/ratio_mean"] * 4 + parts[1]["loss/ratio_mean"] * 3) / 7
    assert by_sequences != pytest.approx(whole["loss/ratio_mean"], rel=1e-6)
    assert combine_metrics(parts)["loss/ratio_mean"] == pytest.approx(whole["loss/ratio_mean"], rel=1e-12)


def test_a_half_without_normalizers_differs():
    # The reason the normalizers must be the step's: per-call normalizing changes the gradient.
    seqs = random_batch(1)
    loss = make_plugin("cispo", agg="token-mean")
    whole = build(seqs)
    call_loss([loss], whole).loss.backward()
    half = build(seqs[:4])
    call_loss([loss], half).loss.backward()
    assert not torch.allclose(half.logprobs[0].grad, whole.logprobs[0].grad)


# --- LossInputs validation and call_loss --------------------------------------------------------


def test_loss_inputs_checks_sequence_counts_and_shapes():
    lp = [t([1.0, 2.0]), t([3.0])]
    ok = dict(logprobs=lp, old_logprobs=lp, sampling_logprobs=lp, mask=lp, advantages=lp)
    LossInputs(**ok)
    with pytest.raises(ValueError, match="advantages has 1 sequences"):
        LossInputs(**{**ok, "advantages": lp[:1]})
    with pytest.raises(ValueError, match=r"mask\[1\] has shape"):
        LossInputs(**{**ok, "mask": [t([1.0, 1.0]), t([1.0, 1.0])]})
    with pytest.raises(ValueError, match="ref_logprobs"):
        LossInputs(**ok, ref_logprobs=[t([1.0, 2.0])])
    with pytest.raises(ValueError, match="tis_weights"):
        LossInputs(**ok, tis_weights=[t([1.0]), t([1.0])])


def test_call_loss_needs_a_loss_plugin():
    with pytest.raises(ValueError, match="no loss plugin"):
        call_loss([], concrete_inputs())


def test_call_loss_returns_a_scalar_and_namespaced_metrics():
    out = call_loss([make_plugin("loss.grpo", kl_beta=0.0)], build(random_batch(2)))
    assert isinstance(out, LossOutput) and out.loss.dim() == 0
    assert set(out.metrics) == {
        "loss/policy",
        "loss/ratio_mean",
        "loss/active_tokens",
        "loss/clip_frac_low",
        "loss/clip_frac_high",
        "kl/mean",
        "kl/policy_old",
    }
    assert all(isinstance(v, float) for v in out.metrics.values())


# --- the KL metrics every loss reports -----------------------------------------------------------


@pytest.mark.parametrize("name", LOSSES)
def test_kl_metrics_are_k3_estimates_over_trained_tokens(name):
    # Trained tokens: π − π_ref = 0.5 and −1; π − π_old = 0.2 and 0.3 (the masked token's huge
    # differences must not count).
    lp = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, 900.0], dtype=torch.float64)
    old = torch.tensor([-1.2, -2.3, -900.0], dtype=torch.float64)
    inputs = LossInputs(
        logprobs=[lp],
        old_logprobs=[old],
        sampling_logprobs=[old],
        ref_logprobs=[ref],
        mask=[torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)],
        advantages=[torch.ones(3, dtype=torch.float64)],
    )
    out = call_loss([make_plugin(name, kind="loss")], inputs)
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731  exp(x) − x − 1 with x = log q − log p
    assert out.metrics["kl/mean"] == pytest.approx((k3(-0.5) + k3(1.0)) / 2)
    assert out.metrics["kl/policy_old"] == pytest.approx((k3(0.2) + k3(0.3)) / 2)
    # Without reference logprobs there is no kl/mean (a loss with kl_beta = 0 needs none).
    inputs.ref_logprobs = None
    options = {} if name == "dro" else {"kl_beta": 0.0}
    out = call_loss([make_plugin(name, kind="loss", **options)], inputs)
    assert "kl/mean" not in out.metrics and out.metrics["kl/policy_old"] == pytest.approx((k3(0.2) + k3(0.3)) / 2)


def test_kl_metrics_are_zero_on_policy_and_with_nothing_trained():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logprobs=[lp],
        old_logprobs=[lp.detach()],
        sampling_logprobs=[lp.detach()],
        ref_logprobs=[lp.detach()],
        mask=[torch.ones(2, dtype=torch.float64)],
        advantages=[torch.ones(2, dtype=torch.float64)],
    )
    out = call_loss([make_plugin("loss.grpo")], inputs)
    assert out.metrics["kl/mean"] == 0.0 and out.metrics["kl/policy_old"] == 0.0
    inputs.mask = [torch.zeros(2, dtype=torch.float64)]
    inputs.old_logprobs = [lp.detach() - 5.0]
    out = call_loss([make_plugin("loss.grpo")], inputs)
    assert out.metrics["kl/mean"] == 0.0 and out.metrics["kl/policy_old"] == 0.0


# --- eps_low: no upper limit --------------------------------------------------------------------

EPS_LOW_LOSSES = [name for name in LOSSES if "eps_low" in DEFAULTS[name]]


@pytest.mark.parametrize("name", EPS_LOW_LOSSES)
def test_every_loss_with_eps_low_accepts_one_and_more_and_then_never_clips_low(name):
    # eps_low ≥ 1: 1 − eps_low ≤ 0, below every ratio; only eps_low < 0 is refused.
    assert make_plugin(name, kind="loss", eps_low="1.0").eps_low == 1.0
    with pytest.raises(PluginError, match="eps_low must be >= 0"):
        make_plugin(name, kind="loss", eps_low=-0.01)
    seqs = random_batch(3)
    for s in seqs:  # every ratio far below 1 - 0.2, every advantage negative: the lower clip's case
        s["old"] = [x + 2.5 for x in s["logprobs"]]
        s["adv"] = [-abs(a) - 0.1 for a in s["adv"]]
    low = call_loss([make_plugin(name, kind="loss", eps_low=0.2, kl_beta=0.0)], build(seqs))
    assert low.metrics["loss/clip_frac_low"] > 0.9
    for eps_low in (1.0, 3.0):
        inputs = build(seqs)
        off = call_loss([make_plugin(name, kind="loss", eps_low=eps_low, kl_beta=0.0)], inputs)
        assert off.metrics["loss/clip_frac_low"] == 0.0
        assert off.loss.item() != pytest.approx(low.loss.item())
        off.loss.backward()
        for x, m in zip(inputs.logprobs, inputs.mask):  # every trained token keeps its gradient
            assert bool((x.grad[m > 0] != 0).all())


# --- the built-in losses in the catalog ---------------------------------------------------------


@pytest.mark.parametrize("name", LOSSES)
def test_builtin_losses_have_the_documented_options_and_defaults(name):
    loss = make_plugin(name, kind="loss")
    assert {f.name: getattr(loss, f.name) for f in attrs.fields(type(loss))} == DEFAULTS[name]
    assert loss.needs_reference is (name == "grpo")  # only grpo turns its KL term on by default
    if "kl_beta" in DEFAULTS[name]:
        assert make_plugin(name, kind="loss", kl_beta=0.01).needs_reference is True
        assert make_plugin(name, kind="loss", kl_beta=0.0).needs_reference is False
    # The help `grpo-core plugins` shows is the docstring: it states the per-token term.
    assert FORMULAS[name] in type(loss).__doc__


@pytest.mark.parametrize("name", LOSSES)
def test_docs_losses_md_documents_every_option_with_its_default(name):
    text = (REPO / "docs" / "losses.md").read_text()
    section = re.search(rf"^## `{name}`\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, f"docs/losses.md has no section for {name}"
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", section.group(1), re.M))
    assert set(rows) == set(DEFAULTS[name]), sorted(set(rows) ^ set(DEFAULTS[name]))
    for option, default in DEFAULTS[name].items():
        written = rows[option].strip()
        assert (float(written) == default) if isinstance(default, float) else (written == str(default)), (option, written)
    assert "SPEC-losses" not in text and "shared/" not in text


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("options", [{"agg": "x"}, {"eps_low": "abc"}, {"unknown_option": 1}], ids=["agg", "type", "unknown"])
def test_bad_options_raise_plugin_error(name, options):
    if "eps_low" in options and "eps_low" not in DEFAULTS[name]:
        options = {"kl_beta": "abc"} if name != "dro" else {"beta": "abc"}
    with pytest.raises(PluginError):
        make_plugin(name, kind="loss", **options)


# --- docs/coming-from-cookbook.md: the cookbook's recipe as a grpo-core config -----------------


def test_cookbook_guide_toml_reproduces_the_cookbook_loss(monkeypatch, capsys):
    from grpo_core.config import load

    guide = (REPO / "docs" / "coming-from-cookbook.md").read_text()
    block = re.search(r"## Check it yourself.*?```python\n(.*?)```", guide, re.S).group(1)
    stated = float(re.search(r"It prints `(-?\d+\.\d+)`", guide).group(1))
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    exec(compile(block, "coming-from-cookbook.md", "exec"), namespace)
    config, inputs, out = namespace["config"], namespace["inputs"], namespace["out"]
    assert capsys.readouterr().out.strip() == f"{stated:.6f}"

    # The cookbook's convention: GRPO + TIS capped at 5, raw token-sum, k3 KL with beta 0.001.
    assert config.loss == ["grpo", "tis"]
    assert config.options_for("loss", "grpo")["agg"] == "token-sum" and config.options_for("loss", "tis")["cap"] == 5.0
    assert config.grad_clip_norm == 0.0 and config.weight_sync_interval == 1
    # ... and the cookbook's loss, written out token by token.
    expected = 0.0
    for lp, old, s, ref, m, adv in zip(
        [x.detach() for x in inputs.logprobs],
        inputs.old_logprobs,
        inputs.sampling_logprobs,
        inputs.ref_logprobs,
        inputs.mask,
        inputs.advantages,
    ):
        for t in range(len(lp)):
            if m[t] == 0:
                continue
            r = math.exp(float(lp[t] - old[t]))
            surrogate = max(-r * float(adv[t]), -min(max(r, 0.8), 1.2) * float(adv[t]))
            x = float(ref[t] - lp[t])
            expected += surrogate * min(math.exp(float(old[t] - s[t])), 5.0) + 0.001 * (math.exp(x) - x - 1)
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.loss.item() == pytest.approx(stated, abs=5e-7)
    assert out.metrics["tis/clip_frac"] == pytest.approx(0.2) and out.metrics["loss/clip_frac_high"] == pytest.approx(0.2)

    # The CLI form the guide gives selects the same losses with the same options.
    cli = load(None, {"loss": ["grpo", "tis"]}, {"loss": ["grpo.agg=token-sum", "tis.cap=5"]})
    assert cli.loss == ["grpo", "tis"]
    grpo, tis = (make_plugin(name, kind="loss", **cli.options_for("loss", name)) for name in cli.loss)
    assert (grpo.agg, grpo.kl_beta, grpo.kl_estimator, grpo.eps_low, grpo.eps_high, tis.cap) == ("token-sum", 0.001, "k3", 0.2, 0.2, 5.0)
