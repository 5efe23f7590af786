from __future__ import annotations

import json
import re

import pytest
import torch

from grpo_core.errors import PluginError
from grpo_core.metrics import computed_only
from grpo_core.train import run
from tests.core.tiny_runs import (
    config,
    length_reward,  # noqa: F401 (autouse: the runs below score with the "length" reward)
    metrics_of,
    weights_of,
)


def test_same_seed_same_run_on_cpu(tiny_model_dir, tiny_dataset, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run(config(tiny_model_dir, tiny_dataset, a, seed=1))
    run(config(tiny_model_dir, tiny_dataset, b, seed=1))
    run(config(tiny_model_dir, tiny_dataset, c, seed=2))

    def drop_time(ms):
        return [computed_only(m) for m in ms]

    assert drop_time(metrics_of(a)) == drop_time(metrics_of(b))
    wa, wb, wc = weights_of(a), weights_of(b), weights_of(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_training_changes_the_policy_and_counts_versions(tiny_model_dir, tiny_dataset, tmp_path):
    from safetensors.torch import load_file

    summary = run(config(tiny_model_dir, tiny_dataset, tmp_path / "r"))
    metrics = metrics_of(tmp_path / "r")
    before, after = load_file(tiny_model_dir / "model.safetensors"), weights_of(tmp_path / "r")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert [m["policy/version"] for m in metrics] == [1, 2, 3]
    # Three steps: the summary compares step 1 with step 3, never overlapping windows.
    assert summary["steps"] == 3 and summary["window"] == 1
    assert summary["reward_first"] == metrics[0]["reward/total"] and summary["reward_last"] == metrics[2]["reward/total"]
    assert all("loss/total" in m and "optim/grad_norm" in m for m in metrics)


def test_weight_sync_interval_samples_ahead_and_anchors_on_the_old_policy(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    from grpo_core.plugins.backends import local

    forwards = []
    original = local.LocalTrainer.forward
    monkeypatch.setattr(local.LocalTrainer, "forward", lambda self, datums: forwards.append(len(datums)) or original(self, datums))
    run(config(tiny_model_dir, tiny_dataset, tmp_path / "r", max_steps=4, weight_sync_interval=2, loss=["grpo"]))
    # Steps 2 and 4 train on samples from the version before the last update: one extra pass each.
    assert forwards == [8, 8]


def test_max_steps_and_max_rows_bound_the_run(tiny_model_dir, tiny_dataset, tmp_path):
    summary = run(config(tiny_model_dir, tiny_dataset, tmp_path / "r", max_steps=None, max_rows=4, epochs=2))
    assert summary["steps"] == 4


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_first_signal_asks_to_stop_after_the_step_and_a_second_one_stops_at_once(tmp_path, capsys, signum):
    import os
    import signal

    from grpo_core.lifecycle import stop_on_signals
    from grpo_core.types import RunState

    sig = getattr(signal, signum)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    state = RunState(run_dir=tmp_path)
    restore = stop_on_signals(state)
    try:
        os.kill(os.getpid(), sig)
        assert state.signal == sig and state.stop_reason is None
        assert "stopping after this step and saving" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
    finally:
        restore()
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_run_seed_orders_the_data(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    from grpo_core import data

    seeds = []
    real = data.prompt_batches
    monkeypatch.setattr(
        data,
        "prompt_batches",
        lambda prompts, size, epochs, seed, shuffle: seeds.append(seed) or real(prompts, size, epochs, seed, shuffle),
    )
    run(config(tiny_model_dir, tiny_dataset, tmp_path / "r", seed=7, max_steps=1))
    assert seeds == [7]


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_more_minibatches_than_groups_are_refused_in_both_loops(tiny_model_dir, tiny_dataset, tmp_path, loop):
    with pytest.raises(PluginError, match="cannot exceed --prompt-groups-per-step 2"):
        run(config(tiny_model_dir, tiny_dataset, tmp_path / "r", loop=loop, minibatches_per_step=3, prompt_groups_per_step=2))


def test_minibatches_take_that_many_optimizer_steps_per_step_in_the_sync_loop(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, max_steps=2, prompt_groups_per_step=4, minibatches_per_step=4))
    metrics = metrics_of(r)
    assert [m["optim/updates"] for m in metrics] == [4, 4]
    assert [m["policy/version"] for m in metrics] == [4, 8]
    assert all(m["optim/minibatches"] == 4 and m["train/samples"] == 16 for m in metrics)
    # The later minibatches' ratio is against the policy of the step's start: not 1.
    assert all(abs(m["loss/ratio_mean"] - 1.0) > 1e-6 for m in metrics)
    one = tmp_path / "one"
    run(config(tiny_model_dir, tiny_dataset, one, max_steps=2, prompt_groups_per_step=4))
    assert [m["optim/updates"] for m in metrics_of(one)] == [1, 1]
    assert [m["policy/version"] for m in metrics_of(one)] == [1, 2]


def test_sampler_and_trainer_agree_in_fp32_and_the_mismatch_is_logged_every_step(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, max_steps=2))
    for m in metrics_of(r):
        assert 0.0 <= m["mismatch/logprob_abs_max"] < 1e-5
        assert 0.0 <= m["mismatch/logprob_abs_mean"] <= m["mismatch/logprob_abs_max"]
        assert abs(m["mismatch/kl_k3"]) < 1e-5


def test_a_bfloat16_trainer_disagrees_with_the_sampler_measurably(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, max_steps=1, dtype="bfloat16"))
    (m,) = metrics_of(r)
    assert m["mismatch/logprob_abs_max"] > 1e-4 and m["mismatch/logprob_abs_mean"] > 0 and m["mismatch/kl_k3"] != 0


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_ppo_epochs_times_minibatches_optimizer_steps_per_step_in_both_loops(tiny_model_dir, tiny_dataset, tmp_path, loop):
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, loop=loop, max_steps=2, prompt_groups_per_step=2, ppo_epochs=2, minibatches_per_step=2))
    metrics = metrics_of(r)
    assert [m["optim/updates"] for m in metrics] == [4, 4]
    assert [m["policy/version"] for m in metrics] == [4, 8]
    assert all(m["optim/epochs"] == 2 and m["optim/minibatches"] == 2 and m["train/samples"] == 8 for m in metrics)


