from __future__ import annotations

import json
import math
import threading
import time

import attrs
import pytest
import torch

from grpo_core import data, hookimpl, selection
from grpo_core.async_loop import (
    Finished,
    Gate,
    RetryableRolloutError,
    RolloutFailures,
    SharedSampler,
    check_async_settings,
    merge_group_metrics,
)
from grpo_core.config import RunConfig
from grpo_core.errors import PluginError
from grpo_core.lifecycle import RunFailed, sync_weights
from grpo_core.metrics import Metrics, record, scope
from grpo_core.plugins.rollouts.single_turn import SingleTurnRollout
from grpo_core.plugins_manager import PluginEntry
from grpo_core.train import run
from grpo_core.types import Prompt, Sample
from tests.core.tiny_runs import config as sync_config


@attrs.define
class LengthReward:
    """Longer completions score higher: gives the random test model a learning signal."""

    @hookimpl
    def reward(self, prompt, samples):
        return [len(s.text) / 10 for s in samples]


class Script:
    """What the scripted rollout does on its n-th call for a prompt (n = 0, 1, ...): sleep
    ``latency(prompt_id, n)`` seconds after sampling (an environment's time), raise ``error(...)``
    when it returns one, and drop the samples ``drop(...)`` names (None in their place)."""

    latency = staticmethod(lambda prompt_id, n: 0.0)
    error = staticmethod(lambda prompt_id, n: None)
    drop = staticmethod(lambda prompt_id, n: ())
    calls: list[str] = []
    num_samples: list[int] = []
    running = 0
    most_at_once = 0
    lock = threading.Lock()


@attrs.define
class ScriptedRollout(SingleTurnRollout):
    """The real single-turn rollout, then a scripted wait, error or dropped samples."""

    @hookimpl
    def rollout(self, prompts, num_samples, sampler, params):
        assert len(prompts) == 1, "the async loop rolls out one prompt group per call"
        prompt = prompts[0]
        with Script.lock:
            n = Script.calls.count(prompt.id)
            Script.calls.append(prompt.id)
            Script.num_samples.append(num_samples)
            Script.running += 1
            Script.most_at_once = max(Script.most_at_once, Script.running)
        try:
            return self.scripted(prompt, n, num_samples, sampler, params)
        finally:
            with Script.lock:
                Script.running -= 1

    def scripted(self, prompt, n, num_samples, sampler, params):
        error = Script.error(prompt.id, n)
        if error is not None:
            raise error
        groups = super().rollout(prompts=[prompt], num_samples=num_samples, sampler=sampler, params=params)
        time.sleep(Script.latency(prompt.id, n))
        dropped = Script.drop(prompt.id, n)
        return [[None if i in dropped else s for i, s in enumerate(g)] for g in groups]


@attrs.define
class ScriptedTrajectoryRollout(ScriptedRollout):
    """The scripted rollout, declared to make each trajectory on its own: its n counts the
    prompt's trajectories."""

    per_trajectory = True


def row(prompt_id: str) -> int:
    return int(prompt_id.rsplit(":", 1)[1])


@pytest.fixture(autouse=True)
def test_plugins(monkeypatch):
    original = selection.find
    entries = {
        ("reward", "length"): PluginEntry(
            kind="reward", name="length", target=f"{__name__}:LengthReward", distribution="tests", version="0"
        ),
        ("rollout", "scripted"): PluginEntry(
            kind="rollout", name="scripted", target=f"{__name__}:ScriptedRollout", distribution="tests", version="0"
        ),
        ("rollout", "scripted_trajectory"): PluginEntry(
            kind="rollout", name="scripted_trajectory", target=f"{__name__}:ScriptedTrajectoryRollout", distribution="tests", version="0"
        ),
    }

    def find(name, kind=None):
        return entries.get((kind, name)) or original(name, kind)

    monkeypatch.setattr(selection, "find", find)
    monkeypatch.setattr(data, "find", find)  # the prompt settings written beside each checkpoint
    monkeypatch.setattr(Script, "calls", [])
    monkeypatch.setattr(Script, "num_samples", [])
    monkeypatch.setattr(Script, "running", 0)
    monkeypatch.setattr(Script, "most_at_once", 0)
    for name in ("latency", "error", "drop"):
        monkeypatch.setattr(Script, name, getattr(Script, name))


