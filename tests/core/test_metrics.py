from __future__ import annotations

import math
import threading

import pytest
import torch

from grpo_core.metrics import Metrics, record, scope
from grpo_core.stages import record_mismatch


def test_each_reduction_merges_parts_as_if_recorded_together():
    whole, a, b = Metrics(), Metrics(), Metrics()
    values = [(1.0, 2.0), (4.0, 1.0), (-2.0, 3.0)]  # (value, weight)
    for i, (value, weight) in enumerate(values):
        part = a if i < 2 else b
        for m in (whole, part):
            m.add("x/sum", value, "sum")
            m.add("x/mean", value, "mean", weight=weight)
            m.add("x/max", value, "max")
            m.add("x/std", value, "std", weight=weight)
    merged = Metrics()
    merged.merge(a)
    merged.merge(b)
    assert dict(merged) == pytest.approx(dict(whole))
    assert whole["x/sum"] == 3.0 and whole["x/max"] == 4.0
    mean = (1.0 * 2 + 4.0 * 1 - 2.0 * 3) / 6
    assert whole["x/mean"] == pytest.approx(mean)
    assert whole["x/std"] == pytest.approx(math.sqrt((2 * (1 - mean) ** 2 + (4 - mean) ** 2 + 3 * (-2 - mean) ** 2) / 6))


def test_empty_and_nan_values():
    m = Metrics()
    m.add("reward/total", math.nan, "mean", weight=0.0)
    m.add("reward/std", 0.0, "std", weight=0.0)
    assert math.isnan(m["reward/total"]) and m["reward/std"] == 0.0
    m.add("reward/total", 2.0, "mean", weight=3.0)
    assert m["reward/total"] == 2.0  # a NaN without weight does not poison the mean
    m.add("x/max", 1.0, "max")
    m.add("x/max", math.nan, "max")
    m.add("x/max", 5.0, "max")
    assert math.isnan(m["x/max"])  # a non-finite value shows


def test_bad_reductions_are_refused():
    m = Metrics()
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        m.add("x", 1.0, "median")
    m.add("x", 1.0, "sum")
    with pytest.raises(ValueError, match="recorded both as sum and as mean"):
        m.add("x", 1.0, "mean")


def test_records_land_in_the_innermost_scope_of_their_own_thread_and_nowhere_outside_one():
    record("lost", 1.0, "sum")  # outside any scope: dropped
    with scope() as outer:
        record("a", 1.0, "sum")
        with scope() as inner:
            record("a", 2.0, "sum")
        worker = threading.Thread(target=record, args=("a", 5.0, "sum"))
        worker.start()
        worker.join()
    assert dict(outer) == {"a": 1.0} and dict(inner) == {"a": 2.0}


def test_the_mismatch_metrics_are_those_computed_by_hand():
    trainer = [torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-0.1, -3.0])]
    sampler = [torch.tensor([-1.2, -0.5, -1.0]), torch.tensor([-0.4, -9.0])]
    mask = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 0.0])]  # the last token is not trained
    with scope() as m:
        record_mismatch([t.requires_grad_() for t in trainer], sampler, mask)
    diffs = [0.2, 0.0, -1.0, 0.3]  # trainer - sampler on the trained tokens
    assert m["mismatch/logprob_abs_max"] == pytest.approx(1.0)
    assert m["mismatch/logprob_abs_mean"] == pytest.approx(sum(abs(d) for d in diffs) / 4)
    assert m["mismatch/kl_k3"] == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs) / 4)
    assert m.entries["mismatch/logprob_abs_mean"].weight == 4.0
    with scope() as none:
        record_mismatch(trainer, sampler, [torch.zeros(3), torch.zeros(2)])
    assert dict(none) == {}


def test_measured_metrics_are_the_wall_clock_and_machine_ones_and_nothing_computed():
    from grpo_core.metrics import MEASURED_METRICS, computed_only, is_measured

    for name in ("time/step", "time/weight_sync", *MEASURED_METRICS):
        assert is_measured(name), name
    # Deterministic perf/ metrics (which path ran) and the token counts rates are made of stay compared.
    for name in ("perf/padding_free", "perf/forward_path", "train/forward_tokens", "tokens/completion", "timed/x", "step"):
        assert not is_measured(name), name
    assert {"perf/sample_tokens_per_s", "perf/decode_ms_per_step", "perf/train_tokens_per_s", "perf/mfu", "perf/peak_memory_gib"} <= (
        MEASURED_METRICS
    )
    step = {"step": 3, "reward/total": 0.5, "perf/padding_free": 1.0, "perf/mfu": 0.01, "time/train": 0.2}
    assert computed_only(step) == {"step": 3, "reward/total": 0.5, "perf/padding_free": 1.0}