def test_weight_sync_interval_0_never_syncs_and_anchors_every_later_step_on_the_old_policy(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch
):
    from grpo_core.plugins.backends import local
    from grpo_core.plugins.samplers import local as local_sampler

    forwards, syncs = [], []
    original = local.LocalTrainer.forward
    monkeypatch.setattr(local.LocalTrainer, "forward", lambda self, datums: forwards.append(len(datums)) or original(self, datums))
    real_load = local_sampler.LocalSampler.load_weights_from
    monkeypatch.setattr(
        local_sampler.LocalSampler, "load_weights_from", lambda self, trainer: syncs.append(trainer.version) or real_load(self, trainer)
    )
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, max_steps=4, weight_sync_interval=0, loss=["grpo"]))
    assert syncs == []
    # Every step after the first trains on samples of the initial policy: pi_old from a forward.
    assert forwards == [8, 8, 8]
    metrics = metrics_of(r)
    assert metrics[0]["mismatch/logprob_abs_max"] < 1e-5 < metrics[3]["mismatch/logprob_abs_max"]
    assert [m["policy/version"] for m in metrics] == [1, 2, 3, 4]


def test_weight_sync_interval_0_is_refused_by_the_async_loop(tiny_model_dir, tiny_dataset, tmp_path):
    with pytest.raises(PluginError, match="--weight-sync-interval 0 never syncs the sampler"):
        run(config(tiny_model_dir, tiny_dataset, tmp_path / "r", loop="async", weight_sync_interval=0))


