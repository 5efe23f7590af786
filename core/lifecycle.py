"""The run's lifecycle, shared by both loops, in the order a run lives: prepare (hold the run
folder), start (check every input, build the plugins, resume), guard (signals, the failure
checkpoint), the end of each step (count it, sync, observe it, checkpoint it) and finish (the last
checkpoint, the final policy and the summary). The checks before anything loads are
``grpo_core.preflight``'s, the disk plan ``grpo_core.disk_plan``'s, the summary's words
``grpo_core.outcome``'s.

Everything that keeps a run from being lost is here; ``grpo_core.loop`` (the synchronous recipe)
and ``grpo_core.async_loop`` only schedule steps.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import random
import signal
import sys
import threading
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
    read_unobserved,
    remove_partial,
    save_checkpoint,
    save_policy,
    wait_for_checkpoint,
    write_unobserved,
)
from grpo_core.config import RunConfig, default_threads
from grpo_core.data import check_prompt_lengths, load_dataset, rows_fingerprint, write_prompt_settings
from grpo_core.disk_plan import plan_disk
from grpo_core.errors import EXIT_CODES, PluginError
from grpo_core.hookspecs import declared
from grpo_core.measure import training_eval
from grpo_core.metrics import Metrics, scope
from grpo_core.mixture import parse_mix, shares
from grpo_core.outcome import nothing_trained, policy_saved, summarize
from grpo_core.plugins_manager import write_config
from grpo_core.preflight import check_model_folder, check_router_replay, plan_steps, resume_point
from grpo_core.run_dir import (
    DATA_FILE,
    LOCK_FILE,
    StartUp,
    check_new_run_dir,
    check_same_data,
    choose_run_dir,
    config_strings,
    entries_read,
    locked,
    record_data,
    record_files,
)
from grpo_core.selection import Selection, select_plugins
from grpo_core.types import RunState, SamplingParams


class NonFiniteSteps(PluginError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class RunFailed(Exception):
    """A run stopped by an error after it started training; says what was saved."""

    def __init__(self, cause: BaseException, saved: str) -> None:
        super().__init__(f"{cause}")
        self.cause = cause
        self.saved = saved


@attrs.define
class Run:
    """Everything a run's steps use, ready to go; what changes as it goes is in ``state``."""

    config: RunConfig
    selection: Any
    trainer: Any
    reference: Any
    sampler: Any
    state: RunState
    batches: Iterator[list[Any]]
    params: SamplingParams
    evaluator: Any = None
    """``--eval-every``: what evaluates the policy between steps (a :class:`TrainingEval`; sft's held-out loss)."""


# --- prepare: the run folder, before anything loads ---------------------------------------------


STARTING: contextvars.ContextVar[StartUp] = contextvars.ContextVar("STARTING")
"""The start of the run this thread is running: ``own_run_dir`` opens it, ``start_run`` writes
through it, ``guard_run`` closes it (the loops call the three in turn)."""


@contextlib.contextmanager
def own_run_dir(config: RunConfig, resume: bool, overwrite: bool) -> Iterator[None]:
    """Hold the run folder for the run's whole lifetime (see ``grpo_core.run_dir``); from here on
    ``config.run_dir`` names it. A new run's folder is checked here: empty but for what the run
    reads, or a run to overwrite. A refusal before training begins undoes what this invocation wrote."""
    path = choose_run_dir(config.run_dir)
    config.run_dir = str(path)
    with locked(path):
        start = StartUp(path, {p.name for p in path.iterdir()} - {LOCK_FILE})
        if resume:
            start.kept = {name: (path / name).read_bytes() for name in ("config.json", DATA_FILE) if (path / name).is_file()}
        else:
            start.replaced = check_new_run_dir(path, overwrite, entries_read(path, config_strings(config.to_dict())))
        token = STARTING.set(start)
        try:
            yield
        except BaseException:
            start.undo()
            raise
        finally:
            if start.begun and path.is_dir():
                record_files(path)
            STARTING.reset(token)


def seed_everything(seed: int, threads: int | None = None) -> None:
    import torch

    torch.set_num_threads(threads or default_threads())
    random.seed(seed)
    torch.manual_seed(seed)


