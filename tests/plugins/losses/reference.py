"""A deliberately simple reference for the formulas of docs/losses.md, independent of the plugin code.

Plain Python floats (float64), one loop over sequences and one over tokens, and the
gradient with respect to every logprob written out by hand from the spec's formulas (no
autograd, no torch, nothing from grpo_core), and every metric a loss reports. Tests compare
the plugins' values, autograd gradients and metrics to these numbers.

A sequence is a dict of equal-length lists of floats: ``logprobs`` (π), ``old`` (π_old),
``sampling`` (π_s), ``ref`` (π_ref, optional), ``mask`` (m) and ``adv`` (A).
"""

from __future__ import annotations

import functools
import math

CLAMP = 20.0

DEFAULTS = {
    "reinforce": {"agg": "seq-mean-token-sum", "kl_beta": 0.0, "kl_estimator": "k3"},
    "importance_sampling": {"agg": "seq-mean-token-sum", "clip_rho": None, "ratio_log_cap": 20.0, "kl_beta": 0.0, "kl_estimator": "k3"},
    "grpo": {"agg": "seq-mean-token-sum", "eps_low": 0.2, "eps_high": 0.2, "ratio_log_cap": 20.0, "kl_beta": 0.001, "kl_estimator": "k3"},
    "dapo": {
        "agg": "token-mean",
        "eps_low": 0.2,
        "eps_high": 0.28,
        "ratio_log_cap": 20.0,
        "dual_clip": None,
        "kl_beta": 0.0,
        "kl_estimator": "k3",
    },
    "gspo": {
        "agg": "seq-mean-token-mean",
        "eps_low": 3e-4,
        "eps_high": 4e-4,
        "seq_ratio_log_cap": 20.0,
        "kl_beta": 0.0,
        "kl_estimator": "k3",
    },
    "cispo": {"agg": "token-mean", "eps_low": 0.2, "eps_high": 0.28, "ratio_log_cap": 20.0, "kl_beta": 0.0, "kl_estimator": "k3"},
    "dro": {"agg": "seq-mean-token-sum", "beta": 0.05},
}


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def ratio(p: float, old: float, cap: float = CLAMP) -> tuple[float, float]:
    """r = exp(clip(π − π_old, −cap, cap)) and dr/dπ (0 where the clip binds)."""
    d = p - old
    r = math.exp(clip(d, -cap, cap))
    return r, (r if -cap < d < cap else 0.0)


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf


def tis_weights(seq: dict, level: str, cap: float, icepop: float | None) -> list[float]:
    """w per token; 1.0 on untrained tokens (it never matters there)."""
    n = len(seq["mask"])
    if level == "token":
        w = []
        for t in range(n):
            if seq["mask"][t] == 0:
                w.append(1.0)
                continue
            d = seq["old"][t] - seq["sampling"][t]
            wt = min(math.exp(clip(d, -CLAMP, CLAMP)), cap)
            if icepop is not None:
                raw = safe_exp(d)
                if raw < 1.0 / icepop or raw > icepop:
                    wt = 0.0
            w.append(wt)
        return w
    assert level == "sequence" and icepop is None
    count = sum(seq["mask"])
    if count == 0:
        return [1.0] * n
    mean = sum(m * (o - s) for m, o, s in zip(seq["mask"], seq["old"], seq["sampling"])) / count
    return [min(safe_exp(mean), cap)] * n


def kl(p: float, ref: float, estimator: str) -> tuple[float, float]:
    """KL_t and dKL_t/dπ."""
    if estimator == "k1":
        return p - ref, 1.0
    if estimator == "k2":
        return 0.5 * (p - ref) ** 2, p - ref
    assert estimator == "k3"
    return math.exp(ref - p) - (ref - p) - 1.0, -math.exp(ref - p) + 1.0


def ppo(r: float, dr: float, a: float, lo: float, hi: float) -> tuple[float, float]:
    """max(−r·A, −clip(r, lo, hi)·A) and its derivative given dr."""
    unclipped = -r * a
    clipped = -clip(r, lo, hi) * a
    if unclipped >= clipped:
        return unclipped, -a * dr
    return clipped, (-a * dr if lo < r < hi else 0.0)


