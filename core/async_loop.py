"""The asynchronous loop: rollouts run in worker threads while the trainer trains.

Worker threads take prompts, roll them out (one prompt group per rollout call, or one
trajectory per call for a rollout that declares ``per_trajectory``), score them and compute their
advantages; the main thread trains as soon as ``prompt_groups_per_step`` groups with signal have
arrived. A gate bounds staleness: a rollout starts only if its groups can be
trained within ``max_head_offpolicy_versions`` policy versions of the version that sampled
them, and a group that arrives staler than that is never trained: its prompt goes back to the
queue (counted). ``synchronous_training`` rolls out a whole step's batch at once and starts no
rollout while a step trains: the synchronous loop, step for step.

Versions are the trainer's optimizer steps (``trainer.version``), the number every sample
carries in ``policy_version``; a step with ``minibatches_per_step`` K and ``ppo_epochs`` E advances
it by K·E.

The step is the synchronous loop's: the same training (``grpo_core.stages.train_step``) and the
same end (``grpo_core.lifecycle.end_step``: count, weight sync, observe, checkpoint), with the
same start-up checks, signals, failure checkpoint and non-finite guard. The async
state (the prompts taken, those still in flight) is written beside them after every step, in
``RUN_DIR/async/step-N.json``; a resumed run samples the in-flight prompts again before any new
one, so no prompt is skipped or trained twice. ``RUN_DIR/async/groups.jsonl`` records what
became of every prompt group (trained, no signal, re-queued as stale, failed) and when.

Who moves a prompt group from one state to the next (``cond`` guards every arrow)::

        PromptQueue ── data order; prompts sent back come first (queue.again)
            │  a worker, when Gate.admits(): admit()
            ▼
        running ── worker threads: call_rollout() per call (rollout hook → SharedSampler),
            │       then finish(): reward, advantage (Scorer)
            ▼
        arrived ── requeue_stale() (main thread): too old for the next step ──► PromptQueue
            │  main thread, wait_for_batch(): groups_per_step groups with signal
            ▼
        train_step ── under trainer_lock (the policy scores of an advantage wait for it)
            │
            ▼
        end_step ── weight sync with no generation running (SharedSampler.exclusive), then
                    counted(): the gate sees the new version, the ledger and the async state
                    are written, then the checkpoint
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from grpo_core.checkpoint import checkpoint_steps
from grpo_core.config import RunConfig, default_threads
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.lifecycle import Run, end_step, finish_run, guard_run, start_run
from grpo_core.measure import evaluate_before_training
from grpo_core.metrics import Metrics, record, scope
from grpo_core.preflight import check_settings
from grpo_core.produce import PromptQueue, Scorer, Taken, prompt_admission, prompt_stream, roll
from grpo_core.stages import (
    check_router_replay_model,
    check_sampling_settings,
    learning_rate,
    record_perf,
    train_step,
    updates_per_step,
    warn_untrained,
)
from grpo_core.types import Prompt

ASYNC_DIR = "async"
LEDGER = "groups.jsonl"


class RetryableRolloutError(Exception):
    """Raise it from a rollout for a failure worth trying again (a server hiccup, a rate limit)."""


RETRYABLE = (RetryableRolloutError, TimeoutError, ConnectionError)
"""Rollout errors retried with backoff; any other error is a bug and stops the run."""


class SamplerClosed(Exception):
    """The run has ended: a rollout still going gets no more generations."""


class RolloutFailures(PluginError):
    """The circuit breaker: too many rollouts failed in a row, or too large a share of the recent ones."""


def run_async(config: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    check_async_settings(config)
    r = start_run(config, resume, overwrite)
    state = r.state
    loop = AsyncLoop(config, r)
    with guard_run(state, config, r.trainer):
        try:
            evaluate_before_training(r)
            loop.train()
        finally:
            loop.close()

    summary = finish_run(r, config, started)
    prune_async_state(loop.folder, state.step)
    return summary


def check_async_settings(config: RunConfig) -> None:
    """The settings both loops check, then those of the async loop's own."""
    check_settings(config)
    if config.weight_sync_interval == 0:
        raise PluginError(
            "--weight-sync-interval 0 never syncs the sampler: the async loop's bound on staleness "
            "(--max-head-offpolicy-versions) would soon admit no rollout; use --loop sync"
        )
    behind = updates_per_step(config) * (config.weight_sync_interval - 1)
    if not config.synchronous_training and config.max_head_offpolicy_versions < behind:
        raise PluginError(
            f"--weight-sync-interval {config.weight_sync_interval} leaves the sampler up to {behind} versions behind the trainer: "
            f"--max-head-offpolicy-versions must be at least {behind}"
        )
    check_sampling_settings(config)
    check_router_replay_model(config)
    if not 0.0 < config.max_rollout_failure_rate <= 1.0:
        raise PluginError(f"--max-rollout-failure-rate must be in (0, 1], got {config.max_rollout_failure_rate}")