def sampling_params(config: RunConfig) -> SamplingParams:
    return SamplingParams(
        max_tokens=config.max_completion_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=list(config.stop),
    )


# --- start: every check, then the models, the plugins and a resumed state ------------------------


def start_run(config: RunConfig, resume: bool, overwrite: bool) -> Run:
    """Check every input before anything heavy loads, then build the models and, when resuming,
    restore the newest checkpoint. The loop has checked its settings (``check_settings``) and
    holds the run folder (``own_run_dir``); nothing in it changes before every check passed and
    every plugin but the loggers started (what a refusal after that wrote is undone, see :class:`grpo_core.run_dir.StartUp`)."""
    seed_everything(config.seed, config.threads)
    check_model_folder(config.model)
    selection = select_plugins(config)
    pm = selection.manager
    pm.hook.check_config(config=config, plugins=selection.plugins)
    dataset = load_dataset(config, selection.rewards_needing_answer, refetch=not resume)
    tokenizer, max_context = pm.hook.load_tokenizer(config=config)
    check_prompt_lengths(dataset, selection.plugins["rollout"][0], tokenizer, max_context, config.max_completion_tokens)
    total_steps = plan_steps(config, len(dataset.prompts))
    evaluator = training_eval(config, selection, tokenizer, max_context, total_steps, sampling_params(config))
    run_dir = Path(str(config.run_dir))
    trainer, newest, rows = resume_point_and_trainer(config, selection, dataset, total_steps, resume)
    # Made before any checkpoint loads: the reference is the initial policy.
    reference = pm.hook.make_reference(config=config, trainer=trainer) if selection.needs_reference else None
    sampler = pm.hook.make_sampler(config=config, trainer=trainer)
    check_router_replay(config, trainer, sampler)
    if config.loop == "async" and not declared(sampler, "sampler object", "own_weights"):
        sampler_name = config.sampler or f"the {config.backend} backend's default"
        raise PluginError(f"--loop async samples while the trainer trains: the sampler ({sampler_name}) shares the trainer's weights")
    state = RunState(run_dir=run_dir, total_steps=total_steps, data=dataset.counts)
    unobserved = resume_state(newest, selection, trainer, sampler, state) if newest is not None else None
    run_info = {"trainer": declared(trainer, "trainer object", "run_info"), "sampler": declared(sampler, "sampler object", "run_info")}
    open_run_folder(config, selection, state, newest is not None, rows, dataset.fetched, run_info, unobserved)
    state.rng = capture_rng(sampler)
    order = dataset.batches(config.prompt_groups_per_step, config.epochs, config.seed, config.shuffle)
    r = Run(config, selection, trainer, reference, sampler, state, islice(order, state.step, None), sampling_params(config), evaluator)
    if evaluator is not None:
        evaluator.sampler = sampler
    if unobserved is not None:
        # The stopped run counted this step but failed before every plugin observed it: they do now
        # (its metrics as recorded; its samples are not kept), so each step is recorded once.
        pm.hook.on_step(step=state.step, metrics=unobserved, state=state, groups=[])
    if keeps_no_state(sampler):
        # A sampler that keeps no state of its own (a server) gets the weights it must sample
        # from, checked, before the first step: the resumed policy, or the one it may not have.
        sync_weights(r, state.step)
    return r


def resume_point_and_trainer(
    config: RunConfig, selection: Any, dataset: Any, total_steps: int, resume: bool
) -> tuple[Any, Path | None, tuple[str, int, str]]:
    """The backend's trainer; with it, the checkpoint a resumed run continues from (its rows checked
    unchanged), and the rows' name, count and fingerprint (what data.json records)."""
    run_dir = Path(str(config.run_dir))
    newest = resume_point(run_dir, total_steps) if resume else None
    rows = (dataset.name, len(dataset.prompts), rows_fingerprint(dataset.prompts))
    if newest is not None:
        check_same_data(run_dir, *rows)
    return make_trainer(config, selection, newest, total_steps), newest, rows


