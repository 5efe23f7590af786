"""The synchronous, on-policy GRPO loop.

``run`` reads top to bottom as the recipe: start the run, then per step sample, score,
advantages, train, and end the step (count, sync, observe, checkpoint). Each stage is one call; everything a researcher swaps
is behind a hook, and everything that keeps a run from being lost (start, signals, checkpoints,
the failure path) is in ``grpo_core.lifecycle``, which the async loop shares.
"""

from __future__ import annotations

import time
from typing import Any

from grpo_core.config import RunConfig
from grpo_core.evaluate import evaluate_before_training
from grpo_core.lifecycle import check_settings, end_step, finish_run, guard_run, start_run
from grpo_core.metrics import scope
from grpo_core.stages import compute_advantages, learning_rate, score_groups, train_step


def run(config: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    if config.loop == "async":
        from grpo_core.async_loop import run_async

        return run_async(config, resume, overwrite)
    started = time.perf_counter()
    check_settings(config)
    r = start_run(config, resume, overwrite)
    pm, state = r.selection.manager, r.state

    with guard_run(state, config, r.trainer):
        evaluate_before_training(r)
        for step, batch in zip(range(state.step + 1, state.total_steps + 1), r.batches):
            t0 = time.perf_counter()
            with scope() as metrics:  # what the sampler and the rollout record
                groups = pm.hook.rollout(
                    prompts=batch, num_samples=config.completions_per_prompt, sampler=r.sampler, params=r.params,
                    **r.selection.rollout_args,
                )  # fmt: skip
            t1 = time.perf_counter()
            metrics.merge(score_groups(r.selection, groups, config.max_reward_failures_in_a_row, config.reward_timeout))
            kept, advantage_metrics = compute_advantages(
                pm, groups, config.drop_zero_variance_groups, r.trainer, config.max_samples_per_fwd_bwd
            )
            metrics.merge(advantage_metrics)
            t2 = time.perf_counter()
            metrics.merge(train_step(pm, r.trainer, r.reference, kept, config, learning_rate(config, step - 1, state.total_steps)))
            t3 = time.perf_counter()
            metrics.update({"time/sample": t1 - t0, "time/reward": t2 - t1, "time/train": t3 - t2, "time/step": t3 - t0}, "sum")
            if end_step(r, step, metrics.as_dict(), groups):
                break

    return finish_run(r, config, started)