def token_term(name: str, o: dict, seq: dict, t: int, w: float, log_s: float) -> tuple[float, float]:
    """ℓ_t and dℓ_t/dπ_t for one token."""
    p, old, a = seq["logprobs"][t], seq["old"][t], seq["adv"][t]
    r, dr = ratio(p, old, o.get("ratio_log_cap", CLAMP))
    if name == "reinforce":
        value, grad = -a * w * p, -a * w
    elif name == "importance_sampling":
        rho, drho = r, dr
        if o["clip_rho"] is not None and r > o["clip_rho"]:
            rho, drho = o["clip_rho"], 0.0
        value, grad = -a * w * rho, -a * w * drho
    elif name == "grpo":
        s, ds = ppo(r, dr, a, 1 - o["eps_low"], 1 + o["eps_high"])
        value, grad = s * w, ds * w
    elif name == "dapo":
        s, ds = ppo(r, dr, a, 1 - o["eps_low"], 1 + o["eps_high"])
        c = o["dual_clip"]
        if c is not None and a < 0 and -c * a < s:
            s, ds = -c * a, 0.0
        value, grad = s * w, ds * w
    elif name == "gspo":
        s_i = math.exp(log_s)  # value s_i, and ds_{i,t}/dπ_t = s_i (token form)
        s, ds = ppo(s_i, s_i, a, 1 - o["eps_low"], 1 + o["eps_high"])
        value, grad = s * w, ds * w
    elif name == "cispo":
        weight = clip(r, 1 - o["eps_low"], 1 + o["eps_high"])  # stop-gradient
        value, grad = -weight * a * p * w, -weight * a * w
    elif name == "dro":
        value = -a * p * w + 0.5 * o["beta"] * (p - old) ** 2
        grad = -a * w + o["beta"] * (p - old)
    else:
        raise KeyError(name)
    if o.get("kl_beta", 0.0) > 0:
        k, dk = kl(p, seq["ref"][t], o["kl_estimator"])
        value += o["kl_beta"] * k
        grad += o["kl_beta"] * dk
    return value, grad


def sequence_log_ratio(seq: dict, cap: float = CLAMP) -> float:
    """GSPO's log s_i: the masked mean of π − π_old, clipped to ±cap (0 when nothing is trained)."""
    count = sum(seq["mask"])
    if count == 0:
        return 0.0
    log_s = sum(m * (p - q) for m, p, q in zip(seq["mask"], seq["logprobs"], seq["old"])) / count
    return clip(log_s, -cap, cap)