def make_trainer(config: RunConfig, selection: Any, newest: Path | None, total_steps: int) -> Any:
    """The backend's trainer, once the disk plan says its checkpoints fit (printed)."""
    backend = selection.plugins["backend"][0]
    replaced = STARTING.get().replaced
    disk = plan_disk(config, backend, newest, total_steps, replaced)
    trainer = selection.manager.hook.make_trainer(config=config, needs_reference=selection.needs_reference)
    trainer_bytes = declared(trainer, "trainer object", "checkpoint_bytes")
    if disk is None or trainer_bytes is not None:  # a hub model is in the cache now; the trainer knows best
        disk = plan_disk(config, backend, newest, total_steps, replaced, trainer_bytes)
    unknown = "disk plan: the checkpoints' size is unknown (no safetensors weights to count)"
    print(disk.line() if disk is not None else unknown, file=sys.stderr)
    return trainer


def resume_state(newest: Path, selection: Selection, trainer: Any, sampler: Any, state: RunState) -> dict[str, float] | None:
    """Trainer, sampler (None where a recipe samples nothing), group filters and ``state`` as the
    checkpoint ``newest`` left them; the metrics of its step if not every plugin observed it (see :func:`end_step`)."""
    load_checkpoint(newest, trainer, sampler, state)
    restore_filter_states(selection, state)
    state.reward_failures.in_a_row = state.reward_failures_in_a_row
    state.start_step = state.step
    return read_unobserved(newest)


def open_run_folder(
    config: RunConfig,
    selection: Any,
    state: RunState,
    resumed: bool,
    rows: tuple[str, int, str],
    fetched: list[Any],
    run_info: dict[str, Any],
    unobserved: dict[str, float] | None,
) -> None:
    """Start the plugins, then write the run's folder: config.json, data.json (``rows``: the
    dataset's name, row count and fingerprint; ``fetched``: the URLs its rows came from); what
    ``--overwrite`` replaces goes aside first."""
    run_dir = state.run_dir
    observed = state.step - 1 if unobserved is not None else state.step
    start_args = dict(config=config, run_dir=run_dir, total_steps=state.total_steps, start_step=observed)
    # Plugins start (a teacher, a reward model load and check) before the folder changes; loggers,
    # which write in it, once config.json is there (wandb records it).
    loggers = [id(p) for p in selection.plugins.get("logger", [])]
    start_plugins(selection.manager, lambda plugin: id(plugin) not in loggers, start_args)
    if resumed:
        remove_partial(run_dir)
    STARTING.get().replace_old_run()
    write_config(config, run_dir / "config.json", run_info)
    record_data(run_dir, *rows, [f.record() for f in fetched])
    start_plugins(selection.manager, lambda plugin: id(plugin) in loggers, start_args)
    record_files(run_dir)


def restore_filter_states(selection: Selection, state: RunState) -> None:
    """Hand each group filter the state the resumed checkpoint holds for it."""
    for name, saved in state.filter_states.items():
        if name not in selection.group_filters:
            continue  # --group-filter is a setting --resume keeps: a filter gone is one that kept no state
        load = declared(selection.group_filters[name], "group_filter", "load_state_dict")
        if load is None:
            raise PluginError(f"group filter '{name}' has a state_dict but no load_state_dict: a resumed run cannot give it its state")
        load(saved)


def start_plugins(pm: Any, chosen: Callable[[Any], bool], args: dict[str, Any]) -> None:
    """``on_run_start`` of the plugins ``chosen`` picks, in the order pluggy calls them (plugins are
    attrs classes, unhashable: ``subset_hook_caller`` cannot take them)."""
    for impl in reversed(pm.hook.on_run_start.get_hookimpls()):
        if chosen(impl.plugin):
            impl.function(*(args[name] for name in impl.argnames))


# --- guard: signals and the failure checkpoint, while steps run -----------------------------------


@contextlib.contextmanager
def guard_run(state: RunState, config: RunConfig, trainer: Any) -> Iterator[None]:
    """SIGINT and SIGTERM end the run after the current step (a second one at once); any error
    after the first step leaves a checkpoint of the last completed step and says how to resume."""
    STARTING.get().begin()
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


