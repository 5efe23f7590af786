from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from grpo_core import PluginError, Sample, hookimpl, option
from grpo_core.metrics import record

if TYPE_CHECKING:
    from grpo_core.backend import PolicyScorer, Trainer


@attrs.define
class IGPOAdvantage:
    """IGPO turn-level advantages (arXiv 2510.14967 v2): each turn is rewarded by how much it
    raised the current policy's teacher-forced log-probability of the ground-truth answer.

    After every turn t of a trajectory the run scores s_t, the mean log-probability of the
    prompt's answer given the conversation so far (s_0: the prompt alone); one trainer forward
    per step scores all turns of all trajectories. A turn's information gain is s_t − s_{t−1}
    (or exp(s_t) − exp(s_{t−1})); the last turn gets the outcome reward instead. Gains and
    outcomes are z-scored over the group, discounted into turn returns, and every token of
    turn t gets its return. A single-turn trajectory gets the normalized outcome alone. Needs
    a multi-turn rollout (samples with ``turns``) and prompts with an answer.
    """

    info_gain: Literal["log_prob_diff", "prob_diff"] = option(
        "log_prob_diff", help="gain of a turn: s_t − s_{t−1} (log_prob_diff) or exp(s_t) − exp(s_{t−1}) (prob_diff)"
    )
    norm: Literal["separate", "joint"] = option(
        "separate", help="z-score gains and outcome rewards apart (separate) or pooled together (joint)"
    )
    gamma: float = option(1.0, help="discount of later turns' rewards in a turn's return")
    answer_template: str = option(
        "{answer}", help="the answer as the policy would write it, e.g. 'The answer is {answer}.'; only the answer's tokens are scored"
    )

    turn_scores_G: list[list[float]] = attrs.field(factory=list, init=False, repr=False)
    """s_0..s_{T−1} of each sample of the group being computed (empty for a single turn)."""
    prepared: dict[int, list[list[float]]] = attrs.field(factory=dict, init=False, repr=False)
    """The turn scores of the groups ``prepare_advantages`` scored, by the id of a group's first
    sample, until its ``advantage`` call takes them."""

    def __attrs_post_init__(self) -> None:
        if "{answer}" not in self.answer_template:
            raise ValueError(f"answer_template must contain {{answer}}: {self.answer_template!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")

    @hookimpl
    def prepare_advantages(self, groups: Sequence[Sequence[Sample]], scorer: PolicyScorer | None) -> None:
        """Score the answer after every turn of every group with one policy forward."""
        if scorer is None:
            raise PluginError("igpo scores the answer after every turn and needs the trainer: pass trainer= to compute_advantages")
        started = time.perf_counter()
        scores, metrics = score_turns(scorer, groups, self.answer_template)
        self.prepared = {id(group[0]): group_scores for group, group_scores in zip(groups, scores) if group}
        record("time/igpo", time.perf_counter() - started, "sum")
        record("igpo/scored_sequences", metrics["igpo/scored_sequences"], "sum")
        if "igpo/answer_logprob_t0" in metrics:
            record("igpo/answer_logprob_t0", metrics["igpo/answer_logprob_t0"], "mean", weight=metrics["igpo/first_scores"])

    @hookimpl
    def advantage(self, rewards_G: Sequence[float], samples: Sequence[Sample]) -> list[float | list[float]]:
        if samples and id(samples[0]) in self.prepared:
            self.turn_scores_G = self.prepared.pop(id(samples[0]))
        if len(self.turn_scores_G) != len(samples):
            raise ValueError(
                f"igpo got turn scores for {len(self.turn_scores_G)} samples and {len(samples)} samples: "
                "the advantage stage must score the turns first (compute_advantages with a trainer)"
            )
        for sample, scores in zip(samples, self.turn_scores_G):
            turns = len(sample.turns)
            if len(scores) != (turns if turns > 1 else 0):
                raise ValueError(f"sample of prompt {sample.prompt.id} has {turns} turns but {len(scores)} turn scores")
        gains_G = [self.gains(scores) for scores in self.turn_scores_G]
        for gains in gains_G:
            for t, gain in enumerate(gains, start=1):
                for suffix in ("", f"_turn{t}"):  # over every turn, and over turn t's
                    record(f"igpo/ig_mean{suffix}", gain, "mean")
                    record(f"igpo/ig_std{suffix}", gain, "std")
        outcome_stats = _stats(list(rewards_G))
        gain_stats = _stats([g for gains in gains_G for g in gains])
        if self.norm == "joint":
            outcome_stats = gain_stats = _stats([g for gains in gains_G for g in gains] + list(rewards_G))
        result: list[float | list[float]] = []
        for sample, reward, gains in zip(samples, rewards_G, gains_G):
            normalized = [_z(g, gain_stats) for g in gains] + [_z(reward, outcome_stats)]
            turns = sample.turns
            if not turns:
                result.append(normalized[-1])
                continue
            returns = discounted_returns(normalized, self.gamma)
            per_token = [0.0] * len(sample.tokens)
            for turn, value in zip(turns, returns):
                per_token[turn.start : turn.end] = [value] * (turn.end - turn.start)
            result.append(per_token)
        return result

    def gains(self, scores: Sequence[float]) -> list[float]:
        """r^IG_t for t = 1..len(scores)−1, from s_0..s_{T−1}."""
        if self.info_gain == "prob_diff":
            return [math.exp(b) - math.exp(a) for a, b in zip(scores, scores[1:])]
        return [b - a for a, b in zip(scores, scores[1:])]


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
    policy: PolicyScorer | Trainer, groups: Sequence[Sequence[Sample]], answer_template: str
) -> tuple[list[list[list[float]]], dict[str, float]]:
    """Teacher-forced score of each prompt's answer after each turn, for every sample of every group.

    s_t = mean log-probability under the current policy of the answer's tokens following
    ``tokens[:ctx_t]`` and the part of ``answer_template`` before ``{answer}`` (the two are
    tokenized apart, so exactly the answer's own tokens are averaged). All sequences go to one
    ``policy.forward``.

    :returns: per group, per sample, the scores s_0..s_{T−1} (empty for a single turn); and
        ``igpo/scored_sequences``, ``igpo/answer_logprob_t0`` (mean s_0) and
        ``igpo/first_scores`` (how many s_0 it is the mean of).
    """
    import tinker

    lead, _ = answer_template.split("{answer}", 1)
    lead_ids = list(policy.tokenizer.encode(lead, add_special_tokens=False)) if lead else []
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
            answer_ids = list(policy.tokenizer.encode(sample.prompt.answer, add_special_tokens=False))
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
    logprobs = policy.forward(datums) if datums else []
    first: list[float] = []
    for (g, i), length, lp in zip(owners, answer_lengths, logprobs):
        score = float(lp[-length:].mean())
        if not scores[g][i]:
            first.append(score)
        scores[g][i].append(score)
    metrics = {"igpo/scored_sequences": float(len(datums)), "igpo/first_scores": float(len(first))}
    if first:
        metrics["igpo/answer_logprob_t0"] = sum(first) / len(first)
    return scores, metrics


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_t = Σ_{k≥t} γ^{k−t} r_k."""
    returns: list[float] = []
    running = 0.0
    for r in reversed(rewards):
        running = r + gamma * running
        returns.append(running)
    return returns[::-1]


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _stats(values: Sequence[float]) -> tuple[float, float]:
    """Pooled mean and population std; a pool of at most one value has std 1 (no scaling)."""
    if not values:
        return 0.0, 1.0
    mean, std = _mean_std(values)
    return mean, std if len(values) > 1 else 1.0


def _z(value: float, stats: tuple[float, float]) -> float:
    mean, std = stats
    return (value - mean) / (std + 1e-8)
