"""The synchronous, on-policy GRPO loop.

``run`` reads top to bottom as the recipe: start the run, then per step sample, score,
advantages, train, and end the step (count, sync, observe, checkpoint). Each stage is one call; everything a researcher swaps
is behind a hook, and everything that keeps a run from being lost (start, signals, checkpoints,
the failure path) is in ``grpo_core.lifecycle``, which the async loop shares.
"""

from __future__ import annotations

import time
from typing import Any

from grpo_core.async_loop import PromptQueue, prompt_stream, run_async
from grpo_core.config import RunConfig
from grpo_core.lifecycle import Run, check_settings, end_step, finish_run, guard_run, own_run_dir, start_run
from grpo_core.measure import evaluate_before_training
from grpo_core.metrics import Metrics, scope
from grpo_core.stages import (
    check_router_replay_model,
    check_sampling_settings,
    compute_advantages,
    learning_rate,
    score_groups,
    train_step,
    warn_untrained,
)
from grpo_core.types import Sample


def run(config: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train; the run folder is held, locked, from the first check to the summary (both loops)."""
    with own_run_dir(config, resume, overwrite):
        if config.loop == "async":
            return run_async(config, resume, overwrite)
        return run_sync(config, resume, overwrite)


def run_sync(config: RunConfig, resume: bool, overwrite: bool) -> dict[str, Any]:
    started = time.perf_counter()
    check_settings(config)
    check_sampling_settings(config)
    check_router_replay_model(config)
    r = start_run(config, resume, overwrite)
    pm, state = r.selection.manager, r.state

    # --dynamic-sampling takes prompts one at a time from the run's order, as the async loop does.
    queue = None
    if config.dynamic_sampling:
        queue = PromptQueue(prompt_stream(r, config.prompt_groups_per_step, state.loop.prompts_taken), state.loop.prompts_taken, [])
    with guard_run(state, config, r.trainer):
        evaluate_before_training(r)
        for step in range(state.step + 1, state.total_steps + 1):
            t0 = time.perf_counter()
            groups, kept, metrics, reward_seconds = sample_groups(r, queue)
            if not groups:
                state.request_stop(f"the prompts ran out after step {state.step}")
                break
            t2 = time.perf_counter()
            metrics.merge(train_step(pm, r.trainer, r.reference, kept, config, learning_rate(config, step - 1, state.total_steps)))
            warn_untrained(step, metrics.as_dict(), config)
            t3 = time.perf_counter()
            metrics.update(
                {"time/sample": t2 - t0 - reward_seconds, "time/reward": reward_seconds, "time/train": t3 - t2, "time/step": t3 - t0}, "sum"
            )
            state.loop.prompts_taken = queue.cursor if queue is not None else 0
            if end_step(r, step, metrics.as_dict(), groups):
                break

    return finish_run(r, config, started)


def sample_groups(r: Run, queue: PromptQueue | None) -> tuple[list[list[Sample]], list[list[Sample]], Metrics, float]:
    """A step's groups (all, and those kept), their metrics and the seconds spent scoring them.

    Without a queue: the step's batch, trained whatever the filters kept. With one
    (``--dynamic-sampling``): rounds of rollouts, each of as many prompts as the step still lacks
    kept groups, until it has ``prompt_groups_per_step`` of them or ``max_sampling_rounds`` rounds
    ran (``sampling/rounds``): the async loop's rule, which fills a step with groups that carry signal.
    """
    config, pm = r.config, r.selection.manager
    wanted = config.prompt_groups_per_step
    groups: list[list[Sample]] = []
    kept: list[list[Sample]] = []
    metrics = Metrics()
    reward_seconds = 0.0
    rounds = 0
    while rounds < (config.max_sampling_rounds if queue is not None else 1):
        batch = next(r.batches, []) if queue is None else [t.prompt for t in queue.take(wanted - len(kept))]
        if not batch:
            break
        rounds += 1
        with scope() as rolled:  # what the sampler and the rollout record
            new = pm.hook.rollout(
                prompts=batch, num_samples=config.completions_per_prompt, sampler=r.sampler, params=r.params, **r.selection.rollout_args
            )
        t1 = time.perf_counter()
        metrics.merge(rolled)
        metrics.merge(score_groups(r.selection, new, config.max_reward_failures_in_a_row, config.reward_timeout))
        new_kept, advantage_metrics = compute_advantages(
            pm, new, config.drop_zero_variance_groups, r.trainer, config.max_samples_per_fwd_bwd, group_filters=r.selection.group_filters
        )
        metrics.merge(advantage_metrics)
        reward_seconds += time.perf_counter() - t1
        groups += new
        kept += new_kept
        if len(kept) >= wanted:
            break
    if queue is not None:
        metrics.add("sampling/rounds", rounds, "sum")
        metrics.add("sampling/prompts", len(groups), "sum")
    return groups, kept, metrics, reward_seconds
