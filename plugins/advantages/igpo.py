from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import attrs

from grpo_core import Sample, hookimpl, option


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

    needs_turn_scores: ClassVar[bool] = True
    """The advantage stage scores the answer after each turn (``grpo_core.stages.score_turns``)
    and sets ``turn_scores_G`` before each call of ``advantage``."""

    turn_scores_G: list[list[float]] = attrs.field(factory=list, init=False, repr=False)
    """s_0..s_{T−1} of each sample of the group being computed (empty for a single turn)."""
    gains_by_turn: dict[int, list[float]] = attrs.field(factory=dict, init=False, repr=False)
    """Information gains seen since the last ``step_metrics``, by turn (1-based)."""

    def __attrs_post_init__(self) -> None:
        if "{answer}" not in self.answer_template:
            raise ValueError(f"answer_template must contain {{answer}}: {self.answer_template!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")

    @hookimpl
    def advantage(self, rewards_G: Sequence[float], samples: Sequence[Sample]) -> list[float | list[float]]:
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
                self.gains_by_turn.setdefault(t, []).append(gain)
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

    def step_metrics(self) -> dict[str, float]:
        """Information-gain statistics since the last call (then forgotten): overall and per turn."""
        everything = [g for gains in self.gains_by_turn.values() for g in gains]
        metrics: dict[str, float] = {}
        if everything:
            metrics["igpo/ig_mean"], metrics["igpo/ig_std"] = _mean_std(everything)
        for t, gains in sorted(self.gains_by_turn.items()):
            metrics[f"igpo/ig_mean_turn{t}"], metrics[f"igpo/ig_std_turn{t}"] = _mean_std(gains)
        self.gains_by_turn = {}
        return metrics


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
