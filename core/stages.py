"""The stages of one GRPO step between rollout and weight sync: score, advantages, train."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import pluggy

from grpo_core.backend import Reference, Trainer, sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.loss import STEP_TOTAL_METRICS, LossInputs
from grpo_core.plugins_manager import PluginError
from grpo_core.types import Sample

if TYPE_CHECKING:
    from grpo_core.selection import Selection


class RewardError(PluginError):
    """Rewards failed on too many samples in a row, or a reward broke its contract."""


class CallTimeout(Exception):
    """A call did not return in time (it goes on in a daemon thread, which is abandoned)."""


T = TypeVar("T")


def call_with_timeout(fn: Callable[[], T], timeout: float) -> T:
    """``fn()``, or CallTimeout after ``timeout`` seconds (0 = wait for ever).

    A daemon thread, not a pool: a call that never returns must not hold the process at exit.
    """
    if not timeout:
        return fn()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="grpo-core-reward")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CallTimeout(f"did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def score_groups(
    selection: Selection, groups: Sequence[Sequence[Sample]], max_failures_in_a_row: int, timeout: float = 0.0
) -> dict[str, float]:
    """Weighted sum of every reward; a None/NaN, a raising or a timed-out reward marks the sample failed.

    A failed sample is not trained on; the run stops once ``max_failures_in_a_row`` samples
    in a row have failed, with the last error. ``timeout`` bounds each reward call (0 = none).
    """
    failed = errors = timeouts = 0
    per_reward: dict[str, list[float]] = {r.name: [] for r in selection.rewards}
    for group in groups:
        if not group:
            continue
        for r in selection.rewards:
            try:
                scores = list(call_with_timeout(lambda r=r, group=group: r.plugin.reward(prompt=group[0].prompt, samples=group), timeout))
            except CallTimeout as exc:
                scores = [None] * len(group)
                timeouts += 1
                selection.last_reward_error = f"reward '{r.name}' {exc}"
            except Exception as exc:  # a reward's bug must not lose the run: the group is marked failed
                scores = [None] * len(group)
                errors += 1
                selection.last_reward_error = f"reward '{r.name}' raised {type(exc).__name__}: {exc}"
            if len(scores) != len(group):
                raise RewardError(f"reward '{r.name}' returned {len(scores)} scores for {len(group)} samples")
            for sample, score in zip(group, scores):
                ok = score is not None and not math.isnan(score)
                sample.rewards[r.name] = float(score) if ok else None
                if ok:
                    per_reward[r.name].append(float(score))
        for sample in group:
            if any(sample.rewards[r.name] is None for r in selection.rewards):
                sample.reward = None
                failed += 1
                selection.reward_failures_in_a_row += 1
                if selection.reward_failures_in_a_row >= max_failures_in_a_row:
                    raise RewardError(
                        f"rewards failed on {selection.reward_failures_in_a_row} samples in a row; "
                        f"last: {selection.last_reward_error or 'a reward returned None/NaN'}"
                    )
            else:
                sample.reward = sum(r.weight * sample.rewards[r.name] for r in selection.rewards)
                selection.reward_failures_in_a_row = 0
    totals = [s.reward for g in groups for s in g if s.reward is not None]
    metrics = {
        "reward/total": _mean(totals),
        "reward/std": _std(totals),
        "reward/failed": float(failed),
        "reward/errors": float(errors),
        "reward/timeouts": float(timeouts),
    }
    metrics.update({f"reward/{name}": _mean(v) for name, v in per_reward.items()})
    tokens = [s.num_completion_tokens for g in groups for s in g]
    metrics["tokens/completion"] = float(sum(tokens))
    metrics["tokens/completion_mean"] = _mean(tokens)
    metrics["completion/truncated_frac"] = _mean([s.finish_reason == "length" for g in groups for s in g])
    return metrics


def compute_advantages(
    pm: pluggy.PluginManager, groups: Sequence[Sequence[Sample]], drop_zero_variance: bool
) -> tuple[list[list[Sample]], dict[str, float]]:
    """Advantages per group; groups without signal (all rewards equal, < 2 scored) are dropped."""
    kept: list[list[Sample]] = []
    dropped_zero_variance = dropped_failed = skipped = 0
    for group in groups:
        if not group:
            skipped += 1
            continue
        scored = [s for s in group if s.reward is not None]
        if len(scored) < 2:
            dropped_failed += 1
            continue
        rewards_G = [s.reward for s in scored]
        if drop_zero_variance and max(rewards_G) == min(rewards_G):
            dropped_zero_variance += 1
            continue
        advantages = pm.hook.advantage(rewards_G=rewards_G, samples=scored)
        for sample, adv in zip(scored, advantages):
            if isinstance(adv, (int, float)):
                sample.advantages = [float(adv)] * len(sample.tokens)
            elif len(adv) == len(sample.tokens):
                sample.advantages = [float(a) for a in adv]
            else:
                raise ValueError(f"advantage returned {len(adv)} values for a sample of {len(sample.tokens)} tokens")
        kept.append(scored)
    return kept, {
        "groups/kept": float(len(kept)),
        "groups/dropped_zero_variance": float(dropped_zero_variance),
        "groups/dropped_failed": float(dropped_failed),
        "groups/skipped": float(skipped),
    }


def train_on_groups(
    pm: pluggy.PluginManager,
    trainer: Trainer,
    reference: Reference | None,
    groups: Sequence[Sequence[Sample]],
    config: RunConfig,
    learning_rate: float,
) -> dict[str, float]:
    """Forward/backward over the kept samples (in chunks if asked), then one optimizer step."""
    import tinker
    import torch

    samples = [s for g in groups for s in g]
    if not samples:
        return {"train/skipped": 1.0}
    datums = [sample_to_datum(s) for s in samples]
    mask = [torch.tensor(s.loss_mask[1:]) for s in samples]
    sampling = [torch.tensor(s.sampling_logprobs[1:]) for s in samples]
    advantages = [torch.tensor(s.advantages[1:]) for s in samples]
    ref = reference.forward(datums) if reference is not None else None
    old = anchor_logprobs(trainer, datums, samples, sampling, config.anchor)
    num_sequences = sum(int(m.sum() > 0) for m in mask)
    num_tokens = float(sum(m.sum() for m in mask))

    metric_sums: dict[str, float] = {}
    step_loss = 0.0
    for idx in fwd_bwd_chunks(len(samples), config.min_samples_per_fwd_bwd, config.max_samples_per_fwd_bwd):

        def loss_fn(_datums: Any, logprobs: list[torch.Tensor], idx: range = idx) -> tuple[torch.Tensor, dict[str, float]]:
            inputs = LossInputs(
                logprobs=list(logprobs),
                old_logprobs=[old[i] for i in idx] if old is not None else [lp.detach() for lp in logprobs],
                sampling_logprobs=[sampling[i] for i in idx],
                mask=[mask[i] for i in idx],
                advantages=[advantages[i] for i in idx],
                ref_logprobs=[ref[i] for i in idx] if ref is not None else None,
                num_sequences=num_sequences,
                num_tokens=num_tokens,
                max_tokens=config.max_completion_tokens,
            )
            out = pm.hook.loss(inputs=inputs)
            return out.loss, out.metrics

        result = trainer.forward_backward_custom([datums[i] for i in idx], loss_fn)
        # Chunk losses carry the whole step's normalizer: they add up to the step's loss.
        step_loss += result.metrics.pop("loss")
        # Every other metric is a mean over the call's trained tokens: weighted by them, the
        # step's value is that of one call with all sequences.
        call_tokens = float(sum(mask[i].sum() for i in idx))
        for key, value in result.metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + (value if key in STEP_TOTAL_METRICS else value * call_tokens)
    metrics = {k: v if k in STEP_TOTAL_METRICS else v / max(num_tokens, 1.0) for k, v in metric_sums.items()}
    metrics["loss/total"] = step_loss
    metrics.update(
        trainer.optim_step(
            tinker.AdamParams(
                learning_rate=learning_rate,
                beta1=config.beta1,
                beta2=config.beta2,
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
                grad_clip_norm=config.grad_clip_norm,
            )
        )
    )
    metrics["train/samples"] = float(len(samples))
    return metrics


def fwd_bwd_chunks(n: int, min_size: int, max_size: int | None) -> list[range]:
    """Greedy split of n samples into calls of at most max_size; a short tail joins the call before."""
    size = max_size or n
    chunks = [range(start, min(start + size, n)) for start in range(0, n, size)]
    if len(chunks) > 1 and len(chunks[-1]) < min_size:
        tail = chunks.pop()
        chunks[-1] = range(chunks[-1].start, tail.stop)
    return chunks


def anchor_logprobs(
    trainer: Trainer, datums: list, samples: list[Sample], sampling: list, anchor: str
) -> list | None:
    """π_old for the ratio. None = on-policy: the loss reuses the detached current logprobs."""
    if anchor == "sampling":
        return sampling
    if all(s.policy_version == trainer.version for s in samples):
        return None
    return trainer.forward(datums)


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
