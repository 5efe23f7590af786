"""``grpo-core eval``: mean reward and pass@k of a model on a dataset, to measure before and after."""

from __future__ import annotations

import math
from typing import Any

from grpo_core.config import RunConfig
from grpo_core.loop import load_dataset, sampling_params, seed_everything
from grpo_core.selection import select_plugins
from grpo_core.stages import score_groups


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples of which ``correct`` passed (Chen et al. 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def evaluate(config: RunConfig, num_samples: int, batch_size: int, threshold: float, progress: Any = None) -> dict[str, float]:
    seed_everything(config.seed, config.threads)
    selection = select_plugins(config)
    prompts = load_dataset(config)
    pm = selection.manager
    trainer = pm.hook.make_trainer(config=config)
    sampler = pm.hook.make_sampler(config=config, trainer=trainer)
    params = sampling_params(config)
    rewards: list[float] = []
    passes: dict[int, list[float]] = {1: [], num_samples: []}
    failed = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        groups = pm.hook.rollout(prompts=batch, num_samples=num_samples, sampler=sampler, params=params)
        failed += int(score_groups(selection, groups, max_failures_in_a_row=math.inf)["reward/failed"])
        for group in groups:
            scores = [s.reward for s in group if s.reward is not None]
            rewards.extend(scores)
            correct = sum(score >= threshold for score in scores)
            for k in passes:
                passes[k].append(pass_at_k(len(group), correct, k) if group else 0.0)
        if progress is not None:
            progress(len(batch), len(prompts), sum(rewards) / max(len(rewards), 1))
    result = {
        "prompts": float(len(prompts)),
        "samples_per_prompt": float(num_samples),
        "reward/mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "reward/failed": float(failed),
    }
    for k, values in sorted(passes.items()):
        result[f"pass@{k}"] = sum(values) / len(values)
    return result