def config(tiny_model_dir, tiny_dataset, run_dir, **kw):
    """test_loop's small run, on the async loop."""
    return sync_config(tiny_model_dir, tiny_dataset, run_dir, **{"loop": "async", **kw})


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def ledger_of(run_dir):
    return [json.loads(line) for line in (run_dir / "async" / "groups.jsonl").read_text().splitlines()]


def weights_of(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def shared_metrics(metrics):
    """What the sync loop also reports, without timings."""
    async_only = ("time/", "perf/", "staleness/", "queue/", "async/")
    return [{k: v for k, v in m.items() if not k.startswith(async_only)} for m in metrics]


def trained_indices(ledger):
    return sorted(line["index"] for line in ledger if line["outcome"] == "trained")


# The gate.


def gate(**kw):
    base = dict(max_offpolicy=1, groups_per_step=2, versions_per_step=1, max_concurrent=100, sampler_version=0, next_step_version=0)
    return Gate(**{**base, **kw})


@pytest.mark.parametrize("max_offpolicy", [0, 1, 4])
def test_the_gate_admits_exactly_the_groups_that_land_within_the_bound(max_offpolicy):
    g = gate(max_offpolicy=max_offpolicy)
    admitted = 0
    while g.admits(1):
        g.in_flight += 1
        admitted += 1
    # Two groups per step: the groups of the next O + 1 steps, sampled at version 0.
    assert admitted == 2 * (max_offpolicy + 1)
    assert g.landing_version(1) == max_offpolicy + 1


def test_the_gate_counts_ready_groups_versions_per_step_a_step_in_training_and_the_concurrency_bound():
    g = gate(max_offpolicy=2, in_flight=1, ready=2)
    assert g.landing_version(1) == 1 and g.admits(1)
    g.versions_per_step = 2  # minibatches_per_step: a step is two versions
    assert g.landing_version(1) == 2 and g.admits(1) and g.landing_version(2) == 4 and not g.admits(2)
    g.next_step_version = 2  # a step is training: the next one starts at version 2
    assert g.landing_version(1) == 4 and not g.admits(1)
    g.sampler_version = 2
    assert g.admits(1)
    g.rollouts = g.max_concurrent = 3
    assert not g.admits(1)


def test_a_draining_gate_starts_one_rollout_at_a_time_and_none_while_a_step_trains_or_waits():
    g = gate(max_offpolicy=0, drain=True, max_concurrent=1)
    assert g.admits(2)
    for field in ("in_flight", "waiting"):
        setattr(g, field, 1)
        assert not g.admits(2)
        setattr(g, field, 0)
    g.training = True
    assert not g.admits(2)


@attrs.define
class SlowSampler:
    """Records how many of its generations ran at once."""

    version: int = 3
    tokenizer: str = "tok"
    concurrent_samples: int = 1
    seconds: float = 0.0
    running: int = 0
    most_at_once: int = 0
    calls: list = attrs.field(factory=list)
    fail_on: object = None

    def sample(self, prompts, num_samples, params):
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        self.calls.append((list(prompts), num_samples, params))
        time.sleep(self.seconds)
        self.running -= 1
        if self.fail_on in [p[0] for p in prompts]:
            raise ValueError(f"prompt {self.fail_on}")
        return [[f"{p[0]}/{i}" for i in range(num_samples)] for p in prompts]


def test_the_shared_sampler_reports_the_oldest_version_a_rollout_sampled_from():
    inner = SlowSampler()
    shared = SharedSampler(inner)
    shared.begin_rollout()
    assert shared.version == 3 and shared.tokenizer == "tok"
    inner.version = 4  # a weight sync between two turns of one rollout
    assert shared.sample([[1]], 1, None) == [["1/0"]]
    assert shared.version == 3
    shared.begin_rollout()
    assert shared.version == 4


def test_a_sync_waits_for_the_generation_in_flight_and_reports_that_wait_with_the_sync_metrics():
    from types import SimpleNamespace

    inner = SlowSampler(seconds=0.4)
    shared = SharedSampler(inner)

    def weight_sync(trainer, sampler, step):
        assert sampler is inner and inner.running == 0  # nothing sampled while the weights change
        record("sync/logprob_max_abs_diff", 0.0, "max")
        return step

    r = SimpleNamespace(
        selection=SimpleNamespace(
            manager=SimpleNamespace(hook=SimpleNamespace(weight_sync=weight_sync)),
        ),
        state=SimpleNamespace(loop=SimpleNamespace(policy_version=0)),
        trainer=None,
        sampler=inner,
    )
    thread = threading.Thread(target=shared.sample, args=([[1]], 1, None))
    thread.start()
    while not inner.running:
        time.sleep(0.005)
    with scope() as metrics, shared.exclusive():
        metrics.merge(sync_weights(r, 7))
    thread.join()
    assert r.state.policy_version == 7
    assert metrics["sync/logprob_max_abs_diff"] == 0.0
    assert 0.2 < metrics["time/wait_sync"] < 0.6


@pytest.mark.parametrize("concurrent", [1, 3])
def test_the_shared_sampler_runs_as_many_generations_at_once_as_the_sampler_takes_and_syncs_between_them(concurrent):
    inner = SlowSampler(concurrent_samples=concurrent, seconds=0.3)
    shared = SharedSampler(inner)
    threads = [threading.Thread(target=shared.sample, args=([[1]], 1, None)) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 10
    while inner.running < concurrent and time.perf_counter() < deadline:
        time.sleep(0.005)
    waited_from = time.perf_counter()
    with shared.exclusive() as sampler:  # waits for the running generations, holds new ones off
        assert sampler is inner and inner.running == 0
        waited = time.perf_counter() - waited_from
    for t in threads:
        t.join()
    assert inner.most_at_once == concurrent
    assert waited > 0.1  # a generation of 0.3 s was running: the sync waited for it
    # One at a time: the first call, then the two queued behind it as one, 2 x 0.3 s of
    # generation; three at once: 0.3 s (and no more than the calls took).
    assert [len(prompts) for prompts, _, _ in inner.calls] == ([1, 2] if concurrent == 1 else [1, 1, 1])
    assert shared.busy_seconds >= (0.6 if concurrent == 1 else 0.3) - 0.01
    assert shared.busy_seconds < (1.0 if concurrent == 1 else 0.9)


def test_calls_queued_behind_a_generation_are_batched_by_their_settings_and_each_gets_its_own_groups():
    inner = SlowSampler(seconds=0.3)
    shared = SharedSampler(inner)
    results, errors = {}, {}

    def call(name, prompts, num_samples, params):
        shared.begin_rollout()
        try:
            results[name] = (shared.sample(prompts, num_samples, params), shared.version)
        except ValueError as exc:
            errors[name] = str(exc)

    first = threading.Thread(target=call, args=("first", [[0]], 2, "p"))
    first.start()
    while not inner.running:
        time.sleep(0.005)
    inner.version = 5  # what the queued calls will sample from
    queued = [("a", [[1], [2]], 2, "p"), ("b", [[3]], 1, "p"), ("c", [[4]], 2, "p"), ("d", [[5]], 2, "q")]
    threads = [threading.Thread(target=call, args=args) for args in queued]
    for t in threads:
        t.start()
        time.sleep(0.02)  # queued in this order
    first.join()
    for t in threads:
        t.join()
    # a and c share num_samples and params: one generation, in the order they queued.
    assert [(prompts, n, params) for prompts, n, params in inner.calls] == [
        ([[0]], 2, "p"), ([[1], [2], [4]], 2, "p"), ([[3]], 1, "p"), ([[5]], 2, "q"),
    ]  # fmt: skip
    assert results["first"] == ([["0/0", "0/1"]], 3)
    assert results["a"] == ([["1/0", "1/1"], ["2/0", "2/1"]], 5) and results["c"] == ([["4/0", "4/1"]], 5)
    assert results["b"] == ([["3/0"]], 5) and results["d"] == ([["5/0", "5/1"]], 5)
    assert shared.calls == 4


def test_an_error_in_a_batched_generation_reaches_every_call_in_it():
    inner = SlowSampler(seconds=0.2, fail_on=2)
    shared = SharedSampler(inner)
    outcomes = {}

    def call(prompt):
        try:
            outcomes[prompt] = shared.sample([[prompt]], 1, None)
        except ValueError as exc:
            outcomes[prompt] = str(exc)

    threads = [threading.Thread(target=call, args=(p,)) for p in (0, 1, 2)]
    threads[0].start()
    while not inner.running:
        time.sleep(0.005)
    for t in threads[1:]:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert outcomes == {0: [["0/0"]], 1: "prompt 2", 2: "prompt 2"}


def test_a_closed_shared_sampler_waits_for_the_running_generation_and_refuses_new_ones():
    from grpo_core.async_loop import SamplerClosed

    inner = SlowSampler(seconds=0.3)
    shared = SharedSampler(inner)
    worker = threading.Thread(target=shared.sample, args=([[1]], 1, None))
    worker.start()
    deadline = time.perf_counter() + 10
    while not inner.running and time.perf_counter() < deadline:
        time.sleep(0.005)
    started = time.perf_counter()
    shared.close()
    assert time.perf_counter() - started > 0.1 and inner.running == 0
    worker.join()
    with pytest.raises(SamplerClosed):
        shared.sample([[1]], 1, None)


# Settings.


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(weight_sync_interval=3, max_head_offpolicy_versions=1), "--max-head-offpolicy-versions must be at least 2"),
        (dict(weight_sync_interval=2, minibatches_per_step=2, max_head_offpolicy_versions=1), "must be at least 2"),
        (dict(minibatches_per_step=3, prompt_groups_per_step=2), "cannot exceed --prompt-groups-per-step 2"),
        (dict(max_rollout_failure_rate=1.5), "must be in (0, 1]"),
        (dict(max_rollout_failure_rate=0.0), "must be in (0, 1]"),
    ],
)
def test_settings_the_loop_cannot_honour_are_refused(kw, message):
    with pytest.raises(PluginError, match=None) as info:
        check_async_settings(RunConfig(loop="async", **kw))
    assert message in str(info.value)