@pytest.mark.parametrize(("loop", "split"), [("sync", []), ("async", []), ("sync", ["--minibatches-per-step", "2", "--ppo-epochs", "2"])])
def test_a_run_that_trains_no_token_takes_no_optimizer_step_and_exits_1(tiny_model_dir, tiny_dataset, tmp_path, loop, split):
    from safetensors.torch import load_file

    from tests.helpers import grpo_core_in_process, small_run_args

    r = tmp_path / "r"
    # Every completion is cut at 2 tokens and masked: no token is trained. Weight decay would
    # shrink the weights if AdamW stepped on the zero gradient.
    args = small_run_args(tiny_model_dir, tiny_dataset, r, "--loop", loop, "--mask-truncated", "--max-completion-tokens", "2")
    out = grpo_core_in_process(*args, *split, "--weight-decay", "0.5", "--learning-rate", "0.1", "--logger", "jsonl")
    assert out.returncode == 1, out.stdout + out.stderr
    metrics = metrics_of(r)
    summary = json.loads((r / "summary.json").read_text())
    assert len(metrics) == 2 and summary["steps"] == 2 and summary["exit_code"] == 1
    for m in metrics:
        assert m["train/tokens"] == 0 and m["optim/updates"] == 0 and m["optim/skipped_no_trained_tokens"] == 1
        assert m["completion/masked_truncated"] == m["train/samples"] == 8 and m["policy/version"] == 0
    assert "warning: step 1 trained no token (8 of its 8 samples were cut at --max-completion-tokens 2" in out.stderr
    assert (
        "error: nothing was trained: all 2 steps kept 4 groups of 16 samples, but no token of theirs was trained (16 of them were cut "
        "at --max-completion-tokens 2 and --mask-truncated masks them); raise --max-completion-tokens or drop --mask-truncated"
    ) in out.stderr
    before, after = load_file(tiny_model_dir / "model.safetensors"), weights_of(r)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


PERF = ("perf/sample_tokens_per_s", "perf/decode_ms_per_step", "perf/train_tokens_per_s", "perf/mfu", "perf/peak_memory_gib")


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_every_step_logs_the_perf_metrics_with_sane_values_and_config_says_what_they_measure(tiny_model_dir, tiny_dataset, tmp_path, loop):
    r = tmp_path / "r"
    run(config(tiny_model_dir, tiny_dataset, r, loop=loop))
    metrics = metrics_of(r)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # The async loop's sampler generates queued calls together, and what it records goes with the
    # call whose thread ran it: a step whose groups all rode along another's call has no decode time.
    every_step = PERF if loop == "sync" else tuple(p for p in PERF if p != "perf/decode_ms_per_step")
    assert any(m.get("perf/decode_ms_per_step", 0) > 0 for m in metrics)
    for m in metrics:
        assert all(m[name] > 0 for name in every_step), m
        assert 0 < m["perf/mfu"] <= 1
        assert m["perf/sample_tokens_per_s"] == pytest.approx(m["tokens/completion"] / m["time/sample"])
        # The tokens the trainer ran: a group's shared prompt once (fewer than the datums it was sent hold), every completion.
        ran = m["perf/train_tokens_per_s"] * m["time/train"]
        assert m["tokens/completion"] - m["train/samples"] <= round(ran) < m["train/forward_tokens"]
        assert 0.05 < m["perf/peak_memory_gib"] < 64  # the process's peak RSS: torch alone is over 50 MiB
    # CPU: the peak RSS since the process began, which never falls.
    peaks = [m["perf/peak_memory_gib"] for m in metrics]
    assert peaks == sorted(peaks)
    trainer = json.loads((r / "config.json").read_text())["run_info"]["trainer"]
    assert re.match(r"this CPU's float32 (128|256|512|1024)³ matmul probe, best of 5: ", trainer["mfu_peak"])
    assert trainer["peak_memory"].startswith("the process's peak resident memory since it began")
