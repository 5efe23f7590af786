from __future__ import annotations

import math

from grpo_core.plugins.loggers.console import ConsoleLogger, format_stats


def test_the_step_line_shows_reward_loss_and_the_perf_metrics_the_run_logs():
    metrics = {
        "reward/total": 0.5,
        "loss/total": -0.25,
        "perf/sample_tokens_per_s": 1234.4,
        "perf/train_tokens_per_s": 98765.0,
        "perf/mfu": 0.0312,
        "perf/peak_memory_gib": 8.384,
        "perf/decode_ms_per_step": 40.1,
    }
    assert format_stats(metrics) == ("reward 0.500  loss -0.250  sample 1,234 tok/s  train 98,765 tok/s  mfu 3.1%  peak 8.38 GiB")
    # A trainer without counters (a service's) logs no MFU nor memory: the line shows what there is.
    assert format_stats({"reward/total": 0.5, "perf/sample_tokens_per_s": 10.0, "perf/mfu": math.nan}) == ("reward 0.500  sample 10 tok/s")


def test_a_line_without_a_terminal_carries_the_perf_metrics(capsys):
    logger = ConsoleLogger()
    logger._total = 2
    logger.on_step(step=1, metrics={"reward/total": 1.0, "perf/mfu": 0.25, "time/step": 1.5}, state=None)
    assert capsys.readouterr().out == "step 1/2  reward 1.000  mfu 25.0%  1.50s\n"
