"""The synchronous, on-policy GRPO loop.

``run_sync`` reads top to bottom as the recipe: start the run, then per step take prompts, roll
them out and score them (rewards, advantages, group filters), train, and end the step (count,
sync, observe, checkpoint). Each stage is one call; everything a researcher swaps is behind a
hook, and everything that keeps a run from being lost (start, signals, checkpoints, the failure
path) is in ``grpo_core.lifecycle``, which the async loop shares.
"""

from __future__ import annotations

import time
from typing import Any

from grpo_core.config import RunConfig
from grpo_core.lifecycle import end_step, finish_run, guard_run, start_run
from grpo_core.measure import evaluate_before_training
from grpo_core.metrics import Metrics, scope
from grpo_core.preflight import check_settings
from grpo_core.produce import PromptQueue, Scorer, prompt_admission, prompt_stream, roll_and_score
from grpo_core.stages import check_router_replay_model, check_sampling_settings, learning_rate, record_perf, train_step, warn_untrained


def run_sync(config: RunConfig, resume: bool, overwrite: bool) -> dict[str, Any]:
    """The synchronous loop of a run whose folder ``grpo_core.train.run`` holds."""
    started = time.perf_counter()
    check_settings(config)
    check_sampling_settings(config)
    check_router_replay_model(config)
    r = start_run(config, resume, overwrite)
    pm, state = r.selection.manager, r.state
    scorer = Scorer.for_training(config, r.selection, state.reward_failures, r.trainer)
    # --dynamic-sampling takes prompts one at a time from the run's order, as the async loop does:
    # rounds of rollouts, each of as many prompts as the step still lacks kept groups, until it has
    # prompt_groups_per_step of them or max_sampling_rounds rounds ran (sampling/rounds). So does a
    # group filter's keep_prompt, which passes over prompts of the order (sampling/passed_over).
    queue, admit = None, prompt_admission(r.selection)
    if config.dynamic_sampling or admit is not None:
        stream = prompt_stream(r.batches, state.step * config.prompt_groups_per_step, state.prompts_taken)
        queue = PromptQueue(stream, state.prompts_taken, [], admit)
    wanted, max_rounds = config.prompt_groups_per_step, config.max_sampling_rounds if config.dynamic_sampling else 1
    with guard_run(state, config, r.trainer):
        evaluate_before_training(r)
        for step in range(state.step + 1, state.total_steps + 1):
            t0 = time.perf_counter()
            groups, kept, metrics, reward_seconds, rounds = [], [], Metrics(), 0.0, 0
            while rounds < max_rounds and len(kept) < wanted:
                with scope() as taken:  # what a group filter's keep_prompt records is the step's
                    prompts = next(r.batches, []) if queue is None else [t.prompt for t in queue.take(wanted - len(kept))]
                metrics.merge(taken)
                if not prompts:
                    break
                rounds += 1
                produced = roll_and_score(scorer, prompts, config.completions_per_prompt, r.sampler, r.params)
                metrics.merge(produced.metrics)
                groups, kept, reward_seconds = groups + produced.groups, kept + produced.kept, reward_seconds + produced.reward_seconds
            if config.dynamic_sampling:
                metrics.update({"sampling/rounds": rounds, "sampling/prompts": len(groups)}, "sum")
            if queue is not None and admit is not None:
                metrics.update({"sampling/passed_over": queue.passed_over}, "sum")
                queue.passed_over = 0
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
            record_perf(metrics, r.trainer)
            state.prompts_taken = queue.cursor if queue is not None else 0
            if end_step(r, step, metrics.as_dict(), groups):
                break

    return finish_run(r, config, started)