def reference_metrics(
    name: str, seqs: list[dict], options: dict | None = None, tis: dict | None = None, with_ref: bool = True, **normalizers
) -> dict[str, float]:
    """Every metric the loss (and TIS) reports, from the definitions in docs/losses.md."""
    o = dict(DEFAULTS[name])
    o.update(options or {})
    trained = [(seq, t) for seq in seqs for t in range(len(seq["mask"])) if seq["mask"][t] > 0]

    def mean(f) -> float:
        return sum(f(seq, t) for seq, t in trained) / len(trained) if trained else 0.0

    def r(seq: dict, t: int) -> float:  # the ratio the loss clips: token r_t, or GSPO's s_i
        if name == "gspo":
            return math.exp(sequence_log_ratio(seq, o["seq_ratio_log_cap"]))
        return ratio(seq["logprobs"][t], seq["old"][t], o.get("ratio_log_cap", CLAMP))[0]

    policy = reference_loss(name, seqs, options, tis, policy_only=True, **normalizers)[0]
    metrics = {"loss/policy": policy, "loss/active_tokens": float(sum(sum(seq["mask"]) for seq in seqs)), "loss/ratio_mean": mean(r)}
    x = lambda seq, t: clip(seq["logprobs"][t] - seq["old"][t], -CLAMP, CLAMP)  # noqa: E731
    metrics["kl/policy_old"] = mean(lambda seq, t: math.exp(x(seq, t)) - x(seq, t) - 1.0)
    if with_ref:
        metrics["kl/mean"] = mean(lambda seq, t: kl(seq["logprobs"][t], seq["ref"][t], "k3")[0])
    if o.get("kl_beta", 0.0) > 0:
        metrics["loss/kl"] = mean(lambda seq, t: kl(seq["logprobs"][t], seq["ref"][t], o["kl_estimator"])[0])
    adv = lambda seq, t: seq["adv"][t]  # noqa: E731
    if name in ("grpo", "dapo", "gspo"):
        metrics["loss/clip_frac_low"] = mean(lambda seq, t: float(r(seq, t) < 1 - o["eps_low"] and adv(seq, t) < 0))
        metrics["loss/clip_frac_high"] = mean(lambda seq, t: float(r(seq, t) > 1 + o["eps_high"] and adv(seq, t) > 0))
    if name == "cispo":
        metrics["loss/clip_frac_low"] = mean(lambda seq, t: float(r(seq, t) < 1 - o["eps_low"]))
        metrics["loss/clip_frac_high"] = mean(lambda seq, t: float(r(seq, t) > 1 + o["eps_high"]))
    if name == "dapo" and o["dual_clip"] is not None:

        def dual_binds(seq: dict, t: int) -> float:
            a = adv(seq, t)
            s = ppo(r(seq, t), 0.0, a, 1 - o["eps_low"], 1 + o["eps_high"])[0]
            return float(a < 0 and s > -o["dual_clip"] * a)

        metrics["loss/clip_frac_dual"] = mean(dual_binds)
    if name == "importance_sampling" and o["clip_rho"] is not None:
        metrics["loss/clip_frac_high"] = mean(lambda seq, t: float(r(seq, t) > o["clip_rho"]))
    if name == "dro":
        metrics["loss/dro_penalty"] = mean(lambda seq, t: 0.5 * o["beta"] * (seq["logprobs"][t] - seq["old"][t]) ** 2)
    if tis is not None:
        level, cap, icepop = tis.get("level", "token"), tis.get("cap", 2.0), tis.get("icepop")

        def raw(seq: dict, t: int) -> float:
            if level == "token":
                return math.exp(clip(seq["old"][t] - seq["sampling"][t], -CLAMP, CLAMP))
            count = sum(seq["mask"])
            return safe_exp(sum(m * (q - s) for m, q, s in zip(seq["mask"], seq["old"], seq["sampling"])) / count)

        metrics["tis/clip_frac"] = mean(lambda seq, t: float(raw(seq, t) > cap))
        metrics["tis/weight_mean"] = mean(lambda seq, t: tis_weights(seq, level, cap, icepop)[t])
        if icepop is not None:

            def dropped(seq: dict, t: int) -> float:
                ratio_t = safe_exp(seq["old"][t] - seq["sampling"][t])
                return float(ratio_t < 1.0 / icepop or ratio_t > icepop)

            metrics["tis/icepop_frac"] = mean(dropped)
    return metrics


def reference_loss(
    name: str,
    seqs: list[dict],
    options: dict | None = None,
    tis: dict | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_tokens: int | None = None,
    policy_only: bool = False,
) -> tuple[float, list[list[float]]]:
    """The loss value and d loss / d π for every token of every sequence.

    ``policy_only``: the policy term alone (``loss/policy``: with w, without KL or DRO's penalty).
    """
    o = dict(DEFAULTS[name])
    o.update(options or {})
    if policy_only:
        o["kl_beta"] = 0.0
        o["beta"] = 0.0
    agg = o["agg"]
    counts = [sum(seq["mask"]) for seq in seqs]
    n_seq = num_sequences if num_sequences is not None else sum(1 for c in counts if c > 0)
    n_tok = num_tokens if num_tokens is not None else sum(counts)

    total = 0.0
    grads: list[list[float]] = []
    for seq, count in zip(seqs, counts):
        n = len(seq["mask"])
        if tis is None:
            w = [1.0] * n
        else:
            w = tis_weights(seq, tis.get("level", "token"), tis.get("cap", 2.0), tis.get("icepop"))
        log_s = sequence_log_ratio(seq, o.get("seq_ratio_log_cap", CLAMP))
        if count == 0:
            coef = 0.0  # an all-masked sequence contributes nothing
        elif agg == "token-sum":
            coef = 1.0
        elif agg == "token-mean":
            coef = 1.0 / n_tok
        elif agg == "seq-mean-token-sum":
            coef = 1.0 / n_seq
        elif agg == "seq-mean-token-mean":
            coef = 1.0 / (n_seq * count)
        elif agg == "seq-mean-token-sum-norm":
            coef = 1.0 / (n_seq * max_tokens)
        else:
            raise KeyError(agg)
        g = []
        for t in range(n):
            m = seq["mask"][t]
            if m == 0:
                g.append(0.0)
                continue
            value, grad = token_term(name, o, seq, t, w[t], log_s)
            total += coef * m * value
            g.append(coef * m * grad)
        grads.append(g)
    return total, grads


