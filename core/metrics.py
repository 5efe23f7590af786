"""One recorder for every metric of a run, each with the reduction that merges it.

Core and plugins (samplers, rollouts, rewards, weight sync, advantages, losses) call
:func:`record` with a metric's name, value and reduction. A record lands in the innermost
:func:`scope` open in the calling thread (each loop opens one per step, and the async loop one
per rollout call in its worker threads), and scopes merge by the reductions: the same values
whatever way a step's work was split (into rollout calls, trajectories or forward/backward
calls). A record made outside any scope is dropped, so a plugin works the same outside a run.

Reductions, over every value recorded in a step:

- ``sum``: counts and totals (``sampler/requests``, ``reward/failed``);
- ``mean``: the ``weight``-weighted mean (weight: the samples or tokens the value is a mean over);
- ``max``: the largest value (``mismatch/logprob_abs_max``);
- ``std``: the weighted standard deviation of the values (``reward/std``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from typing import Literal

import attrs

Reduction = Literal["sum", "mean", "max", "std"]

MEASURED_PREFIXES: tuple[str, ...] = ("time/",)
"""Namespaces of metrics measured on the machine (wall-clock seconds)."""
MEASURED_METRICS: frozenset[str] = frozenset(
    {
        "perf/sample_tokens_per_s",
        "perf/decode_ms_per_step",
        "perf/train_tokens_per_s",
        "perf/mfu",
        "perf/peak_memory_gib",
        "perf/trainer_idle_frac",
        "perf/sampler_busy_frac",
        "perf/samples_per_s",
        "perf/recompiles",
    }
)
"""The other metrics measured on the machine (rates over seconds, memory): two runs that compute
the same steps (a resumed run and the uninterrupted one) differ in these and equal in every other."""


def is_measured(name: str) -> bool:
    """Whether a metric is measured on the machine (:data:`MEASURED_METRICS`) rather than computed."""
    return name.startswith(MEASURED_PREFIXES) or name in MEASURED_METRICS


def computed_only(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` without those measured on the machine: what two runs of the same steps share."""
    return {name: value for name, value in metrics.items() if not is_measured(name)}


REDUCTIONS: tuple[str, ...] = ("sum", "mean", "max", "std")


@attrs.define
class Entry:
    reduce: str
    weight: float = 0.0
    total: float = 0.0
    """sum: the sum; mean, std: the weighted sum; max: the largest value (-inf before any)."""
    squares: float = 0.0
    """std: the weighted sum of squares."""

    @property
    def value(self) -> float:
        if self.reduce == "sum":
            return self.total
        if self.reduce == "max":
            return self.total if self.weight else math.nan
        if not self.weight:
            return math.nan if self.reduce == "mean" else 0.0  # the spread of no values is none
        mean = self.total / self.weight
        if self.reduce == "mean":
            return mean
        return math.sqrt(max(self.squares / self.weight - mean * mean, 0.0))


class Metrics(Mapping[str, float]):
    """The metrics of one scope (a step, a rollout call), merged as they are recorded; read as
    a mapping of names to their reduced values."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def add(self, name: str, value: float, reduce: Reduction, weight: float = 1.0) -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"metric {name}: unknown reduction {reduce!r}; one of {', '.join(REDUCTIONS)}")
        entry = self._entry(name, reduce)
        value = float(value)
        if reduce == "sum":
            entry.total += value
        elif reduce == "max":
            # A NaN is kept: a non-finite step shows as such.
            entry.total = value if not entry.weight or math.isnan(value) else max(entry.total, value)
            entry.weight = 1.0
        elif weight and not math.isnan(value):
            entry.total += value * weight
            entry.squares += value * value * weight
            entry.weight += weight

    def update(self, values: dict[str, float], reduce: Reduction, weight: float = 1.0) -> None:
        for name, value in values.items():
            self.add(name, value, reduce, weight)

    def merge(self, other: Metrics) -> None:
        """Add another scope's records, as if they had been recorded here."""
        for name, theirs in other.entries.items():
            ours = self._entry(name, theirs.reduce)
            if theirs.reduce == "max":
                if theirs.weight:
                    self.add(name, theirs.total, "max")
            else:
                ours.total += theirs.total
                ours.squares += theirs.squares
                ours.weight += theirs.weight

    def as_dict(self) -> dict[str, float]:
        return {name: entry.value for name, entry in self.entries.items()}

    def __getitem__(self, name: str) -> float:
        return self.entries[name].value

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def _entry(self, name: str, reduce: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = Entry(reduce)
        elif entry.reduce != reduce:
            raise ValueError(f"metric {name} is recorded both as {entry.reduce} and as {reduce}")
        return entry


_current: contextvars.ContextVar[Metrics | None] = contextvars.ContextVar("grpo_core_metrics", default=None)


def record(name: str, value: float, reduce: Reduction, weight: float = 1.0) -> None:
    """Record one value of a namespaced metric in the current scope (dropped outside any).

    :param reduce: how values of the same step combine: ``sum``, ``mean`` (weighted by
        ``weight``: the samples or tokens the value is a mean over), ``max`` or ``std``.
    """
    metrics = _current.get()
    if metrics is not None:
        metrics.add(name, value, reduce, weight)


@contextlib.contextmanager
def scope() -> Iterator[Metrics]:
    """Collect what this thread records until the block ends (nested scopes do not reach the
    outer one: the caller merges them)."""
    metrics = Metrics()
    token = _current.set(metrics)
    try:
        yield metrics
    finally:
        _current.reset(token)
