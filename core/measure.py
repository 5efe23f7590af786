"""Measuring a policy on held-out prompts: mean reward and pass@k, for ``grpo-core eval``
(``grpo_core.evaluate``) and for evaluation during training (``--eval-every``, :class:`TrainingEval`)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from grpo_core.checkpoint import restore_rng
from grpo_core.config import RunConfig
from grpo_core.data import DEFAULT_DATASET, check_prompt_lengths, load_dataset
from grpo_core.embedded import embedded_split
from grpo_core.errors import PluginError
from grpo_core.metrics import scope
from grpo_core.produce import Scorer, roll_and_score
from grpo_core.types import Prompt, RewardFailures, SamplingParams

if TYPE_CHECKING:
    from grpo_core.selection import Selection

EVAL_DATASET = "default:test"
"""What an evaluation measures without a dataset named: the embedded task's held-out split."""


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples of which ``correct`` passed (Chen et al. 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def measure(
    selection: Selection,
    sampler: Any,
    prompts: Sequence[Prompt],
    num_samples: int,
    params: SamplingParams,
    batch_size: int,
    threshold: float,
    reward_timeout: float,
    progress: Any = None,
    score_lock: Any = None,
) -> dict[str, float]:
    """Mean reward, failed scores, pass@1 and pass@num_samples of ``prompts``, rolled out
    ``batch_size`` prompts at a time; a sample passes when its total reward reaches ``threshold``.

    Scores are taken under ``score_lock`` (the async loop's workers score meanwhile) and counted
    apart from the training's failed rewards in a row; no advantage is computed."""
    scorer = Scorer(selection, RewardFailures(), math.inf, reward_timeout, advantages=False, lock=score_lock)
    rewards: list[float] = []
    passes: dict[int, list[float]] = {1: [], num_samples: []}
    by_source: dict[str, tuple[list[float], list[float]]] = {}
    """A mixture's sources: their rewards and pass@1 apart (``data/NAME/...``)."""
    failed = 0
    with scope():  # what the rollout and the rewards record is not a training step's
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            produced = roll_and_score(scorer, batch, num_samples, sampler, params)
            failed += int(produced.metrics["reward/failed"])
            for prompt, group in zip(batch, produced.groups):
                scores = [s.reward for s in group if s.reward is not None]
                rewards.extend(scores)
                correct = sum(score >= threshold for score in scores)
                for k in passes:
                    passes[k].append(pass_at_k(len(group), correct, k) if group else 0.0)
                if prompt.source is not None:
                    source_rewards, source_passes = by_source.setdefault(prompt.source, ([], []))
                    source_rewards.extend(scores)
                    source_passes.append(passes[1][-1])
            if progress is not None:
                progress(len(batch), len(prompts), sum(rewards) / max(len(rewards), 1))
    result = {"reward/mean": _mean(rewards), "reward/failed": float(failed)}
    for k, values in sorted(passes.items()):
        result[f"pass@{k}"] = sum(values) / len(values)
    for name, (source_rewards, source_passes) in sorted(by_source.items()):
        result[f"data/{name}/reward_mean"] = _mean(source_rewards)
        result[f"data/{name}/pass@1"] = _mean(source_passes)
    return result


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@attrs.define(eq=False)
class TrainingEval:
    """Evaluation during training (``--eval-every N``): held-out prompts measured with
    :func:`measure`, greedily (``eval/pass@1``, ``eval/greedy_reward_mean``) and with the
    training's sampling settings, ``--eval-samples`` K per prompt (``eval/reward_mean``,
    ``eval/pass@K``), through the run's rollout, rewards and sampler.

    Due at step 0 (before training), every N steps and at the run's last step. The synchronous loop
    evaluates between steps and puts every RNG back as the step left it, so a run with evaluation
    trains exactly as one without; the async loop's evaluation samples beside its rollouts
    (:meth:`share`).
    """

    selection: Selection
    prompts: list[Prompt]
    every: int
    num_samples: int
    threshold: float
    params: SamplingParams
    sequences_per_call: int
    """Completions per rollout call: the training's (prompt groups × group size), so that an
    evaluation needs no more memory than a step's rollouts."""
    reward_timeout: float
    total_steps: int = 0
    sampler: Any = None
    score_lock: Any = None
    between_steps: bool = True
    """No rollout runs meanwhile: the RNGs are put back after the evaluation."""

    def share(self, sampler: Any, score_lock: Any) -> None:
        """Evaluate through ``sampler`` while rollouts run (scored under their ``score_lock``)."""
        self.sampler, self.score_lock, self.between_steps = sampler, score_lock, False

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total_steps

    def __call__(self, rng: dict[str, Any] | None) -> dict[str, float]:
        """The ``eval/`` metrics of the sampler's current policy; ``rng``: the RNGs to put back."""
        t0 = time.perf_counter()
        greedy_params = attrs.evolve(self.params, temperature=0.0)
        measured = functools.partial(
            measure, self.selection, self.sampler, self.prompts, threshold=self.threshold, reward_timeout=self.reward_timeout,
            score_lock=self.score_lock,
        )  # fmt: skip
        greedy = measured(1, greedy_params, batch_size=self.sequences_per_call)
        sampled = measured(self.num_samples, self.params, batch_size=max(1, self.sequences_per_call // self.num_samples))
        if self.between_steps and rng is not None:
            restore_rng(rng, self.sampler)
        k = self.num_samples
        return {
            "eval/pass@1": greedy["pass@1"],
            "eval/greedy_reward_mean": greedy["reward/mean"],
            "eval/reward_mean": sampled["reward/mean"],
            "eval/sampled_pass@1": sampled["pass@1"],
            f"eval/pass@{k}": sampled[f"pass@{k}"],
            "eval/reward_failed": greedy["reward/failed"] + sampled["reward/failed"],
            "eval/prompts": float(len(self.prompts)),
            **{f"eval/{name}": value for name, value in sampled.items() if name.startswith("data/")},
            "time/eval": time.perf_counter() - t0,
        }


EVAL_OPTIONS = ("eval_dataset", "eval_mix", "eval_prompts", "eval_samples", "eval_pass_threshold")


def refuse_idle_eval_options(config: RunConfig, options: Sequence[str], measured_with: str) -> None:
    """A run without ``--eval-every`` refuses the evaluation ``options`` it was given (those not at
    their defaults): they would do nothing. ``measured_with``: what turns the evaluation on."""
    defaults = type(config)()
    given = [f"--{name.replace('_', '-')}" for name in options if getattr(config, name) != getattr(defaults, name)]
    if given:
        raise PluginError(f"{', '.join(given)} would do nothing: {measured_with}")


def held_out_config(config: RunConfig) -> RunConfig:
    """``config`` reading the held-out rows of ``--eval-every`` (``grpo-core run``'s prompts, ``grpo-core
    sft``'s examples): ``--eval-dataset``, or each source of ``--eval-mix``, ``--eval-prompts`` rows of
    each; without either, the embedded task's held-out split where the run trains on the embedded task."""
    dataset_name = config.eval_dataset
    if config.eval_mix and dataset_name is not None:
        raise PluginError("--eval-dataset and --eval-mix both name the held-out prompts; make the dataset one more --eval-mix source")
    weighted = [spec for spec in config.eval_mix if ":" in spec.partition("=")[0]]
    if weighted:
        raise PluginError(f"--eval-mix {weighted[0]}: a weight does nothing there (every row of each source is measured); drop it")
    if dataset_name is None and not config.eval_mix:
        if config.mix or embedded_split(config.dataset) is None:
            trains_on = "a mixture (--mix)" if config.mix else config.dataset
            raise PluginError(
                f"--eval-every: the run trains on {trains_on}; pass --eval-dataset with the held-out rows to evaluate on "
                "(or --eval-mix with several sources)"
            )
        dataset_name = EVAL_DATASET
    return attrs.evolve(config, dataset=dataset_name or DEFAULT_DATASET, mix=config.eval_mix, max_rows=config.eval_prompts)


def training_eval(
    config: RunConfig, selection: Selection, tokenizer: Any, max_context: int | None, total_steps: int, params: SamplingParams
) -> TrainingEval | None:
    """The evaluation of a run with ``--eval-every`` (None without): its prompts read and checked
    before any model loads; ``params``: the training's sampling settings."""
    if not config.eval_every:
        refuse_idle_eval_options(config, EVAL_OPTIONS, "evaluation during training is on with --eval-every N")
        return None
    if config.weight_sync_interval != 1:
        raise PluginError(
            f"--eval-every measures the policy the sampler holds, which --weight-sync-interval {config.weight_sync_interval} "
            "leaves behind the trained one: evaluate the checkpoints with grpo-core eval instead"
        )
    eval_config = held_out_config(config)
    dataset = load_dataset(eval_config, selection.rewards_needing_answer)
    check_prompt_lengths(dataset, selection.plugins["rollout"][0], tokenizer, max_context, config.max_completion_tokens)
    if not dataset.prompts:
        raise PluginError(f"--eval-dataset {eval_config.dataset}: no prompts to evaluate on")
    return TrainingEval(
        selection=selection,
        prompts=dataset.prompts,
        every=config.eval_every,
        num_samples=config.eval_samples,
        threshold=config.eval_pass_threshold,
        params=params,
        sequences_per_call=config.prompt_groups_per_step * config.completions_per_prompt,
        reward_timeout=config.reward_timeout,
        total_steps=total_steps,
    )


def evaluate_before_training(r: Any) -> None:
    """Step 0's evaluation of a new run (``--eval-every``), observed by every plugin as step 0."""
    if r.evaluator is None or r.state.step > 0:
        return
    metrics = r.evaluator(r.state.rng)
    r.selection.manager.hook.on_step(step=0, metrics=metrics, state=r.state, groups=[])
