"""The stages of one GRPO step between rollout and weight sync: score, advantages, train."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
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
    pm: pluggy.PluginManager,
    groups: Sequence[Sequence[Sample]],
    drop_zero_variance: bool,
    trainer: Trainer | None = None,
    max_samples_per_call: int | None = None,
) -> tuple[list[list[Sample]], dict[str, float]]:
    """Advantages per group; groups without signal (every advantage 0, < 2 scored) are dropped.

    An advantage plugin with ``needs_turn_scores = True`` (igpo) first gets the answer scores
    of every turn of every group from one ``trainer`` forward (see :func:`score_turns`), in
    calls of at most ``max_samples_per_call`` sequences. For it a group whose outcome rewards
    are all equal may still carry signal (the turns' information gains): a group is dropped
    when all its advantages are 0, which for an outcome-only advantage means equal rewards.
    """
    plugin = advantage_plugin(pm)
    metrics: dict[str, float] = {}
    dropped_zero_variance = dropped_failed = skipped = 0
    candidates: list[list[Sample]] = []
    for group in groups:
        if not group:
            skipped += 1
            continue
        scored = [s for s in group if s.reward is not None]
        if len(scored) < 2:
            dropped_failed += 1
            continue
        candidates.append(scored)
    needs_turn_scores = bool(getattr(plugin, "needs_turn_scores", False))
    turn_scores: list[list[list[float]]] = []
    if needs_turn_scores:
        if trainer is None:
            raise PluginError("this advantage scores the answer after every turn and needs the trainer: pass trainer=")
        t0 = time.perf_counter()
        turn_scores, score_metrics = score_turns(trainer, candidates, plugin.answer_template, max_samples_per_call)
        metrics.update(score_metrics)
        metrics["time/igpo"] = time.perf_counter() - t0
    kept: list[list[Sample]] = []
    for g, scored in enumerate(candidates):
        if needs_turn_scores:
            plugin.turn_scores_G = turn_scores[g]
        advantages = pm.hook.advantage(rewards_G=[s.reward for s in scored], samples=scored)
        if drop_zero_variance and all(a == 0 for adv in advantages for a in ([adv] if isinstance(adv, (int, float)) else adv)):
            dropped_zero_variance += 1
            continue
        for sample, adv in zip(scored, advantages):
            if isinstance(adv, (int, float)):
                sample.advantages = [float(adv)] * len(sample.tokens)
            elif len(adv) == len(sample.tokens):
                sample.advantages = [float(a) for a in adv]
            else:
                raise ValueError(f"advantage returned {len(adv)} values for a sample of {len(sample.tokens)} tokens")
        kept.append(scored)
    if hasattr(plugin, "step_metrics"):
        metrics.update(plugin.step_metrics())
    return kept, {
        "groups/kept": float(len(kept)),
        "groups/dropped_zero_variance": float(dropped_zero_variance),
        "groups/dropped_failed": float(dropped_failed),
        "groups/skipped": float(skipped),
        **metrics,
    }


def advantage_plugin(pm: pluggy.PluginManager) -> Any:
    """The plugin instance that answers the ``advantage`` hook (the last registered wins)."""
    impls = pm.hook.advantage.get_hookimpls()
    return impls[-1].plugin if impls else None


def turn_contexts(sample: Sample) -> list[int]:
    """Where the conversation stands before each turn but the last: ``tokens[:ctx_t]`` for t = 0..T−1.

    ctx_0 is the prompt alone (the first turn's start), ctx_t the end of turn t's context (its
    observation and the next assistant header). The score after the last turn never enters
    IGPO (the outcome reward stands in for it), so it is not computed; a single-turn sample
    has nothing to score.
    """
    turns = sample.turns
    if len(turns) < 2:
        return []
    return [turns[0].start] + [turn.context_end for turn in turns[:-1]]


def score_turns(
    trainer: Trainer, groups: Sequence[Sequence[Sample]], answer_template: str, max_samples_per_call: int | None = None
) -> tuple[list[list[list[float]]], dict[str, float]]:
    """Teacher-forced score of each prompt's answer after each turn, for every sample of every group.

    s_t = mean log-probability under the current policy of the answer's tokens following
    ``tokens[:ctx_t]`` and the part of ``answer_template`` before ``{answer}`` (the two are
    tokenized apart, so exactly the answer's own tokens are averaged). All sequences go to one
    ``trainer.forward`` (split only into calls of ``max_samples_per_call``).

    :returns: per group, per sample, the scores s_0..s_{T−1} (empty for a single turn); and
        metrics: ``igpo/scored_sequences`` and ``igpo/answer_logprob_t0`` (mean s_0).
    """
    import tinker

    lead, _ = answer_template.split("{answer}", 1)
    lead_ids = list(trainer.tokenizer.encode(lead, add_special_tokens=False)) if lead else []
    datums: list[Any] = []
    answer_lengths: list[int] = []
    owners: list[tuple[int, int]] = []
    for g, group in enumerate(groups):
        for i, sample in enumerate(group):
            contexts = turn_contexts(sample)
            if not contexts:
                continue
            if not sample.prompt.answer:
                raise PluginError(f"prompt {sample.prompt.id} has no answer: igpo scores the ground-truth answer after every turn")
            answer_ids = list(trainer.tokenizer.encode(sample.prompt.answer, add_special_tokens=False))
            for end in contexts:
                ids = sample.tokens[:end] + lead_ids + answer_ids
                datums.append(
                    tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={
                            "target_tokens": ids[1:],
                            "weights": [0.0] * (len(ids) - 1 - len(answer_ids)) + [1.0] * len(answer_ids),
                        },
                    )
                )
                answer_lengths.append(len(answer_ids))
                owners.append((g, i))
    scores: list[list[list[float]]] = [[[] for _ in group] for group in groups]
    logprobs: list[Any] = []
    for idx in fwd_bwd_chunks(len(datums), 1, max_samples_per_call) if datums else []:
        logprobs.extend(trainer.forward([datums[k] for k in idx]))
    first: list[float] = []
    for (g, i), length, lp in zip(owners, answer_lengths, logprobs):
        score = float(lp[-length:].mean())
        if not scores[g][i]:
            first.append(score)
        scores[g][i].append(score)
    metrics = {"igpo/scored_sequences": float(len(datums))}
    if first:
        metrics["igpo/answer_logprob_t0"] = _mean(first)
    return scores, metrics


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
        loss_fn = StepLoss(
            pm=pm,
            old=[old[i] for i in idx] if old is not None else None,
            sampling=[sampling[i] for i in idx],
            mask=[mask[i] for i in idx],
            advantages=[advantages[i] for i in idx],
            ref=[ref[i] for i in idx] if ref is not None else None,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            max_tokens=config.max_completion_tokens,
        )
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


@attrs.define
class StepLoss:
    """The ``loss_fn(datums, logprobs)`` of one forward/backward call (the Tinker contract's).

    It also says what the loss is computed from, so that a remote trainer can run an equivalent
    loss on its service instead: ``inputs(logprobs)`` builds the loss hook's inputs, and
    ``on_policy`` is True when the ratio anchors on the current policy's own (detached) logprobs.
    """

    pm: pluggy.PluginManager
    old: list[Any] | None
    """π_old of each sequence, or None: on-policy, the detached current logprobs."""
    sampling: list[Any]
    mask: list[Any]
    advantages: list[Any]
    ref: list[Any] | None
    num_sequences: int
    num_tokens: float
    max_tokens: int

    @property
    def on_policy(self) -> bool:
        return self.old is None

    def inputs(self, logprobs: Sequence[Any]) -> LossInputs:
        return LossInputs(
            logprobs=list(logprobs),
            old_logprobs=self.old if self.old is not None else [lp.detach() for lp in logprobs],
            sampling_logprobs=self.sampling,
            mask=self.mask,
            advantages=self.advantages,
            ref_logprobs=self.ref,
            num_sequences=self.num_sequences,
            num_tokens=self.num_tokens,
            max_tokens=self.max_tokens,
        )

    def __call__(self, _datums: Any, logprobs: Sequence[Any]) -> tuple[Any, dict[str, float]]:
        out = self.pm.hook.loss(inputs=self.inputs(logprobs))
        return out.loss, out.metrics


def fwd_bwd_chunks(n: int, min_size: int, max_size: int | None) -> list[range]:
    """Greedy split of n samples into calls of at most max_size; a short tail joins the call before."""
    size = max_size or n
    chunks = [range(start, min(start + size, n)) for start in range(0, n, size)]
    if len(chunks) > 1 and len(chunks[-1]) < min_size:
        tail = chunks.pop()
        chunks[-1] = range(chunks[-1].start, tail.stop)
    return chunks


def anchor_logprobs(trainer: Trainer, datums: list, samples: list[Sample], sampling: list, anchor: str) -> list | None:
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