# ---------------------------------------------------------------------------------------------
# Test inputs: random sequences (plain lists) for the scenarios of the spec's edge cases, and
# the comparison of a plugin's value and gradient with the reference above.

AGGS = ["token-sum", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
MAX_TOKENS = 64
TIS_MODES = {
    "off": None,
    "token": {"level": "token", "cap": 2.0},
    "sequence": {"level": "sequence", "cap": 1.5},
    "icepop": {"level": "token", "cap": 2.0, "icepop": 1.6},
}


def random_sequence(
    rng,
    length: int,
    *,
    prompt: int | None = None,
    shift: float = 0.0,
    sampler_shift: float = 0.0,
    adv: str = "seq",
    masked: bool = False,
    on_policy: bool = False,
    garbage: bool = False,
) -> dict:
    p = [math.log(rng.uniform(0.01, 1.0)) for _ in range(length)]
    old = list(p) if on_policy else [x + rng.gauss(0.0, 0.3) + shift for x in p]
    sampling = [x + rng.gauss(0.0, 0.3) + sampler_shift for x in old]
    ref = [x + rng.gauss(0.0, 0.4) for x in p]
    if prompt is None:
        prompt = rng.randint(0, length // 3)
    mask = [0.0 if (t < prompt or masked) else 1.0 for t in range(length)]
    if length > 8 and not masked:  # a tool-output gap inside the completion
        start = rng.randint(prompt, length - 1)
        for t in range(start, min(length, start + rng.randint(1, 4))):
            mask[t] = 0.0
    if adv == "seq":
        a = [rng.gauss(0.0, 1.0)] * length
    elif adv == "zero":
        a = [0.0] * length
    else:
        a = [rng.gauss(0.0, 1.0) if rng.random() < 0.8 else 0.0 for _ in range(length)]
    if garbage:  # untrained positions hold values that would overflow if they were used
        for t in range(length):
            if mask[t] == 0:
                old[t], sampling[t], ref[t] = -900.0, 800.0, 900.0
    return {"logprobs": p, "old": old, "sampling": sampling, "ref": ref, "mask": mask, "adv": a}


@functools.cache
def scenario(name: str, seed: int = 0) -> list[dict]:
    """The sequences of one named scenario (cached: callers must not modify them)."""
    import random

    rng = random.Random(f"{name}-{seed}")
    L = lambda: rng.randint(1, MAX_TOKENS)  # noqa: E731
    if name == "mixed":
        return [random_sequence(rng, L()) for _ in range(5)]
    if name == "per_token_adv":
        return [random_sequence(rng, L(), adv="token") for _ in range(4)]
    if name == "all_masked":
        return [
            random_sequence(rng, L()),
            random_sequence(rng, L(), masked=True),
            random_sequence(rng, L(), adv="token"),
            random_sequence(rng, 1, masked=True),
        ]
    if name == "zero_adv":
        return [random_sequence(rng, L(), adv="zero"), random_sequence(rng, L(), adv="zero"), random_sequence(rng, L(), adv="token")]
    if name == "far":  # ratios far outside every clip range, both ways; sampler far off too
        return [
            random_sequence(rng, L(), shift=s, sampler_shift=-s, adv=a)
            for s, a in [(3.0, "seq"), (-3.0, "seq"), (3.0, "token"), (-3.0, "token")]
        ]
    if name == "single":
        return [random_sequence(rng, L(), adv="token")]
    if name == "lengths":  # very short and maximal sequences
        return [random_sequence(rng, n, prompt=0, adv="token") for n in (1, 64, 2, 63, 1)]
    if name == "on_policy":  # r = 1 exactly: the GSPO ratio sits inside its tiny clip range
        return [random_sequence(rng, L(), on_policy=True, adv=a) for a in ("seq", "token", "seq")]
    if name == "garbage":
        return [random_sequence(rng, L(), prompt=5, garbage=True, adv="token") for _ in range(3)]
    raise KeyError(name)


SCENARIOS = ["mixed", "per_token_adv", "all_masked", "zero_adv", "far", "single", "lengths", "on_policy", "garbage"]


def make_inputs(seqs: list[dict], with_ref: bool = True, **normalizers):
    import torch

    from grpo_core import LossInputs

    t = lambda key: [torch.tensor(s[key], dtype=torch.float64) for s in seqs]  # noqa: E731
    logprobs = [x.requires_grad_() for x in t("logprobs")]
    return LossInputs(
        logprobs=logprobs,
        old_logprobs=t("old"),
        sampling_logprobs=t("sampling"),
        ref_logprobs=t("ref") if with_ref else None,
        mask=t("mask"),
        advantages=t("adv"),
        max_tokens=normalizers.pop("max_tokens", MAX_TOKENS),
        **normalizers,
    )


def plugins_for(name: str, options: dict | None, tis: dict | None) -> list:
    """The loss plugin (and TIS) by name; instances are cached (making one scans the catalog)."""
    key = (name, tuple(sorted((options or {}).items())), tuple(sorted((tis or {}).items())) if tis is not None else None)
    return list(_plugins(key))


@functools.cache
def _plugins(key) -> tuple:
    from grpo_core import make_plugin

    name, options, tis = key
    plugins = [make_plugin(name, kind="loss", **dict(options))]
    if tis is not None:
        plugins.append(make_plugin("tis", kind="loss", **dict(tis)))
    return tuple(plugins)


def assert_matches_reference(
    name: str,
    seqs: list[dict],
    options: dict | None = None,
    tis: dict | None = None,
    atol: float = 1e-6,
    plugins: list | None = None,
    pm=None,
    **normalizers,
):
    """Run the plugin (with TIS when given) and compare value and gradient with the reference.

    ``call_loss`` by default; ``pm``, a plugin manager from ``build_manager`` (what call_loss
    builds), saves rebuilding it for every scenario of a test.
    """
    import torch

    from grpo_core import call_loss

    inputs = make_inputs(seqs, **normalizers)
    if pm is not None:
        out = pm.hook.loss(inputs=inputs)
    else:
        out = call_loss(plugins if plugins is not None else plugins_for(name, options, tis), inputs)
    out.loss.backward()
    value, grads = reference_loss(name, seqs, options, tis, max_tokens=inputs.max_tokens, **normalizers)
    assert out.loss.dim() == 0
    assert abs(out.loss.item() - value) <= atol, (out.loss.item(), value)
    assert_metrics_match(out.metrics, reference_metrics(name, seqs, options, tis, max_tokens=inputs.max_tokens, **normalizers), atol)
    for i, (x, g) in enumerate(zip(inputs.logprobs, grads)):
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        torch.testing.assert_close(grad, torch.tensor(g, dtype=torch.float64), atol=atol, rtol=0, msg=lambda m, i=i: f"sequence {i}: {m}")
    return out


def assert_metrics_match(got: dict[str, float], want: dict[str, float], atol: float = 1e-9) -> None:
    """The same metric names, each with the reference's value (relative for large ones)."""
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for key, value in want.items():
        assert abs(got[key] - value) <= atol * max(1.0, abs(value)), (key, got[key], value)


def check_all_scenarios(name: str, options: dict | None, agg: str, tis_mode: str) -> None:
    options = dict(options or {}, agg=agg)
    tis = TIS_MODES[tis_mode]
    from grpo_core.plugins_manager import build_manager

    pm = build_manager(plugins_for(name, options, tis))
    for s in SCENARIOS:
        out = assert_matches_reference(name, scenario(s), options, tis, pm=pm)
        assert all(math.isfinite(v) for v in out.metrics.values()), (s, out.metrics)
        if tis is not None:
            assert {"tis/weight_mean", "tis/clip_frac"} <= set(out.metrics)


def one_sequence(logprobs, old, adv, mask=None):
    """LossInputs of one float64 sequence whose sampler is its old policy (mask: all trained by default)."""
    import torch

    from grpo_core import LossInputs

    lp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    n = len(logprobs)
    return LossInputs(
        logprobs=[lp],
        old_logprobs=[torch.tensor(old, dtype=torch.float64)],
        sampling_logprobs=[torch.tensor(old, dtype=torch.float64)],
        mask=[torch.ones(n, dtype=torch.float64) if mask is None else torch.tensor(mask, dtype=torch.float64)],
        advantages=[torch.tensor(adv, dtype=torch.float64)],
    )