@attrs.define
class Gate:
    """Whether one more rollout may start now. Counts are prompt groups; versions the trainer's."""

    max_offpolicy: int
    groups_per_step: int
    versions_per_step: int
    max_concurrent: int
    sampler_version: int
    next_step_version: int
    """The trainer's version when the next step that is not yet training starts."""
    drain: bool = False
    """synchronous_training: one rollout at a time, and none while a step trains or waits."""
    in_flight: int = 0
    rollouts: int = 0
    ready: int = 0
    """Groups with signal waiting for a step."""
    waiting: int = 0
    """Finished rollouts the trainer has not taken yet."""
    training: bool = False

    def landing_version(self, size: int) -> int:
        """The earliest trainer version that can train the last of ``size`` more groups: every group
        before them goes into an earlier step or the same one."""
        ahead = self.in_flight + self.ready + size - 1
        return self.next_step_version + self.versions_per_step * (ahead // self.groups_per_step)

    def admits(self, size: int) -> bool:
        if self.drain:
            return not self.training and self.in_flight == 0 and self.waiting == 0
        if self.rollouts >= self.max_concurrent:
            return False
        return self.landing_version(size) - self.sampler_version <= self.max_offpolicy


class SharedSampler:
    """The sampler as rollout threads see it.

    A sampler that takes concurrent calls (a server: ``sampler.concurrent_samples`` N > 1) runs
    up to N at once. One that generates one call at a time (the in-process sampler) gets the calls
    that queue up behind a running generation as one batched call (those with the same
    ``num_samples`` and params), so rollouts of one group, or of one trajectory, each still
    generate in batches. A weight sync or a checkpoint of the sampler waits for the running
    generations and holds new ones off. ``version`` is the oldest version the calling thread's
    current rollout sampled from: what a rollout stamps on its samples when it reads
    ``sampler.version``, correct even when a sync lands between two of its calls.
    """

    def __init__(self, sampler: Any) -> None:
        self.inner = sampler
        self.parallel = max(1, declared(sampler, "sampler object", "concurrent_samples"))
        self.busy_seconds = 0.0
        """Wall time during which at least one generation ran."""
        self.calls = 0
        """Generations the sampler ran (batched calls count once)."""
        self._cond = threading.Condition()
        self._active = 0
        self._exclusive = False
        self._closed = False
        self._busy_since = 0.0
        self._queued: list[Call] = []
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin_rollout(self) -> None:
        self._local.oldest = self.inner.version

    @property
    def version(self) -> int:
        oldest = getattr(self._local, "oldest", None)
        return self.inner.version if oldest is None else oldest

    def sample(self, prompts: Any, num_samples: int, params: Any, images: Any = None) -> Any:
        call = Call(list(prompts), num_samples, params, None if images is None else list(images))
        with self._cond:
            self._queued.append(call)
            while not call.done:
                if self._closed:
                    self._queued.remove(call)
                    raise SamplerClosed("the run has ended")
                if not self._exclusive and self._active < self.parallel:
                    self._generate(self._take_batch(call))
                else:
                    self._cond.wait()
        oldest = getattr(self._local, "oldest", None)
        self._local.oldest = call.version if oldest is None else min(oldest, call.version)
        if call.error is not None:
            raise call.error
        return call.result

    def _take_batch(self, own: Call) -> list[Call]:
        """What the calling thread generates now (under the lock): its own call on a sampler that
        batches concurrent calls itself (a server); else the oldest queued call, with every queued
        call it can be generated with."""
        if self.parallel > 1:
            batch = [own]
        else:
            first = self._queued[0]
            batch = [c for c in self._queued if c.num_samples == first.num_samples and c.params == first.params]
        for c in batch:
            self._queued.remove(c)
        return batch

    def _generate(self, batch: list[Call]) -> None:
        """Run one generation for ``batch`` outside the lock (entered and left holding it)."""
        if self._active == 0:
            self._busy_since = time.perf_counter()
        self._active += 1
        self.calls += 1
        version = self.inner.version
        self._cond.release()
        try:
            # Image prompts' tensors go with the batch, a text prompt's as None (only a sampler that takes images gets them).
            images = [i for c in batch for i in (c.images or [None] * len(c.prompts))]
            with_images = {"images": images} if any(i is not None for i in images) else {}
            groups = self.inner.sample([p for c in batch for p in c.prompts], batch[0].num_samples, batch[0].params, **with_images)
            offset = 0
            for c in batch:
                c.result, offset = groups[offset : offset + len(c.prompts)], offset + len(c.prompts)
        except BaseException as exc:
            for c in batch:
                c.error = exc
        finally:
            self._cond.acquire()
            self._active -= 1
            if self._active == 0:
                self.busy_seconds += time.perf_counter() - self._busy_since
            for c in batch:
                c.version, c.done = version, True
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[Any]:
        """The sampler itself, with no generation running (only the main thread asks): a weight
        sync never lands in the middle of a rollout's generation, and a server never serves a mix
        of old and new weights to one. Records ``time/wait_sync``, how long the trainer waited for
        the generations in flight to end (idle time, like ``time/wait``)."""
        asked = time.perf_counter()
        with self._cond:
            self._exclusive = True
            while self._active:
                self._cond.wait()
        record("time/wait_sync", time.perf_counter() - asked, "sum")
        try:
            yield self.inner
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def close(self) -> None:
        """Wait for the running generations and refuse new ones: no thread is left inside torch
        when the process exits (a daemon thread there aborts the interpreter's shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._active:
                self._cond.wait()


@attrs.define(eq=False)
class Call:
    """A rollout's sample call, waiting for a generation or done."""

    prompts: list[Any]
    num_samples: int
    params: Any
    images: list[Any] | None = None
    """Each prompt's image tensors (None for a text prompt), where the rollout passed any."""
    result: Any = None
    error: BaseException | None = None
    version: int = 0
    done: bool = False


@attrs.define(eq=False)
class InFlight:
    """Admitted prompts being rolled out: in ``calls`` rollout calls (one per trajectory for a
    ``per_trajectory`` rollout), whose outcomes gather in ``parts``."""

    taken: list[Taken]
    sampler_version: int
    """The sampler's version when it was admitted."""
    calls: int = 1
    parts: list[Rolled] = attrs.field(factory=list)


@attrs.define
class Rolled:
    """One rollout call's outcome: its groups (None for a dropped sample) or why it failed."""

    groups: list[list[Any]] = attrs.field(factory=list)
    metrics: Metrics = attrs.field(factory=Metrics)
    """What the rollout and the sampler recorded during the call."""
    version: int = 0
    seconds: float = 0.0
    retries: int = 0
    failed: str | None = None


@attrs.define
class Finished:
    """One rollout's outcome: its prompts, and either its scored groups or why it failed."""

    taken: list[Taken]
    version: int = 0
    """The oldest policy version any of its samples came from."""
    groups: list[list[Any]] = attrs.field(factory=list)
    kept: list[list[Any]] = attrs.field(factory=list)
    metrics: Metrics = attrs.field(factory=Metrics)
    sample_seconds: float = 0.0
    reward_seconds: float = 0.0
    retries: int = 0
    dropped_samples: int = 0
    failed: str | None = None


class AsyncLoop:
    def __init__(self, config: RunConfig, r: Run) -> None:
        self.config, self.r = config, r
        self.pm = r.selection.manager
        self.sampler = SharedSampler(r.sampler)
        self.folder = r.state.run_dir / ASYNC_DIR
        self.folder.mkdir(exist_ok=True)
        saved = read_async_state(self.folder, r.state.step) if r.state.step else None
        cursor = saved["cursor"] if saved else r.state.step * config.prompt_groups_per_step
        again = [Taken(i, Prompt(**p)) for i, p in saved["again"]] if saved else []
        stream = prompt_stream(r.batches, r.state.step * config.prompt_groups_per_step, cursor)
        self.queue = PromptQueue(stream, cursor, again, prompt_admission(r.selection))
        self.taken = Metrics()
        """What group filters recorded as the workers took prompts (keep_prompt), since the last step."""
        trim_ledger(self.folder / LEDGER, r.state.step)
        self.ledger = (self.folder / LEDGER).open("a")
        drain = config.synchronous_training
        self.unit = config.prompt_groups_per_step if drain else 1
        rollout = r.selection.plugins["rollout"][0]
        self.calls_per_group = config.completions_per_prompt if declared(rollout, "rollout", "per_trajectory") and not drain else 1
        concurrent = config.max_concurrent or (
            config.prompt_groups_per_step * (config.max_head_offpolicy_versions + 1) * self.calls_per_group
        )
        self.gate = Gate(
            max_offpolicy=config.max_head_offpolicy_versions,
            groups_per_step=config.prompt_groups_per_step,
            versions_per_step=updates_per_step(config),
            max_concurrent=1 if drain else concurrent,
            sampler_version=r.sampler.version,
            next_step_version=r.trainer.version,
            drain=drain,
        )
        self.cond = threading.Condition()
        self.arrived: collections.deque[Finished] = collections.deque()
        self.running: dict[int, InFlight] = {}
        self.trajectories: collections.deque[InFlight] = collections.deque()
        """One entry per trajectory of an admitted group that no worker has started yet."""
        self.error: BaseException | None = None
        self.stopping = False
        self.failures_in_a_row = 0
        self.outcomes: collections.deque[bool] = collections.deque(maxlen=config.rollout_failure_window)
        self.score_lock = threading.Lock()
        self.trainer_lock = threading.Lock()
        """Held while a step changes the trainer's weights; the policy scorer an advantage gets
        (``prepare_advantages``) takes it too, so its scores come from one version."""
        # Rewards and their failure counter are shared by every worker.
        self.scorer = Scorer.for_training(
            config, r.selection, r.state.reward_failures, r.trainer, lock=self.score_lock, trainer_lock=self.trainer_lock
        )
        if r.evaluator is not None:
            r.evaluator.share(self.sampler, self.score_lock)
        self.threads = [
            threading.Thread(target=self.work, daemon=True, name=f"grpo-core-rollout-{i}") for i in range(self.gate.max_concurrent)
        ]

    # The worker threads.

    def work(self) -> None:
        import torch

        # Thread-local in OpenMP: without it a worker would use every core.
        torch.set_num_threads(self.config.threads or default_threads())
        while True:
            with self.cond, scope() as taken:  # has_more asks the group filters' keep_prompt
                while not self.done() and not self.trajectories and not (self.queue.has_more() and self.gate.admits(self.unit)):
                    self.cond.wait()
                if self.done():
                    return
                group = self.trajectories.popleft() if self.trajectories else self.admit(self.queue.take(self.unit))
                self.taken.merge(taken)
                self.gate.rollouts += 1
            try:
                part = self.call_rollout(group)
            except BaseException as exc:  # a bug or a fatal error: the main thread raises it
                self.fail(exc)
                return
            with self.cond:
                self.gate.rollouts -= 1
                group.parts.append(part)
                complete = len(group.parts) == group.calls
                self.cond.notify_all()
            if not complete:
                continue
            try:
                finished = self.finish(group)
            except BaseException as exc:
                self.fail(exc)
                return
            with self.cond:
                del self.running[id(group)]
                self.gate.in_flight -= len(group.taken)
                self.gate.ready += len(finished.kept)
                self.gate.waiting += 1
                self.arrived.append(finished)
                self.count_outcome(finished)
                self.cond.notify_all()

    def admit(self, taken: list[Taken]) -> InFlight:
        """Count the prompts in flight and queue the group's other trajectories (under the lock)."""
        group = InFlight(taken, self.gate.sampler_version, calls=self.calls_per_group)
        self.gate.in_flight += len(taken)
        self.running[id(group)] = group
        self.trajectories.extend([group] * (group.calls - 1))
        return group

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if not self.done():  # else the run has ended (SamplerClosed, or an error already raised)
                self.error = exc
                self.cond.notify_all()

    def done(self) -> bool:
        """Take no more prompts: the run ends, or failed (under the lock)."""
        return self.stopping or self.error is not None

    def call_rollout(self, group: InFlight) -> Rolled:
        """One call of the rollout hook, for the group's prompts or one of its trajectories, retried
        on a retryable error."""
        config = self.config
        num_samples = config.completions_per_prompt if group.calls == 1 else 1
        t0 = time.perf_counter()
        for attempt in range(config.rollout_retries + 1):
            self.sampler.begin_rollout()
            try:
                # What the rollout and the sampler record in this thread; a failed attempt's records go with it.
                groups, metrics = roll(self.r.selection, [t.prompt for t in group.taken], num_samples, self.sampler, self.r.params)
                break
            except RETRYABLE as exc:
                if attempt == config.rollout_retries:
                    return Rolled(retries=attempt, failed=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0)
                time.sleep(config.rollout_retry_backoff * 2**attempt)
        version = min([self.sampler.version, *(s.policy_version for g in groups for s in g if s is not None)])
        return Rolled(groups, metrics, version, time.perf_counter() - t0, attempt)

    def finish(self, group: InFlight) -> Finished:
        """The group's scored samples, from all its calls; a group with a failed call fails."""
        parts = group.parts
        retries, seconds = sum(p.retries for p in parts), sum(p.seconds for p in parts)
        failed = next((p.failed for p in parts if p.failed is not None), None)
        if failed is not None:
            return Finished(group.taken, retries=retries, failed=failed, sample_seconds=seconds)
        # A rollout that works per trajectory may drop one by returning None in its place.
        groups = [[s for p in parts for s in p.groups[i]] for i in range(len(group.taken))]
        dropped = sum(s is None for g in groups for s in g)
        groups = [[s for s in g if s is not None] for g in groups]
        t1 = time.perf_counter()
        kept, metrics = self.scorer(groups)
        for part in parts:
            metrics.merge(part.metrics)
        return Finished(
            group.taken, min(p.version for p in parts), groups, kept, metrics,
            sample_seconds=seconds, reward_seconds=time.perf_counter() - t1, retries=retries, dropped_samples=dropped,
        )  # fmt: skip

    def count_outcome(self, finished: Finished) -> None:
        """The circuit breaker (called under the lock)."""
        config = self.config
        failed = finished.failed is not None
        self.failures_in_a_row = self.failures_in_a_row + 1 if failed else 0
        self.outcomes.append(failed)
        rate = sum(self.outcomes) / len(self.outcomes)
        if self.error is not None:
            return
        if self.failures_in_a_row >= config.max_rollout_failures_in_a_row:
            self.error = RolloutFailures(
                f"{self.failures_in_a_row} rollouts in a row failed after {config.rollout_retries} retries each; last: {finished.failed}"
            )
        elif len(self.outcomes) == self.outcomes.maxlen and rate > config.max_rollout_failure_rate:
            self.error = RolloutFailures(
                f"{rate:.0%} of the last {len(self.outcomes)} rollouts failed (more than --max-rollout-failure-rate "
                f"{config.max_rollout_failure_rate:g}); last: {finished.failed}"
            )

    # The main thread.

    def train(self) -> None:
        state, config, trainer = self.r.state, self.config, self.r.trainer
        for thread in self.threads:
            thread.start()
        last = time.perf_counter()
        busy_before = self.sampler.busy_seconds
        while state.step < state.total_steps:
            step = state.step + 1
            t0 = time.perf_counter()
            batch, requeued = self.wait_for_batch(step)
            waited = time.perf_counter() - t0
            if batch is None:
                state.request_stop(f"the prompts ran out after step {state.step}")
                break
            kept = [g for f in batch for g in f.kept]
            start_version = trainer.version
            staleness = [start_version - s.policy_version for g in kept for s in g]
            t1 = time.perf_counter()
            with self.trainer_lock:
                metrics = train_step(self.pm, trainer, self.r.reference, kept, config, learning_rate(config, step - 1, state.total_steps))
            warn_untrained(step, metrics.as_dict(), config)
            t2 = time.perf_counter()
            window = t2 - last
            busy = self.sampler.busy_seconds
            metrics.merge(merge_group_metrics(batch))
            metrics.update(
                {
                    "time/sample": sum(f.sample_seconds for f in batch),
                    "time/reward": sum(f.reward_seconds for f in batch),
                    "time/wait": waited,
                    "time/train": t2 - t1,
                    "time/step": window,
                    "perf/sampler_busy_frac": min(1.0, (busy - busy_before) / window) if window > 0 else 0.0,
                    "perf/samples_per_s": metrics.get("train/samples", 0.0) / window if window > 0 else 0.0,
                    "staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
                    "staleness/max": float(max(staleness, default=0)),
                    "async/requeued_stale": float(requeued),
                    "async/dropped_samples": float(sum(f.dropped_samples for f in batch)),
                    "async/rollout_retries": float(sum(f.retries for f in batch)),
                    "async/rollout_failed": float(sum(f.failed is not None for f in batch)),
                },
                "sum",
            )
            record_perf(metrics, trainer)
            metrics = metrics.as_dict()
            # The sync, and the sampler's RNG and weights, with no generation running.
            counted = functools.partial(self.counted, step, batch, start_version, metrics, waited, window)
            stop = end_step(self.r, step, metrics, [g for f in batch for g in f.groups], self.sampler.exclusive, counted)
            with self.cond:
                self.gate.training = False
                self.cond.notify_all()
            last, busy_before = time.perf_counter(), busy
            if stop:
                break

    def wait_for_batch(self, step: int) -> tuple[list[Finished] | None, int]:
        """The rollouts of the next step (None when the prompts ran out), and how many stale groups
        went back to the queue. Marks the step as training: a draining gate starts nothing until it ends."""
        requeued, said = 0, False
        # As --dynamic-sampling's rounds in the sync loop: without enough groups with signal, a step
        # trains what it has once this many prompts arrived, rather than roll out the whole dataset.
        most = self.config.max_sampling_rounds * self.gate.groups_per_step
        with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                requeued += self.requeue_stale(step)
                if self.waits_for_a_requeued_group():
                    self.cond.wait(timeout=0.5)
                    continue
                arrived = sum(len(f.taken) for f in self.arrived)
                if not said and arrived >= self.gate.groups_per_step > self.gate.ready:
                    said = True
                    print(
                        f"step {step}: {arrived} prompts rolled out, {self.gate.ready} groups with signal of "
                        f"{self.gate.groups_per_step}; sampling on, up to {most} prompts (--max-sampling-rounds "
                        f"{self.config.max_sampling_rounds}), then the step trains what it has",
                        file=sys.stderr,
                        flush=True,
                    )
                if self.gate.drain and self.arrived:
                    batch = [self.arrived.popleft()]
                elif not self.gate.drain and (self.gate.ready >= self.gate.groups_per_step or arrived >= most):
                    batch = self.take_ready(self.gate.groups_per_step)
                elif self.gate.in_flight == 0 and not self.queue.has_more():
                    if not self.arrived:
                        return None, requeued
                    batch = self.take_ready(self.gate.ready)  # the last prompts: a short step
                else:
                    self.cond.wait(timeout=0.5)
                    continue
                self.gate.waiting -= len(batch)
                self.gate.ready -= sum(len(f.kept) for f in batch)
                self.gate.training = True
                self.gate.next_step_version = self.r.trainer.version + self.gate.versions_per_step
                self.cond.notify_all()
                return batch, requeued

    def waits_for_a_requeued_group(self) -> bool:
        """A prompt that came back too stale once must not starve (a slow rollout each time, while
        fast ones fill the steps): no step starts that would leave its new group too stale."""
        last_step_version = self.r.trainer.version + self.gate.versions_per_step - self.gate.max_offpolicy
        return any(g.sampler_version < last_step_version for g in self.running.values() if any(t.requeued for t in g.taken))

    def take_ready(self, groups: int) -> list[Finished]:
        """Arrived rollouts until ``groups`` groups with signal: those sampled again after coming back
        stale first, then in order of arrival (those without signal on the way go with them: they
        count in the step's rewards, as in the sync loop)."""
        self.arrived = collections.deque(sorted(self.arrived, key=lambda f: not any(t.requeued for t in f.taken)))
        batch: list[Finished] = []
        kept = 0
        while self.arrived and (kept < groups or not self.arrived[0].kept):
            finished = self.arrived.popleft()
            kept += len(finished.kept)
            batch.append(finished)
        return batch

    def requeue_stale(self, step: int) -> int:
        """Arrived groups the next step could not train within the bound go back to the queue (under the lock)."""
        oldest = self.r.trainer.version - self.gate.max_offpolicy
        if self.gate.drain:
            return 0
        stale = [f for f in self.arrived if f.version < oldest]
        for finished in stale:
            self.arrived.remove(finished)
            self.gate.waiting -= 1
            self.gate.ready -= len(finished.kept)
            for t in finished.taken:
                t.requeued += 1
            self.queue.again.extend(finished.taken)
            self.write_ledger(step, finished, "requeued_stale", self.r.trainer.version)
        if stale:
            self.cond.notify_all()
        return sum(len(f.taken) for f in stale)

    def counted(self, step: int, batch: list[Finished], version: int, metrics: dict[str, float], waited: float, window: float) -> None:
        """The step is counted and synced: the gate sees the sampler's version, the ledger and the
        async state of the step are written, and the metrics get the queue and the idle time."""
        with self.cond:
            self.gate.sampler_version = self.sampler.inner.version
            self.gate.next_step_version = self.r.trainer.version
            self.cond.notify_all()
        idle = waited + metrics.get("time/wait_sync", 0.0)
        metrics["perf/trainer_idle_frac"] = min(1.0, idle / window) if window > 0 else 0.0
        for finished in batch:
            self.write_ledger(step, finished, "failed" if finished.failed else "trained", version)
        self.ledger.flush()
        with self.cond:
            again = [*self.queue.again, *(t for f in self.arrived for t in f.taken), *(t for g in self.running.values() for t in g.taken)]
            snapshot = {"cursor": self.queue.cursor, "again": [[t.index, attrs.asdict(t.prompt)] for t in again]}
        write_async_state(self.folder, self.r.state.step, snapshot)
        with self.cond:
            metrics.update(
                {
                    "queue/in_flight": float(self.gate.in_flight),
                    "queue/ready": float(self.gate.ready),
                    "queue/again": float(len(self.queue.again)),
                }
            )
            if self.queue.admit is not None:
                metrics["sampling/passed_over"], self.queue.passed_over = float(self.queue.passed_over), 0
                metrics.update(self.taken.as_dict())
                self.taken = Metrics()

    def write_ledger(self, step: int, finished: Finished, outcome: str, trainer_version: int) -> None:
        kept = {id(g[0].prompt) for g in finished.kept if g}
        for t in finished.taken:
            what = outcome if outcome != "trained" or id(t.prompt) in kept else "no_signal"
            line = {
                "step": step,
                "index": t.index,
                "prompt": t.prompt.id,
                "outcome": what,
                "sampled_version": finished.version,
                "trainer_version": trainer_version,
            }
            self.ledger.write(json.dumps(line) + "\n")

    def close(self) -> None:
        """Stop taking prompts; a rollout still running is abandoned (its prompts are in the async state)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.sampler.close()
        self.ledger.close()


def merge_group_metrics(batch: list[Finished]) -> Metrics:
    """A step's rollout, reward and advantage metrics from those of its rollouts, merged by their
    reductions: the values of the groups scored together (``reward/total`` NaN when all failed)."""
    merged = Metrics()
    merged.add("reward/total", math.nan, "mean", weight=0.0)
    for finished in batch:
        if finished.failed is None:
            merged.merge(finished.metrics)
    return merged


def write_async_state(folder: Path, step: int, snapshot: dict[str, Any]) -> None:
    """The prompts taken and those to sample again after ``step``: written before any checkpoint of
    that step, kept as long as one exists."""
    path = folder / f"step-{step:06d}.json"
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w") as f:
        json.dump(snapshot, f, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    prune_async_state(folder, step)


def prune_async_state(folder: Path, step: int) -> None:
    """Keep the async state of ``step`` and of every checkpoint still there or being written."""
    keep = {step} | checkpoint_steps(folder.parent)
    for old in folder.glob("step-*.json"):
        if int(old.stem.removeprefix("step-")) not in keep:
            old.unlink(missing_ok=True)


def read_async_state(folder: Path, step: int) -> dict[str, Any]:
    path = folder / f"step-{step:06d}.json"
    if not path.is_file():
        raise PluginError(f"cannot resume the async loop at step {step}: {path} is missing")
    return json.loads(path.read_text())


def trim_ledger(path: Path, step: int) -> None:
    """A resumed run drops what the stopped one recorded after its checkpoint."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a kill
    path.write_text("".join(kept))
