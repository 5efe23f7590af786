"""The synchronous, on-policy GRPO loop.

``run`` reads top to bottom as the recipe: sample, score, advantages, train, sync, observe.
Each stage is one call; everything a researcher swaps is behind a hook.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from grpo_core.config import RunConfig
from grpo_core.data import DEFAULT_TASK_TEMPLATE, dataset_path, load_prompts, prompt_batches, steps_available
from grpo_core.plugins_manager import PluginError
from grpo_core.selection import select_plugins
from grpo_core.stages import compute_advantages, score_groups, train_on_groups
from grpo_core.types import SamplingParams


@attrs.define
class RunState:
    """What on_step plugins may read and change while the run goes on."""

    run_dir: Path
    step: int = 0
    policy_version: int = 0
    stop_reason: str | None = None
    interrupted: bool = False

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason


def run(config: RunConfig) -> dict[str, Any]:
    started = time.perf_counter()
    if config.temperature == 0:
        raise PluginError("GRPO compares several samples of a prompt: --temperature must be > 0 (0 is greedy, for eval)")
    seed_everything(config.seed, config.threads)
    selection = select_plugins(config)
    prompts = load_dataset(config)
    # Only a run that got past its checks leaves a run directory behind.
    run_dir = make_run_dir(config.run_dir)
    config.write(run_dir / "config.json")
    pm = selection.manager
    trainer = pm.hook.make_trainer(config=config)
    sampler = pm.hook.make_sampler(config=config, trainer=trainer)
    reference = pm.hook.make_reference(config=config, trainer=trainer) if selection.needs_reference else None
    total_steps = steps_available(len(prompts), config.prompt_groups_per_step, config.epochs)
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    if total_steps == 0:
        raise PluginError(f"the dataset has {len(prompts)} prompts, fewer than prompt_groups_per_step={config.prompt_groups_per_step}")
    batches = prompt_batches(prompts, config.prompt_groups_per_step, config.epochs, config.seed, config.shuffle)
    params = sampling_params(config)
    state = RunState(run_dir=run_dir)
    pm.hook.on_run_start(config=config, run_dir=run_dir, total_steps=total_steps)
    history: list[float] = []

    restore_ctrl_c = stop_on_ctrl_c(state)
    try:
        for step, batch in zip(range(1, total_steps + 1), batches):
            t0 = time.perf_counter()
            groups = pm.hook.rollout(prompts=batch, num_samples=config.completions_per_prompt, sampler=sampler, params=params)
            t1 = time.perf_counter()
            reward_metrics = score_groups(selection, groups, config.max_reward_failures_in_a_row)
            kept, advantage_metrics = compute_advantages(pm, groups, config.drop_zero_variance_groups)
            t2 = time.perf_counter()
            train_metrics = train_on_groups(pm, trainer, reference, kept, config, learning_rate(config, step - 1, total_steps))
            if step % config.weight_sync_interval == 0:
                state.policy_version = pm.hook.weight_sync(trainer=trainer, sampler=sampler, step=step)
            t3 = time.perf_counter()

            metrics = {**reward_metrics, **advantage_metrics, **train_metrics}
            metrics.update({"time/sample": t1 - t0, "time/reward": t2 - t1, "time/train": t3 - t2, "time/step": t3 - t0})
            metrics["policy/version"] = trainer.version
            history.append(metrics["reward/total"])
            state.step = step
            pm.hook.on_step(step=step, metrics=metrics, state=state)
            if state.interrupted:
                state.request_stop(f"interrupted after step {step}")
            if state.stop_reason:
                break
    except KeyboardInterrupt:
        # A second Ctrl-C ends the run at once, not the work: the policy so far is still saved.
        state.request_stop(f"interrupted after step {state.step}")
    finally:
        restore_ctrl_c()

    final = trainer.save_weights_for_sampler(str(run_dir / "final"))
    summary = summarize(history, started, run_dir, final, state)
    pm.hook.on_run_end(summary=summary, run_dir=run_dir)
    return summary


def stop_on_ctrl_c(state: RunState) -> Callable[[], None]:
    """Make the first Ctrl-C end the run after the current step, and a second one at once.

    A flag read between steps, not an exception raised wherever the signal lands: a
    KeyboardInterrupt raised inside library code can be swallowed there (it was, now and then,
    with 10 ms steps), and a step cut in half leaves nothing worth keeping. Returns the function
    that puts the previous handler back.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set signal handlers
    previous = signal.getsignal(signal.SIGINT)

    def on_ctrl_c(signum: int, frame: Any) -> None:
        if state.interrupted:
            raise KeyboardInterrupt
        state.interrupted = True
        print("\nCtrl-C: stopping after this step and saving the policy (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, on_ctrl_c)
    return lambda: signal.signal(signal.SIGINT, previous)


def seed_everything(seed: int, threads: int | None = None) -> None:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)


def make_run_dir(requested: str | None) -> Path:
    if requested:
        path = Path(requested)
    else:
        base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_dataset(config: RunConfig):
    template = config.prompt_template
    if template is None:
        template = DEFAULT_TASK_TEMPLATE if config.dataset == "default" else "{prompt}"
    skipped: list[str] | None = [] if config.skip_bad_rows else None
    path = dataset_path(config.dataset)
    prompts = load_prompts(path, config.prompt_field, config.answer_field, template, config.max_rows, skipped)
    if skipped:
        print(f"skipped {len(skipped)} bad rows of {path}; first: {skipped[0]}", file=sys.stderr)
    return prompts


def sampling_params(config: RunConfig) -> SamplingParams:
    return SamplingParams(
        max_tokens=config.max_completion_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=list(config.stop),
    )


def learning_rate(config: RunConfig, step_index: int, total_steps: int) -> float:
    """Linear warmup to the peak, then constant, linear or cosine decay to zero."""
    peak = config.learning_rate
    if step_index < config.warmup_steps:
        return peak * (step_index + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return peak
    decay_steps = max(total_steps - config.warmup_steps, 1)
    progress = min((step_index - config.warmup_steps) / decay_steps, 1.0)
    if config.lr_schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def summarize(history: list[float], started: float, run_dir: Path, final: str, state: RunState) -> dict[str, Any]:
    window = min(10, len(history))
    return {
        "steps": len(history),
        "reward_first": sum(history[:window]) / window if window else float("nan"),
        "reward_last": sum(history[-window:]) / window if window else float("nan"),
        "window": window,
        "seconds": time.perf_counter() - started,
        "run_dir": str(run_dir),
        "final_policy": final,
        "stop_reason": state.stop_reason,
    }