def test_settings_that_fit_are_accepted():
    check_async_settings(RunConfig(loop="async", weight_sync_interval=3, max_head_offpolicy_versions=2))
    check_async_settings(RunConfig(loop="async", weight_sync_interval=3, max_head_offpolicy_versions=0, synchronous_training=True))


# Metrics of several rollouts, merged.


def scored(rewards_by_group):
    groups = []
    for rewards in rewards_by_group:
        prompt = Prompt(id="p", text="q")
        group = []
        for r in rewards:
            s = Sample(
                prompt=prompt,
                tokens=[1, 2],
                sampling_logprobs=[0.0, -1.0],
                loss_mask=[0.0, 1.0],
                text="a",
                finish_reason="stop",
                policy_version=0,
            )
            s.reward, s.rewards = r, {"length": r}
            group.append(s)
        groups.append(group)
    return groups


def finished_with(groups):
    """A rollout's outcome with the metrics the reward and advantage stages record for it."""
    ok = [s.reward for g in groups for s in g if s.reward is not None]
    mean = sum(ok) / len(ok)
    metrics = Metrics()
    metrics.add("reward/total", mean, "mean", weight=len(ok))
    metrics.add("reward/length", mean, "mean", weight=len(ok))
    for r in ok:
        metrics.add("reward/std", r, "std")
    metrics.add("reward/failed", sum(s.reward is None for g in groups for s in g), "sum")
    metrics.add("groups/kept", len(groups), "sum")
    metrics.add("tokens/completion_mean", 1.0, "mean", weight=sum(len(g) for g in groups))
    return Finished(taken=[], groups=groups, kept=groups, metrics=metrics)