def save_after_failure(state: RunState, config: RunConfig, trainer: Any) -> str:
    if state.step == 0:
        return "no step was completed, nothing to save"
    try:
        path = write_checkpoint(state, config, trainer)
    except PluginError as exc:
        valid = complete_checkpoints(state.run_dir)
        said = f"no checkpoint written ({exc})" + (f"; the newest valid one is {valid[-1]}" if valid else "")
        try:
            final = save_final(state, config, trainer)
        except CheckpointError as policy_exc:
            return f"{said}; {policy_exc}: the weights trained since are lost"
        return f"{said}; {policy_saved(state, final)}"
    return f"steps 1-{state.step} are saved in {path}; continue with: grpo-core {config.command} --resume {state.run_dir}"


# --- step: the end of each step, the same in both loops -------------------------------------------


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

    The weight sync has this one place (every ``weight_sync_interval`` steps, never with 0), and one failure
    rule: it runs once the step is counted, so a sync that fails stops the run with the
    checkpoint of the whole step (its weights, its RNGs, the sampler as the failed sync left it);
    a resumed run sends a server sampler the weights before its first step. A step counted but
    not observed (the sync or a plugin's ``on_step`` raised) is checkpointed with its metrics
    (``state.unobserved``), which the resumed run hands its plugins first: every step is
    recorded once.

    ``quiet_sampler()`` gives the sampler with no generation running (the async loop's), for the
    sync and the RNGs a checkpoint holds; ``counted()`` runs once the step is counted and synced,
    before any plugin sees it (the async loop writes its state of the step there).
    """
    state, config = r.state, r.config
    metrics["policy/version"] = r.trainer.version
    if step == 1:
        metrics.update({k: float(v) for k, v in state.data.items()})
    if config.mix:
        metrics.update(shares([source.name for source in parse_mix(config.mix)], metrics, config.drawn))
    with scope() as synced, quiet_sampler() if quiet_sampler else contextlib.nullcontext(r.sampler) as sampler:
        count_step(state, metrics, config.max_nonfinite_steps_in_a_row, config.tracked)
        state.unobserved = metrics  # until on_step returns, a checkpoint of this step carries its record
        try:
            if sampler is not None and config.weight_sync_interval and step % config.weight_sync_interval == 0:
                synced.merge(sync_weights(r, step))
        finally:
            state.rng = capture_rng(sampler)
    metrics.update(synced.as_dict())
    state.groups_trained += metrics.get("groups/kept", 0.0)
    state.samples_kept += metrics.get("train/samples", 0.0)
    state.samples_masked_truncated += metrics.get("completion/masked_truncated", 0.0)
    state.tokens_trained += metrics.get("train/tokens", 0.0)
    for key, count in metrics.items():
        if key.startswith("groups/dropped_") or key == "groups/skipped":
            reason = key.removeprefix("groups/dropped_").removeprefix("groups/")
            state.groups_dropped[reason] = state.groups_dropped.get(reason, 0.0) + count
    if counted is not None:
        counted()
    if r.evaluator is not None and r.evaluator.due(step):
        metrics.update(r.evaluator(state.rng))
    r.selection.manager.hook.on_step(step=step, metrics=metrics, state=state, groups=groups)
    state.unobserved = None
    keep_filter_states(r.selection, state)
    # The run's last step is left to its end, which writes it in place: a copy for a background
    # write would be waited for at once.
    last = step == config.max_steps or state.interrupted or state.stop_reason is not None
    if config.checkpoint_every and step % config.checkpoint_every == 0 and not last:
        write_checkpoint(state, config, r.trainer, background=True)
    record_files(state.run_dir)
    if state.interrupted:
        state.request_stop(f"interrupted after step {step}")
    return state.stop_reason is not None


def keep_filter_states(selection: Selection, state: RunState) -> None:
    """Each group filter's ``state_dict()`` as this step left it: what its checkpoint holds."""
    for name, plugin in selection.group_filters.items():
        state_dict = declared(plugin, "group_filter", "state_dict")
        if state_dict is not None:
            state.filter_states[name] = state_dict()


def count_step(state: RunState, metrics: dict[str, float], max_nonfinite: int, tracked: str = "reward") -> None:
    """The step's weights are in place: count it (or stop the run after too many skipped ones);
    ``tracked``: the ``TRACKED/total`` metric the summary compares (the config's ``tracked``)."""
    skipped = metrics.get("optim/skipped_nonfinite", 0.0) > 0
    state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if skipped else 0
    if state.nonfinite_in_a_row >= max_nonfinite:
        raise NonFiniteSteps(
            f"the loss or gradient norm was non-finite in {state.nonfinite_in_a_row} steps in a row "
            f"(those optimizer steps were skipped); last: loss {metrics.get('loss/total')}, grad norm {metrics.get('optim/grad_norm')}"
        )
    state.step += 1
    state.reward_failures_in_a_row = state.reward_failures.in_a_row
    value = metrics[f"{tracked}/total"]
    state.history.append(value if math.isfinite(value) else None)


def sync_weights(r: Run, step: int) -> Metrics:
    """Bring the trainer's weights to the sampler (at the end of a step, see :func:`end_step`; at
    start and at the end for a server). Returns what the sync recorded (``sync/*``,
    ``time/weight_sync``)."""
    with scope() as metrics:
        r.state.policy_version = r.selection.manager.hook.weight_sync(trainer=r.trainer, sampler=r.sampler, step=step)
    return metrics


def keeps_no_state(sampler: Any) -> bool:
    """A sampler that checkpoints nothing of its own (a server) holds whatever weights it was last sent."""
    return declared(sampler, "sampler object", "stateless")


def write_checkpoint(state: RunState, config: RunConfig, trainer: Any, background: bool = False) -> Path:
    """The checkpoint of ``state.step``; ``background``: written while training goes on where the
    trainer can snapshot its state (a periodic one: the end of a run and a failure wait for theirs)."""
    path = save_checkpoint(
        state,
        trainer,
        lambda folder: (write_prompt_settings(folder, config), write_unobserved(folder, state.unobserved)),
        config.keep_checkpoints,
        background,
    )
    if not background:
        wait_for_checkpoint(state.run_dir)
    return path


# --- finish: the last checkpoint, final/ and the summary ------------------------------------------


def finish_run(r: Run, config: RunConfig, started: float) -> dict[str, Any]:
    """The last checkpoint, ``final/``, the summary (also as summary.json), and the loggers' end."""
    state = r.state
    if keeps_no_state(r.sampler) and state.policy_version != r.trainer.version:
        sync_weights(r, state.step)  # a server goes on serving the final policy
    # Under the same signal rule as a step: a signal lets final/ be written whole, a second one
    # stops at once (the checkpoint is written first: --resume then writes final/ only).
    restore_signals = stop_on_signals(state)
    try:
        checkpoint, unsaved = last_checkpoint(state, config, r.trainer)
        try:
            final = save_final(state, config, r.trainer)
        except CheckpointError as exc:
            if unsaved is None:
                raise
            raise CheckpointError(f"{unsaved}; {exc}: the weights trained since are lost") from exc
    finally:
        restore_signals()
    # Decided before the summary is written, so that summary.json holds the exit code the run ends with.
    failure: PluginError | None = CheckpointError(f"{unsaved}; {policy_saved(state, final)}") if unsaved is not None else None
    if failure is None and (problem := nothing_trained(r)):
        failure = PluginError(problem)
    summary = summarize(state, started, final, checkpoint, config.tracked, failed=failure is not None)
    (state.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    r.selection.manager.hook.on_run_end(summary=summary, run_dir=state.run_dir)
    if failure is not None:
        raise failure
    return summary


def last_checkpoint(state: RunState, config: RunConfig, trainer: Any) -> tuple[Path | None, CheckpointError | None]:
    """The run's last checkpoint, or why it could not be written: the policy is saved either way."""
    try:
        return (write_checkpoint(state, config, trainer) if state.step else None), None
    except CheckpointError as exc:
        return None, exc


def save_final(state: RunState, config: RunConfig, trainer: Any) -> str:
    """``final/``; after a checkpoint that failed (a full disk: its partial write is gone, and the
    policy alone is smaller) the one copy of the trained weights."""
    return save_policy(state.run_dir / "final", lambda path: save_for_sampler(trainer, config, path))


def save_for_sampler(trainer: Any, config: RunConfig, path: str) -> None:
    trainer.save_weights_for_sampler(path)
    write_prompt_settings(path, config)
