"""The run's lifecycle, shared by both loops: start (check every input, build the plugins, resume),
guard (signals, the failure checkpoint), the end of a step (count it, observe it, checkpoint it)
and finish (the final policy and the summary).

Everything that keeps a run from being lost is here; ``grpo_core.loop`` (the synchronous recipe)
and ``grpo_core.async_loop`` only schedule steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import attrs

from grpo_core.checkpoint import (
    CheckpointError,
    capture_rng,
    complete_checkpoints,
    load_checkpoint,
    remove_partial,
    save_checkpoint,
    save_policy,
)
from grpo_core.config import RunConfig, default_threads
from grpo_core.data import check_prompt_lengths, load_dataset, prompt_batches, steps_available, write_prompt_settings
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.metrics import Metrics, scope
from grpo_core.plugins_manager import write_config
from grpo_core.selection import select_plugins
from grpo_core.types import LoopState, RunState, SamplingParams

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class NonFiniteSteps(PluginError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class RunFailed(Exception):
    """A run stopped by an error after it started training; says what was saved."""

    def __init__(self, cause: BaseException, saved: str) -> None:
        super().__init__(f"{cause}")
        self.cause = cause
        self.saved = saved


def keeps_no_state(sampler: Any) -> bool:
    """A sampler that checkpoints nothing of its own (a server) holds whatever weights it was last sent."""
    return declared(sampler, "sampler object", "stateless")


def sync_weights(r: Run, step: int) -> Metrics:
    """Bring the trainer's weights to the sampler (at the end of a step, see :func:`end_step`; at
    start and at the end for a server). Returns what the sync recorded (``sync/*``,
    ``time/weight_sync``)."""
    with scope() as metrics:
        r.state.loop.policy_version = r.selection.manager.hook.weight_sync(trainer=r.trainer, sampler=r.sampler, step=step)
    return metrics


def finish_run(r: Run, config: RunConfig, started: float) -> dict[str, Any]:
    """The last checkpoint, ``final/``, the summary (also as summary.json), and the loggers' end."""
    state = r.state
    if keeps_no_state(r.sampler) and state.loop.policy_version != r.trainer.version:
        sync_weights(r, state.step)  # a server goes on serving the final policy
    checkpoint = write_checkpoint(state, config, r.trainer) if state.step else None
    final = save_policy(state.run_dir / "final", lambda path: save_for_sampler(r.trainer, config, path))
    summary = summarize(state, started, final, checkpoint)
    (state.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    r.selection.manager.hook.on_run_end(summary=summary, run_dir=state.run_dir)
    return summary


@attrs.define
class Run:
    """Everything a run's steps use, ready to go."""

    config: RunConfig
    selection: Any
    trainer: Any
    reference: Any
    sampler: Any
    state: RunState
    batches: Iterator[list[Any]]
    params: SamplingParams


def start_run(config: RunConfig, resume: bool, overwrite: bool) -> Run:
    """Check every input before anything heavy loads, then build the models and, when resuming,
    restore the newest checkpoint. The loop has checked its settings (``check_settings``)."""
    seed_everything(config.seed, config.threads)
    selection = select_plugins(config)
    pm = selection.manager
    dataset = load_dataset(config, selection.rewards_needing_answer)
    tokenizer, max_context = pm.hook.load_tokenizer(config=config)
    check_prompt_lengths(dataset, selection.plugins["rollout"][0], tokenizer, max_context, config.max_completion_tokens)
    total_steps = plan_steps(config, len(dataset.prompts))
    run_dir = check_run_dir(config.run_dir, resume, overwrite)
    trainer = pm.hook.make_trainer(config=config)
    # Made before any checkpoint loads: the reference is the initial policy.
    reference = pm.hook.make_reference(config=config, trainer=trainer) if selection.needs_reference else None
    sampler = pm.hook.make_sampler(config=config, trainer=trainer)
    make_run_dir(run_dir, resume)
    run_info = {"trainer": declared(trainer, "trainer object", "run_info"), "sampler": declared(sampler, "sampler object", "run_info")}
    write_config(config, run_dir / "config.json", run_info)
    state = RunState(run_dir=run_dir, total_steps=total_steps, data=dataset.counts)
    if resume:
        state.loop = resume_from(run_dir, trainer, sampler, total_steps)
        selection.reward_failures_in_a_row = state.loop.reward_failures_in_a_row
    state.rng = capture_rng(sampler)
    order = prompt_batches(dataset.prompts, config.prompt_groups_per_step, config.epochs, config.seed, config.shuffle)
    r = Run(config, selection, trainer, reference, sampler, state, islice(order, state.step, None), sampling_params(config))
    pm.hook.on_run_start(config=config, run_dir=run_dir, total_steps=total_steps, start_step=state.step)
    if keeps_no_state(sampler):
        # A sampler that keeps no state of its own (a server) gets the weights it must sample
        # from, checked, before the first step: the resumed policy, or the one it may not have.
        sync_weights(r, state.step)
    return r


def count_step(state: RunState, selection: Any, metrics: dict[str, float], max_nonfinite: int) -> None:
    """The step's weights are in place: count it (or stop the run after too many skipped ones)."""
    skipped = metrics.get("optim/skipped_nonfinite", 0.0) > 0
    state.loop.nonfinite_in_a_row = state.loop.nonfinite_in_a_row + 1 if skipped else 0
    if state.loop.nonfinite_in_a_row >= max_nonfinite:
        raise NonFiniteSteps(
            f"the loss or gradient norm was non-finite in {state.loop.nonfinite_in_a_row} steps in a row "
            f"(those optimizer steps were skipped); last: loss {metrics.get('loss/total')}, grad norm {metrics.get('optim/grad_norm')}"
        )
    state.loop.step += 1
    state.loop.reward_failures_in_a_row = selection.reward_failures_in_a_row
    reward = metrics["reward/total"]
    state.loop.history.append(reward if math.isfinite(reward) else None)


def end_step(
    r: Run,
    step: int,
    metrics: dict[str, float],
    groups: Any,
    quiet_sampler: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    counted: Callable[[], None] | None = None,
) -> bool:
    """The end of a step, the same in both loops: count it, sync the weights when due, let every
    plugin observe it, checkpoint it when due. Returns whether the run stops after it.

    The weight sync has this one place (every ``weight_sync_interval`` steps), and one failure
    rule: it runs once the step is counted, so a sync that fails stops the run with the
    checkpoint of the whole step (its weights, its RNGs, the sampler as the failed sync left it;
    no plugin observed the step, so its metrics record is not written); a resumed run sends a
    server sampler the weights before its first step.

    ``quiet_sampler()`` gives the sampler with no generation running (the async loop's), for the
    sync and the RNGs a checkpoint holds; ``counted()`` runs once the step is counted and synced,
    before any plugin sees it (the async loop writes its state of the step there).
    """
    state, config = r.state, r.config
    metrics["policy/version"] = r.trainer.version
    if step == 1:
        metrics.update({k: float(v) for k, v in state.data.items()})
    with scope() as synced, quiet_sampler() if quiet_sampler else contextlib.nullcontext(r.sampler) as sampler:
        count_step(state, r.selection, metrics, config.max_nonfinite_steps_in_a_row)
        try:
            if step % config.weight_sync_interval == 0:
                synced.merge(sync_weights(r, step))
        finally:
            state.rng = capture_rng(sampler)
    metrics.update(synced.as_dict())
    if counted is not None:
        counted()
    r.selection.manager.hook.on_step(step=step, metrics=metrics, state=state, groups=groups)
    if config.checkpoint_every and step % config.checkpoint_every == 0:
        write_checkpoint(state, config, r.trainer)
    if state.interrupted:
        state.request_stop(f"interrupted after step {step}")
    return state.stop_reason is not None


def write_checkpoint(state: RunState, config: RunConfig, trainer: Any) -> Path:
    return save_checkpoint(
        state.run_dir,
        state.loop,
        trainer,
        state.rng or {},
        lambda folder: write_prompt_settings(folder, config),
        config.keep_checkpoints,
    )


@contextlib.contextmanager
def guard_run(state: RunState, config: RunConfig, trainer: Any) -> Iterator[None]:
    """SIGINT and SIGTERM end the run after the current step (a second one at once); any error
    after the first step leaves a checkpoint of the last completed step and says how to resume."""
    restore_signals = stop_on_signals(state)
    try:
        yield
    except KeyboardInterrupt:
        state.signal = state.signal or signal.SIGINT
        state.request_stop(f"interrupted during step {state.step + 1}; saved after step {state.step}")
    except Exception as exc:
        raise RunFailed(exc, save_after_failure(state, config, trainer)) from exc
    finally:
        restore_signals()


def save_after_failure(state: RunState, config: RunConfig, trainer: Any) -> str:
    if state.step == 0:
        return "no step was completed, nothing to save"
    try:
        path = write_checkpoint(state, config, trainer)
    except PluginError as exc:
        valid = complete_checkpoints(state.run_dir)
        return f"no checkpoint written ({exc})" + (f"; the newest valid one is {valid[-1]}" if valid else "")
    return f"steps 1-{state.step} are saved in {path}; continue with: grpo-core run --resume {state.run_dir}"


def stop_on_signals(state: RunState) -> Any:
    """Make the first SIGINT/SIGTERM end the run after the current step, and a second one at once.

    A flag read between steps, not an exception raised wherever the signal lands: a
    KeyboardInterrupt raised inside library code can be swallowed there (it was, now and then,
    with 10 ms steps), and a step cut in half leaves nothing worth keeping. Returns the function
    that puts the previous handlers back.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set signal handlers
    previous = {sig: signal.getsignal(sig) for sig in EXIT_CODES}

    def on_signal(signum: int, frame: Any) -> None:
        if state.interrupted:
            raise KeyboardInterrupt
        state.signal = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name}: stopping after this step and saving (again to stop now)", file=sys.stderr, flush=True)

    for sig in EXIT_CODES:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def check_settings(config: RunConfig) -> None:
    """Settings no step can honour, refused before anything loads (both loops)."""
    if config.temperature == 0:
        raise PluginError("GRPO compares several samples of a prompt: --temperature must be > 0 (0 is greedy, for eval)")
    if config.minibatches_per_step > config.prompt_groups_per_step:
        raise PluginError(
            f"--minibatches-per-step {config.minibatches_per_step} splits a step's groups: it cannot exceed "
            f"--prompt-groups-per-step {config.prompt_groups_per_step}"
        )
    if config.learning_rate == 0:
        print("warning: --learning-rate is 0: the policy will not change", file=sys.stderr)


def seed_everything(seed: int, threads: int | None = None) -> None:
    import torch

    torch.set_num_threads(threads or default_threads())
    random.seed(seed)
    torch.manual_seed(seed)


def plan_steps(config: RunConfig, num_prompts: int) -> int:
    total = steps_available(num_prompts, config.prompt_groups_per_step, config.epochs)
    if total == 0:
        raise PluginError(f"the dataset has {num_prompts} prompts, fewer than prompt_groups_per_step={config.prompt_groups_per_step}")
    return min(total, config.max_steps) if config.max_steps is not None else total


def check_run_dir(requested: str | None, resume: bool, overwrite: bool) -> Path:
    """The run directory, refused when it holds another run (unless resuming or overwriting)."""
    if requested is None:
        base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        return path
    path = Path(requested)
    if path.exists() and not path.is_dir():
        raise PluginError(f"run directory {path} is a file")
    if not resume and not overwrite and path.is_dir() and any(path.iterdir()):
        raise PluginError(
            f"run directory {path} is not empty: continue that run with --resume {path}, "
            "start over with --overwrite, or choose another --run-dir"
        )
    return path


def make_run_dir(path: Path, resume: bool) -> None:
    if not resume and path.is_dir():
        shutil.rmtree(path)  # --overwrite, checked by check_run_dir
    path.mkdir(parents=True, exist_ok=True)


def resume_from(run_dir: Path, trainer: Any, sampler: Any, total_steps: int) -> LoopState:
    remove_partial(run_dir)
    found = complete_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"--resume {run_dir}: no complete checkpoint there; start again with --overwrite")
    loop = load_checkpoint(found[-1], trainer, sampler)
    # A run killed after its last checkpoint but before final/ only has final/ left to write.
    if loop.step >= total_steps and (run_dir / "final").is_dir():
        raise PluginError(
            f"the run in {run_dir} is complete at step {loop.step} of {total_steps}; pass --max-steps > {loop.step} to train further"
        )
    return loop


def save_for_sampler(trainer: Any, config: RunConfig, path: str) -> None:
    trainer.save_weights_for_sampler(path)
    write_prompt_settings(path, config)


def sampling_params(config: RunConfig) -> SamplingParams:
    return SamplingParams(
        max_tokens=config.max_completion_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=list(config.stop),
    )


def summarize(state: RunState, started: float, final: str, checkpoint: Path | None) -> dict[str, Any]:
    """The run's outcome; a short run compares two halves that do not overlap (up to 10 steps each)."""
    history = [r for r in state.loop.history if r is not None and math.isfinite(r)]
    window = min(10, len(history) // 2)
    return {
        "steps": state.step,
        "reward_first": sum(history[:window]) / window if window else None,
        "reward_last": sum(history[-window:]) / window if window else None,
        "window": window,
        "seconds": time.perf_counter() - started,
        "run_dir": str(state.run_dir),
        "final_policy": final,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "stop_reason": state.stop_reason,
        "exit_code": EXIT_CODES.get(state.signal, 0) if state.signal else 0,
        **state.data,
    }
