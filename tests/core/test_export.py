"""grpo_core.export: a run's policy (final/ or a checkpoint) as a plain transformers folder."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_core.checkpoint import checkpoint_dir
from grpo_core.config import load
from grpo_core.data import PROMPT_SETTINGS_FILE
from grpo_core.engine.trainer import read_trainer_state
from grpo_core.errors import PluginError
from grpo_core.export import export_policy, read_run_config
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.train import run

TEMPLATE = "Question: {prompt}\nAnswer:"
PROBE = "Question: what is 3 plus 4?\nAnswer: 3 + 4 = 7\n#### 7"


def train(model, dataset, run_dir, **extra):
    values = {
        "model": str(model), "dataset": str(dataset), "prompt_template": TEMPLATE, "max_steps": 2,
        "prompt_groups_per_step": 2, "completions_per_prompt": 4, "max_completion_tokens": 6,
        "run_dir": str(run_dir), "checkpoint_every": 1, "keep_checkpoints": 5, "logger": ["jsonl"],
        "reward": ["format"], **extra,
    }  # fmt: skip
    # A reward the random model earns about half the time: every step has something to learn.
    config = load(None, values, {"reward": [r"pattern=\d"]})
    run(config)
    return config


@pytest.fixture(scope="module", params=[0, 4], ids=["full", "lora"])
def trained_run(request, tiny_model_dir, tiny_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "run"
    # A large step, so that each step visibly moves the policy (LoRA's B starts at zero).
    train(tiny_model_dir, tiny_dataset, run_dir, lora_rank=request.param, learning_rate=3e-2)
    return run_dir, request.param


def logprobs_of_folder(folder, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0], model


def trainer_logprobs(run_dir, step, tokens):
    """The run's trainer as it was after ``step``: rebuilt from the run's config and checkpoint."""
    from grpo_core import Sample
    from grpo_core.backend import sample_to_datum

    config = read_run_config(run_dir)
    trainer = LocalBackend().make_trainer(config=config)
    trainer.load_state(str(checkpoint_dir(run_dir, step) / "trainer"))
    sample = Sample(prompt=None, tokens=tokens, sampling_logprobs=[0.0] * len(tokens), loss_mask=[1.0] * len(tokens),
                    text="", finish_reason="stop", policy_version=0)  # fmt: skip
    return trainer.forward([sample_to_datum(sample)])[0], trainer


@pytest.mark.parametrize("step", [None, 1, 2], ids=["final", "step1", "step2"])
def test_exported_folder_loads_with_transformers_and_scores_as_the_trainer(trained_run, tmp_path, step):
    from safetensors import safe_open

    run_dir, _ = trained_run
    out = tmp_path / "exported"
    folder, source = export_policy(run_dir, out, step)
    assert folder == out and source == str(run_dir / "final" if step is None else checkpoint_dir(run_dir, step))
    want, _ = trainer_logprobs(run_dir, step or 2, trainer_tokens := trainer_tokenizer_ids(run_dir))
    got, model = logprobs_of_folder(out, trainer_tokens)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert model.config.model_type == "qwen3"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lora" in k]  # noqa: SIM118 (safe_open has no __iter__)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)(PROBE)["input_ids"] == trainer_tokens
    settings = json.loads((out / PROMPT_SETTINGS_FILE).read_text())
    assert settings == json.loads((run_dir / "final" / PROMPT_SETTINGS_FILE).read_text())
    assert settings["prompt_template"] == TEMPLATE and settings["max_completion_tokens"] == 6


def trainer_tokenizer_ids(run_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(run_dir / "final")(PROBE)["input_ids"]


def test_export_says_nothing_of_training(trained_run, tmp_path, capfd):
    run_dir, _ = trained_run
    capfd.readouterr()
    export_policy(run_dir, tmp_path / "out", 1)
    said = capfd.readouterr().err
    for training_line in ("optimizer state:", "memory plan:", "gradient checkpointing:", "trainer forward:", "precision:"):
        assert training_line not in said, said


def test_step_chooses_the_checkpoint(trained_run, tmp_path):
    run_dir, _ = trained_run
    tokens = trainer_tokenizer_ids(run_dir)
    first, _ = logprobs_of_folder(export_policy(run_dir, tmp_path / "one", 1)[0], tokens)
    last, _ = logprobs_of_folder(export_policy(run_dir, tmp_path / "two", 2)[0], tokens)
    base, _ = logprobs_of_folder(read_run_config(run_dir).model, tokens)
    assert float((first - last).abs().max()) > 1e-3
    assert float((first - base).abs().max()) > 1e-3  # step 1 trained (for LoRA: the merged adapters count)


def test_lora_checkpoint_holds_adapters_only(trained_run):
    run_dir, lora_rank = trained_run
    state = read_trainer_state(checkpoint_dir(run_dir, 2) / "trainer")
    if lora_rank:
        assert "model" not in state and state["adapter"] and all("lora_" in k for k in state["adapter"])
    else:
        assert "adapter" not in state and "model.embed_tokens.weight" in state["model"]


def test_run_config_is_read_back_as_it_was(trained_run):
    run_dir, lora_rank = trained_run
    config = read_run_config(run_dir)
    assert config.lora_rank == lora_rank and config.max_steps == 2 and config.learning_rate == 3e-2
    assert config.logger == ["jsonl"] and config.run_dir == str(run_dir)


def test_an_empty_existing_out_dir_is_used(trained_run, tmp_path):
    run_dir, _ = trained_run
    (tmp_path / "empty").mkdir()
    folder, _ = export_policy(run_dir, tmp_path / "empty")
    assert (folder / "config.json").is_file() and (folder / PROMPT_SETTINGS_FILE).is_file()


def test_errors_name_what_is_missing_and_leave_out_dir_alone(trained_run, tmp_path):
    run_dir, _ = trained_run
    with pytest.raises(PluginError, match=f"^{tmp_path / 'nowhere'}: not a grpo-core run directory"):
        export_policy(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(PluginError, match=r"has no checkpoint of step 7 \(checkpoints of steps 1, 2\)$"):
        export_policy(run_dir, tmp_path / "out", 7)
    assert not (tmp_path / "out").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(PluginError, match="already exists and is not an empty folder; choose another OUT_DIR"):
        export_policy(run_dir, busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"] and (busy / "keep.txt").read_text() == "mine"
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(PluginError, match="already exists and is not an empty folder"):
        export_policy(run_dir, tmp_path / "a_file")


def test_a_run_without_final_points_to_its_checkpoints(tiny_model_dir, tiny_dataset, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    train(tiny_model_dir, tiny_dataset, run_dir, max_steps=1)
    shutil.rmtree(run_dir / "final")  # as a run killed before it wrote final/ leaves it
    with pytest.raises(
        PluginError,
        match=r"has no final policy \(final/\): the run did not finish; export a checkpoint with --step N \(checkpoints of steps 1\)",
    ):
        export_policy(run_dir, tmp_path / "out")
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(PluginError, match=r"\(it has no checkpoints\)"):
        export_policy(run_dir, tmp_path / "out")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_an_exported_lora_policy_with_the_trainers_logprobs(tiny_dataset, tmp_path):
    from grpo_core.remote.server_client import ServerClient, prompt_logprobs
    from tests.integration.vllm_server import VLLMServer, build_server_model, ensure_vllm_venv

    ensure_vllm_venv()
    model = build_server_model(tmp_path / "model", tied=True)  # head_dim 32: vLLM's CPU attention needs it
    run_dir = tmp_path / "run"
    train(model, tiny_dataset, run_dir, lora_rank=4, learning_rate=3e-2)
    exported, _ = export_policy(run_dir, tmp_path / "exported")
    tokens = trainer_tokenizer_ids(run_dir)
    want, _ = trainer_logprobs(run_dir, 2, tokens)
    base, _ = logprobs_of_folder(model, tokens)
    assert float((want - base).abs().max()) > 1e-2  # the merged adapters matter
    server = VLLMServer(exported, tmp_path / "vllm.log")
    server.start()
    try:
        served = prompt_logprobs(ServerClient(server.url, retry_deadline=60.0), server.served_name, tokens)
    finally:
        server.stop()
    assert float((torch.tensor(served[1:]) - want).abs().max()) < 1e-3