def test_merged_metrics_equal_those_of_the_groups_scored_together():
    a, b = scored([[1.0, 2.0, None]]), scored([[4.0, 0.0], [3.0, 3.0]])
    merged = merge_group_metrics([finished_with(a), finished_with(b), Finished(taken=[], failed="boom")])
    everything = [1.0, 2.0, 4.0, 0.0, 3.0, 3.0]
    mean = sum(everything) / 6
    assert merged["reward/total"] == pytest.approx(mean) and merged["reward/length"] == pytest.approx(mean)
    assert merged["reward/std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in everything) / 6))
    assert merged["reward/failed"] == 1.0 and merged["groups/kept"] == 3.0 and merged["tokens/completion_mean"] == 1.0
    one = finished_with(b)
    assert merge_group_metrics([one]) == one.metrics
    assert math.isnan(merge_group_metrics([Finished(taken=[], failed="boom")])["reward/total"])


# Synchronous training is the synchronous loop.


@pytest.mark.parametrize("extra", [{}, {"weight_sync_interval": 2, "max_steps": 4}])
def test_synchronous_training_gives_the_sync_loops_metrics_and_weights(tiny_model_dir, tiny_dataset, tmp_path, extra):
    sync, drained = tmp_path / "sync", tmp_path / "drained"
    run(config(tiny_model_dir, tiny_dataset, sync, loop="sync", seed=3, **extra))
    run(config(tiny_model_dir, tiny_dataset, drained, synchronous_training=True, seed=3, **extra))
    assert shared_metrics(metrics_of(drained)) == shared_metrics(metrics_of(sync))
    assert all(m["staleness/max"] <= (1 if extra else 0) for m in metrics_of(drained))
    ws, wd = weights_of(sync), weights_of(drained)
    assert all(torch.equal(ws[k], wd[k]) for k in ws)


def test_synchronous_training_resumes_exactly(tiny_model_dir, tiny_dataset, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(config(tiny_model_dir, tiny_dataset, whole, synchronous_training=True, max_steps=4))
    run(config(tiny_model_dir, tiny_dataset, split, synchronous_training=True, max_steps=2))
    from grpo_core.resume import load_resumed

    run(load_resumed(str(split), {"max_steps": 4}, {}), resume=True)
    assert shared_metrics(metrics_of(split)) == shared_metrics(metrics_of(whole))
    ww, ws = weights_of(whole), weights_of(split)
    assert all(torch.equal(ww[k], ws[k]) for k in ww)


# Scripted latencies: the bound holds, no prompt is lost or trained twice.


def skewed(prompt_id, n):
    """Every third prompt is slow the first time it is rolled out; the others are fast."""
    return 0.6 if n == 0 and row(prompt_id) % 3 == 0 else 0.01


@pytest.mark.parametrize("rollout", ["scripted", "scripted_trajectory"])
@pytest.mark.parametrize("max_offpolicy", [0, 1, 4])
def test_no_trained_sample_is_staler_than_the_bound_and_every_prompt_is_trained_once(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, max_offpolicy, rollout
):
    monkeypatch.setattr(Script, "latency", skewed)
    versions = []
    original = __import__("grpo_core.stages", fromlist=["x"]).anchor_logprobs

    def spy(trainer, datums, samples, sampling, anchor):
        versions.append((trainer.version, [s.policy_version for s in samples]))
        return original(trainer, datums, samples, sampling, anchor)

    monkeypatch.setattr("grpo_core.stages.anchor_logprobs", spy)
    r = tmp_path / "r"
    summary = run(
        config(tiny_model_dir, tiny_dataset, r, rollout=rollout, max_rows=18, max_steps=None, max_head_offpolicy_versions=max_offpolicy)
    )
    metrics, ledger = metrics_of(r), ledger_of(r)
    assert summary["steps"] == 9 and len(metrics) == 9
    # Every sample trained, as the trainer saw it, within the bound.
    staleness = [trainer_version - v for trainer_version, vs in versions for v in vs]
    assert len(staleness) == 18 * 4 and max(staleness) <= max_offpolicy
    assert max(m["staleness/max"] for m in metrics) == max(staleness)
    assert all(0 <= line["trainer_version"] - line["sampled_version"] <= max_offpolicy for line in ledger if line["outcome"] == "trained")
    # Every prompt trained exactly once; those that came back too stale were sampled again.
    assert trained_indices(ledger) == list(range(18))
    requeued = [line for line in ledger if line["outcome"] == "requeued_stale"]
    assert sum(m["async/requeued_stale"] for m in metrics) == len(requeued)
    calls_per_group = 4 if rollout == "scripted_trajectory" else 1  # one per trajectory, each of one sample
    assert len(Script.calls) == (18 + len(requeued)) * calls_per_group
    assert set(Script.num_samples) == {4 // calls_per_group}
    if max_offpolicy == 0:
        assert max(staleness) == 0
    else:
        # Groups of the next steps were sampled while a step trained.
        assert max(staleness) >= 1


def test_a_group_that_would_break_the_bound_is_sampled_again_and_then_waited_for(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    # Slow every time: without waiting for its second rollout it would come back stale for ever.
    slow_row = 3
    monkeypatch.setattr(Script, "latency", lambda prompt_id, n: 0.8 if row(prompt_id) == slow_row else 0.1)
    r = tmp_path / "r"
    run(
        config(
            tiny_model_dir,
            tiny_dataset,
            r,
            rollout="scripted",
            max_rows=36,
            max_steps=None,
            max_head_offpolicy_versions=1,
            max_concurrent=2,
            shuffle=False,
        )
    )
    ledger = ledger_of(r)
    slow = [line for line in ledger if line["prompt"].endswith(f":{slow_row}")]
    assert [line["outcome"] for line in slow] == ["requeued_stale", "trained"]
    assert slow[0]["trainer_version"] - slow[0]["sampled_version"] > 1
    assert trained_indices(ledger) == list(range(36))
    assert Script.calls.count(slow[0]["prompt"]) == 2


@pytest.mark.parametrize(
    ("rollout", "max_concurrent", "expected"),
    [
        ("scripted", 3, 3),
        ("scripted", None, 2 * (4 + 1)),
        # 16 groups of 4 trajectories of 0.3 s, 3 at a time: over 6 s of waiting
        pytest.param("scripted_trajectory", 3, 3, marks=pytest.mark.slow),
        ("scripted_trajectory", None, 2 * (4 + 1) * 4),
    ],
)
def test_max_concurrent_bounds_the_rollouts_in_flight(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, rollout, max_concurrent, expected
):
    monkeypatch.setattr(Script, "latency", lambda prompt_id, n: 0.3)
    run(
        config(
            tiny_model_dir,
            tiny_dataset,
            tmp_path / "r",
            rollout=rollout,
            max_rows=16,
            max_steps=None,
            max_head_offpolicy_versions=4,
            max_concurrent=max_concurrent,
        )
    )
    # The default: every rollout the gate admits, the groups of O + 1 = 5 steps of two (each
    # group's 4 trajectories at once for a per-trajectory rollout).
    assert Script.most_at_once == expected


@pytest.mark.parametrize("rollout", ["scripted", "scripted_trajectory"])
def test_dropped_samples_are_counted_and_not_trained(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, rollout):
    # The first sample of the first call: of a group, or a group's first trajectory.
    monkeypatch.setattr(Script, "drop", lambda prompt_id, n: (0,) if n == 0 and row(prompt_id) % 2 else ())
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, rollout=rollout, max_rows=8, max_steps=None))
    metrics = metrics_of(r)
    assert sum(m["async/dropped_samples"] for m in metrics) == 4
    assert sum(m["train/samples"] for m in metrics) == 8 * 4 - 4


# Failures.


def test_a_retryable_error_is_retried_with_backoff(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(Script, "error", lambda prompt_id, n: RetryableRolloutError("busy") if n < 2 and row(prompt_id) == 2 else None)
    r = tmp_path / "r"
    started = time.perf_counter()
    run(config(tiny_model_dir, tiny_dataset, r, rollout="scripted", max_rows=8, max_steps=None, rollout_retry_backoff=0.2, shuffle=False))
    assert time.perf_counter() - started >= 0.2 + 0.4
    metrics, ledger = metrics_of(r), ledger_of(r)
    assert sum(m["async/rollout_retries"] for m in metrics) == 2 and sum(m["async/rollout_failed"] for m in metrics) == 0
    assert trained_indices(ledger) == list(range(8))


@pytest.mark.parametrize(("rollout", "retries"), [("scripted", 1), ("scripted_trajectory", 3)])
def test_a_rollout_failing_past_its_retries_is_counted_and_its_prompt_recorded(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, rollout, retries
):
    # Every call for row 2 fails except, per trajectory, the group's first: one failed trajectory fails its group.
    monkeypatch.setattr(
        Script, "error", lambda prompt_id, n: TimeoutError("env") if row(prompt_id) == 2 and (rollout == "scripted" or n) else None
    )
    r = tmp_path / "r"
    run(
        config(
            tiny_model_dir,
            tiny_dataset,
            r,
            rollout=rollout,
            max_rows=8,
            max_steps=None,
            rollout_retries=1,
            rollout_retry_backoff=0,
            shuffle=False,
        )
    )
    metrics, ledger = metrics_of(r), ledger_of(r)
    assert sum(m["async/rollout_failed"] for m in metrics) == 1 and sum(m["async/rollout_retries"] for m in metrics) == retries
    assert [line["index"] for line in ledger if line["outcome"] == "failed"] == [1]  # row 2 is the second prompt
    assert trained_indices(ledger) == [0, 2, 3, 4, 5, 6, 7]


def test_a_fatal_rollout_error_stops_the_run_with_a_checkpoint(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(Script, "error", lambda prompt_id, n: ValueError("a bug") if row(prompt_id) == 7 else None)
    r = tmp_path / "r"
    with pytest.raises(RunFailed) as info:
        run(config(tiny_model_dir, tiny_dataset, r, rollout="scripted", max_rows=12, max_steps=None, shuffle=False, max_concurrent=1))
    assert isinstance(info.value.cause, ValueError) and "a bug" in str(info.value)
    assert Script.calls.count("add.jsonl:7") == 1  # not retried
    assert "--resume" in info.value.saved


@pytest.mark.parametrize(
    ("error", "kw", "message"),
    [
        (lambda prompt_id, n: ConnectionError("down"), dict(max_rollout_failures_in_a_row=3), "3 rollouts in a row failed"),
        (
            lambda prompt_id, n: ConnectionError("down") if row(prompt_id) % 2 else None,
            dict(max_rollout_failure_rate=0.4, rollout_failure_window=4, max_concurrent=1),
            "50% of the last 4 rollouts failed",
        ),
    ],
)
def test_the_circuit_breaker_stops_the_run(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, error, kw, message):
    monkeypatch.setattr(Script, "error", error)
    with pytest.raises(RunFailed) as info:
        run(
            config(
                tiny_model_dir,
                tiny_dataset,
                tmp_path / "r",
                rollout="scripted",
                max_rows=16,
                max_steps=None,
                rollout_retries=0,
                shuffle=False,
                **kw,
            )
        )
    assert isinstance(info.value.cause, RolloutFailures) and message in str(info.value)


# Minibatches.


def test_minibatches_step_the_optimizer_k_times_against_the_steps_pi_old(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    from grpo_core import stages

    calls = []
    original = stages.train_on_groups

    def spy(pm, trainer, reference, groups, config, lr, *routes):
        calls.append(trainer.version)
        return original(pm, trainer, reference, groups, config, lr, *routes)

    monkeypatch.setattr(stages, "train_on_groups", spy)
    r = tmp_path / "r"
    run(
        config(
            tiny_model_dir, tiny_dataset, r, max_steps=2, prompt_groups_per_step=4, minibatches_per_step=2, max_head_offpolicy_versions=2
        )
    )
    metrics = metrics_of(r)
    assert [m["policy/version"] for m in metrics] == [2, 4]
    assert all(m["optim/minibatches"] == 2 and m["train/samples"] == 16 for m in metrics)
    # The view the minibatches train through matches no sample's version: pi_old comes from the step's start.
    assert calls == [-1, -1, -1, -1]
    # The second minibatch's ratio is against the policy before the first update: not 1.
    assert all(abs(m["loss/ratio_mean"] - 1.0) > 1e-6 for m in metrics)


def test_one_minibatch_anchors_on_the_step_start_policy_and_the_later_ones_too(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    from grpo_core import stages

    ratios = []
    original = stages.train_on_groups
    monkeypatch.setattr(stages, "train_on_groups", lambda *a: (m := original(*a), ratios.append(m["loss/ratio_mean"]))[0])
    run(
        config(
            tiny_model_dir,
            tiny_dataset,
            tmp_path / "r",
            max_steps=1,
            prompt_groups_per_step=4,
            minibatches_per_step=2,
            max_head_offpolicy_versions=2,
        )
    )
    # First minibatch: nothing changed yet, the ratio is 1; second: the first update moved the policy.
    assert ratios[0] == pytest.approx(1.0, abs=1e-5) and abs(ratios[1] - 1.0) > 1e-4


# Checkpoints and resume.


def test_resume_samples_the_in_flight_prompts_again_and_skips_none(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(Script, "latency", lambda prompt_id, n: 0.5 if row(prompt_id) % 4 == 1 else 0.01)
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, rollout="scripted", max_rows=20, max_steps=3, max_head_offpolicy_versions=2))
    state = json.loads((r / "async" / "step-000003.json").read_text())
    first = ledger_of(r)
    assert len(trained_indices(first)) == 6
    # Prompts were taken beyond the three steps: in flight or ready when the run stopped.
    assert state["cursor"] > 6 and state["again"]
    assert {i for i, _ in state["again"]}.isdisjoint(trained_indices(first))
    from grpo_core.resume import load_resumed

    Script.calls.clear()
    summary = run(load_resumed(str(r), {"max_steps": 100}, {}), resume=True)
    ledger = ledger_of(r)
    assert summary["steps"] == 10 and [m["step"] for m in metrics_of(r)] == list(range(1, 11))
    assert trained_indices(ledger) == list(range(20))
    # What was in flight is sampled first after the resume.
    assert Script.calls[: len(state["again"])] == [p["id"] for _, p in state["again"]]


def test_the_async_state_is_kept_for_the_checkpoints_only(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, max_steps=5, checkpoint_every=2, keep_checkpoints=2))
    assert sorted(p.name for p in (r / "async").glob("step-*.json")) == ["step-000004.json", "step-000005.json"]
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == ["step-000004", "step-000005"]


def test_the_async_state_of_a_checkpoint_still_being_written_is_kept(tmp_path):
    """A step's state outlives the background write of its checkpoint: pruned during it, a
    checkpoint that then completes could not be resumed (CI, 2026-11-28)."""
    from grpo_core import checkpoint
    from grpo_core.async_loop import prune_async_state, read_async_state, write_async_state

    folder = tmp_path / "async"
    folder.mkdir()
    release = threading.Event()
    write_async_state(folder, 4, {"cursor": 4, "again": []})
    checkpoint.WRITING[tmp_path] = checkpoint.BackgroundWrite(release.wait, checkpoint.checkpoint_dir(tmp_path, 4))
    try:
        write_async_state(folder, 5, {"cursor": 5, "again": []})
        assert read_async_state(folder, 4)["cursor"] == 4
    finally:
        release.set()
        checkpoint.wait_for_checkpoint(tmp_path)
    # Written and gone (no folder of step 4 completed here): the next prune drops its state.
    prune_async_state(folder, 6)
    assert sorted(p.name for p in folder.glob("step-*.json")) == []


def test_a_resumed_run_drops_the_group_records_after_its_checkpoint_and_a_torn_last_line(tmp_path):
    from grpo_core.async_loop import trim_ledger

    path = tmp_path / "groups.jsonl"
    path.write_text('{"step": 1, "index": 0}\n{"step": 2, "index": 1}\n{"step": 3, "index": 2}\n{"step": 3, "ind')
    trim_ledger(path, 2)
    assert path.read_text() == '{"step": 1, "index": 0}\n{"step": 2, "index": 1}\n'


def test_turn_scores_are_never_taken_while_a_step_changes_the_weights(tiny_model_dir, tmp_path, monkeypatch):
    """IGPO scores with the trainer from a rollout worker: those forwards wait for the step."""
    from grpo_core import async_loop
    from grpo_core.engine.trainer import LocalTrainer

    dataset = tmp_path / "games.jsonl"
    dataset.write_text("".join(json.dumps({"question": "Guess my number from 1 to 16.", "answer": str(n)}) + "\n" for n in range(1, 13)))
    steps, scores = [], []
    train_step, forward = async_loop.train_step, LocalTrainer.forward

    def timed_train_step(*args):
        started = time.perf_counter()
        time.sleep(0.2)  # a long step: a scoring forward arriving meanwhile must wait for it
        try:
            return train_step(*args)
        finally:
            steps.append((started, time.perf_counter()))

    def timed_forward(self, datums):
        started = time.perf_counter()
        try:
            return forward(self, datums)
        finally:
            if threading.current_thread().name.startswith("grpo-core-rollout"):
                scores.append((started, time.perf_counter()))

    monkeypatch.setattr(async_loop, "train_step", timed_train_step)
    monkeypatch.setattr(LocalTrainer, "forward", timed_forward)
    cfg = config(
        tiny_model_dir, dataset, tmp_path / "run", max_steps=4, reward=["env"], rollout="multi_turn", env="guess_number",
        advantage="igpo", max_head_offpolicy_versions=2, max_concurrent=3,
        plugin_options={"rollout": {"multi_turn": {"max_turns": 2}}, "advantage": {"igpo": {"answer_template": "It is {answer}."}}},
    )  # fmt: skip
    run(cfg)
    assert len(steps) == 4 and scores
    assert not [(s, t) for s in scores for t in steps if s[0] < t[1] and t[0] < s[1]]
