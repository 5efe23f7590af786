"""Runs on image prompts: the tiny LLaVA-style model trains, evaluates, exports and resumes with the
local trainer and sampler; bad images are one-line errors or counted skips."""

from __future__ import annotations

import json

import pytest
import torch

from tests.core.test_resume import assert_same_run
from tests.helpers import grpo_core_in_process, safetensors_of

STEP_ARGS = ("--prompt-groups-per-step", "2", "--completions-per-prompt", "4", "--max-completion-tokens", "6")
REWARD = ("--reward", "format", "--reward-opt", "pattern=e", "--no-drop-zero-variance-groups", "--logger", "jsonl")
"""A reward the random model earns about half the time; groups kept whatever their rewards."""


def run(model, dataset, run_dir, *extra):
    return grpo_core_in_process(
        "run", "--model", str(model), "--dataset", str(dataset), "--run-dir", str(run_dir), *STEP_ARGS, *REWARD, *extra
    )  # fmt: skip


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rows(tiny_vlm_dir):
    return tiny_vlm_dir / "data" / "rows.jsonl"


@pytest.fixture(scope="module")
def fp32_run(tiny_vlm_dir, rows, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp32") / "run"
    out = run(tiny_vlm_dir, rows, run_dir, "--max-steps", "3", "--learning-rate", "1e-2", "--checkpoint-every", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_three_fp32_steps_train_with_the_samplers_logprobs_on_image_prompts(fp32_run):
    steps = metrics(fp32_run)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["mismatch/logprob_abs_max"] <= 1e-4, m
        assert m["loss/active_tokens"] > 0
    assert any(m["optim/grad_norm"] > 0 for m in steps)


@pytest.mark.slow
def test_the_final_policy_is_a_vision_language_folder_with_its_processor(fp32_run, tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    final = fp32_run / "final"
    assert (final / "processor_config.json").is_file()
    assert type(AutoProcessor.from_pretrained(final)).__name__ == "LlavaProcessor"
    model = AutoModelForImageTextToText.from_pretrained(final)
    trained, initial = safetensors_of(final), safetensors_of(tiny_vlm_dir)
    # The language model trained; the vision tower and projector did not (no --train-vision). Saved
    # names are transformers' checkpoint names: language_model.*, vision_tower.*, multi_modal_projector.*.
    changed = {name.split(".")[0] for name in initial if not torch.equal(trained[name], initial[name])}
    assert changed == {"language_model"}, changed
    assert type(model).__name__ == "LlavaForConditionalGeneration"


@pytest.mark.slow
def test_eval_and_export_take_the_trained_vision_language_model(fp32_run, rows, tmp_path):
    out = grpo_core_in_process("eval", "--model", str(fp32_run / "final"), "--dataset", str(rows), "-n", "2", "--reward", "format")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prompts 8  samples_per_prompt 2" in out.stdout
    exported = grpo_core_in_process("export", str(fp32_run), str(tmp_path / "policy"), "--step", "2")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "policy" / "processor_config.json").is_file()


@pytest.mark.slow
def test_a_resumed_image_run_ends_bitwise_equal_to_one_that_never_stopped(fp32_run, tiny_vlm_dir, rows, tmp_path):
    resumed = tmp_path / "resumed"
    out = run(tiny_vlm_dir, rows, resumed, "--max-steps", "2", "--learning-rate", "1e-2", "--checkpoint-every", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    out = grpo_core_in_process("run", "--resume", str(resumed), "--max-steps", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(fp32_run, resumed)


@pytest.mark.slow
def test_bf16_and_lora_train_on_image_prompts(tiny_vlm_dir, rows, tmp_path):
    out = run(tiny_vlm_dir, rows, tmp_path / "run", "--max-steps", "2", "--dtype", "bfloat16", "--lora-rank", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    for m in metrics(tmp_path / "run"):
        # bf16 weights: the sampler's and the trainer's forwards round differently, but they score one policy.
        assert 0 < m["mismatch/logprob_abs_max"] < 0.5, m


@pytest.mark.slow
def test_train_vision_trains_the_vision_tower(tiny_vlm_dir, rows, tmp_path):
    out = run(tiny_vlm_dir, rows, tmp_path / "run", "--max-steps", "2", "--learning-rate", "1e-2", "--train-vision")
    assert out.returncode == 0, out.stderr[-3000:]
    trained, initial = safetensors_of(tmp_path / "run" / "final"), safetensors_of(tiny_vlm_dir)
    changed = {name.split(".")[0] for name in initial if not torch.equal(trained[name], initial[name])}
    assert changed == {"vision_tower", "multi_modal_projector", "language_model"}, changed


def test_train_vision_on_a_text_model_is_refused(tiny_model_dir, tiny_dataset, tmp_path):
    out = grpo_core_in_process(
        "run", "--model", str(tiny_model_dir), "--dataset", str(tiny_dataset), "--max-steps", "1", "--train-vision",
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "error: --train-vision: model type 'qwen3' has no vision tower"


def bad_rows(tiny_vlm_dir, tmp_path):
    good = json.loads((tiny_vlm_dir / "data" / "rows.jsonl").read_text().splitlines()[0])
    good["messages"][0]["content"][0]["image"] = str(tiny_vlm_dir / "data" / "red.png")
    bad = json.loads(json.dumps(good))
    bad["messages"][0]["content"][0]["image"] = "missing.png"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, bad, good, good)))
    return path


def test_a_missing_image_stops_the_run_in_one_line_naming_the_row(tiny_vlm_dir, tmp_path):
    rows = bad_rows(tiny_vlm_dir, tmp_path)
    out = run(tiny_vlm_dir, rows, tmp_path / "run", "--max-steps", "1")
    assert out.returncode == 1
    assert out.stderr.strip() == f"error: {rows}:2: message 1 part 1: image file not found: {tmp_path}/missing.png"


@pytest.mark.slow
def test_skip_bad_rows_counts_a_missing_image(tiny_vlm_dir, tmp_path):
    rows = bad_rows(tiny_vlm_dir, tmp_path)
    out = run(tiny_vlm_dir, rows, tmp_path / "run", "--max-steps", "1", "--skip-bad-rows")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"skipped 1 bad rows of {rows} (--skip-bad-rows); first: {rows}:2: message 1 part 1: image file not found" in out.stderr
    assert metrics(tmp_path / "run")[0]["data/skipped_bad_rows"] == 1


@pytest.mark.slow
def test_the_async_loop_carries_image_tensors_to_the_sampler(tiny_vlm_dir, rows, tmp_path):
    out = run(tiny_vlm_dir, rows, tmp_path / "run", "--max-steps", "2", "--loop", "async", "--max-head-offpolicy-versions", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    for m in metrics(tmp_path / "run"):
        assert m["mismatch/logprob_abs_max"] <= 1e-4, m  # on-policy: the sampler's policy is the trainer's


class TextOnlySampler:
    """A sampler that does not declare takes_images (the vllm one, the tinker one)."""

    version = 0
    max_context = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def sample(self, prompts, num_samples, params):
        raise AssertionError("not reached: image prompts are refused first")


def test_a_sampler_that_does_not_take_images_is_refused_naming_the_prompt(tiny_vlm_dir, rows):
    from transformers import AutoTokenizer

    from grpo_core.data import load_prompts
    from grpo_core.errors import PluginError
    from grpo_core.plugins.rollouts.agent import AgentRollout
    from grpo_core.plugins.rollouts.multi_turn import MultiTurnRollout
    from grpo_core.plugins.rollouts.single_turn import SingleTurnRollout
    from grpo_core.types import SamplingParams

    prompts = load_prompts(rows)
    sampler = TextOnlySampler(AutoTokenizer.from_pretrained(tiny_vlm_dir))
    with pytest.raises(PluginError, match=r"^prompt rows.jsonl:1 has images, but the TextOnlySampler does not take image prompts$"):
        SingleTurnRollout().rollout(prompts[:2], 2, sampler, SamplingParams())
    with pytest.raises(
        PluginError, match=r"^prompt rows.jsonl:1 has images, which the multi_turn rollout does not take \(single_turn does\)$"
    ):
        MultiTurnRollout().rollout(prompts[:1], 2, sampler, SamplingParams(), env=None, tools={})
    with pytest.raises(PluginError, match=r"^prompt rows.jsonl:1 has images, which the agent rollout's gateway does not take"):
        AgentRollout(command="python agent.py").rollout(prompts[:1], 2, sampler, SamplingParams())


def test_the_fsdp_backend_refuses_a_vision_language_model(tiny_vlm_dir, rows, tmp_path):
    out = run(tiny_vlm_dir, rows, tmp_path / "run", "--max-steps", "1", "--backend", "fsdp", "--backend-opt", "nproc=2")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --backend fsdp does not train vision-language models (their vision parts are not sharded): use --backend local"
    )
