"""Vision-language models (engine/vision.py): loading, image prompts' tokens and tensors, the image
features the sampler and the trainer place over a prompt's image tokens."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from grpo_core.backend import sample_to_datum
from grpo_core.data import load_prompts
from grpo_core.engine import vision
from grpo_core.engine.forward import TransformersForward
from grpo_core.engine.logprobs import target_logprobs, tokens_run
from grpo_core.engine.lora import add_lora
from grpo_core.engine.models import load_model
from grpo_core.engine.vision import (
    PlacedImages,
    encode_image_prompt,
    freeze,
    frozen_vision_parts,
    load_vision_model,
    processor_at,
    vision_parts,
)
from grpo_core.errors import DataError, PluginError
from grpo_core.plugins.samplers.local import LocalSampler
from grpo_core.types import PromptImages, Sample, SamplingParams
from tests.engine.test_logprobs import spy

IMAGE_TOKENS = 4
"""Per image of the tiny model: (28 / 14)² patches."""


@pytest.fixture(scope="module")
def loaded(tiny_vlm_dir):
    return load_model(str(tiny_vlm_dir), torch.device("cpu"), "sdpa")


@pytest.fixture(scope="module")
def prompts(tiny_vlm_dir):
    return load_prompts(tiny_vlm_dir / "data" / "rows.jsonl")


def own_logprobs(model, tokens, images, start):
    """transformers' own forward with the images: the logprobs of tokens[start+1:]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), **images).logits[0].float()
    return torch.log_softmax(logits, -1)[start:-1].gather(-1, torch.tensor(tokens[start + 1 :]).unsqueeze(-1)).squeeze(-1)


def image_sample(prompt_tokens, completion, images):
    n = len(prompt_tokens)
    return Sample(
        prompt=None,
        tokens=prompt_tokens + completion,
        sampling_logprobs=[0.0] * (n + len(completion)),
        loss_mask=[0.0] * n + [1.0] * len(completion),
        text="",
        finish_reason="length",
        policy_version=0,
        images=images,
    )


def test_a_vision_language_folder_loads_with_its_processor(loaded, tiny_vlm_dir):
    model, tokenizer = loaded
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert vision_parts(model) == ["model.vision_tower", "model.multi_modal_projector"]
    assert tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id
    assert type(processor_at(str(tiny_vlm_dir)).image_processor).__name__ == "CLIPImageProcessorPil"


def test_a_text_model_has_no_vision_parts_and_refuses_train_vision(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir), torch.device("cpu"), "sdpa")
    assert vision_parts(model) == [] and frozen_vision_parts(model, False) == []
    with pytest.raises(PluginError, match="--train-vision: model type 'qwen3' has no vision tower"):
        frozen_vision_parts(model, True)


def test_an_image_prompt_expands_each_image_to_its_tokens(loaded, prompts):
    _, tokenizer = loaded
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    tokens, images = encode_image_prompt(tokenizer, prompts[0])
    assert tokens.count(image_token) == IMAGE_TOKENS and list(images) == ["pixel_values"]
    assert images["pixel_values"].shape == (1, 3, 28, 28)
    two_tokens, two = encode_image_prompt(tokenizer, prompts[7])  # red.png and green.png
    assert two_tokens.count(image_token) == 2 * IMAGE_TOKENS and two["pixel_values"].shape == (2, 3, 28, 28)
    # Red and green are different images.
    assert not torch.equal(two["pixel_values"][0], two["pixel_values"][1])
    assert torch.equal(two["pixel_values"][0], images["pixel_values"][0])
    # OpenAI's image_url part with a data URL of blue.png: the same tensors as the file's.
    assert prompts[6].messages[0]["content"][0]["image"].startswith("data:image/png;base64,")
    url_tokens, from_url = encode_image_prompt(tokenizer, prompts[6])
    assert url_tokens == tokens and torch.equal(from_url["pixel_values"], encode_image_prompt(tokenizer, prompts[2])[1]["pixel_values"])


def test_an_image_removed_after_the_rows_loaded_names_the_prompt(loaded, tiny_vlm_dir, tmp_path):
    (tmp_path / "gone.png").write_bytes((tiny_vlm_dir / "data" / "red.png").read_bytes())
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}, {"type": "text", "text": "hi"}]}]}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    (prompt,) = load_prompts(tmp_path / "rows.jsonl")
    (tmp_path / "gone.png").unlink()
    with pytest.raises(DataError, match=r"^prompt rows.jsonl:1: cannot read image .*gone.png"):
        encode_image_prompt(loaded[1], prompt)


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["padded", "packed"])
def test_the_trainers_logprobs_of_image_prompts_are_the_models_own(loaded, prompts, packed, monkeypatch):
    """Prompts of the same text and different images have the same tokens: each is scored with its own
    images (no shared prompt prefix), whether the rows are padded or packed."""
    model, tokenizer = loaded
    forward = TransformersForward(model, padding_free=True)
    encoded = [encode_image_prompt(tokenizer, p) for p in prompts[:3]]  # red, green, blue: the same question
    assert encoded[0][0] == encoded[1][0] == encoded[2][0]
    completions = [[5, 6, 7], [5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    samples = [image_sample(t, c, i) for (t, i), c in zip(encoded, completions)]
    datums = [sample_to_datum(s) for s in samples]
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass", "_logprobs_shared_prefix")
    if packed:
        forward.layer_costs = (1e6, 1.0)  # weights dominate: wide rows pay, two sequences share one
    logprobs, _ = target_logprobs(forward, datums, torch.device("cpu"), packed=packed)
    assert paths == ["_logprobs_packed" if packed else "_logprobs_one_pass"]
    start = len(encoded[0][0]) - 1
    for sample, (_, images), lp in zip(samples, encoded, logprobs):
        own = own_logprobs(model, sample.tokens, images, start)
        torch.testing.assert_close(lp[start:], own, rtol=0, atol=1e-5)
        assert torch.all(lp[:start] == 0)
    # The images matter: red and green give the same completion different logprobs.
    assert (logprobs[0] - logprobs[1]).abs().max() > 1e-3
    # perf/* count every row whole, as they ran.
    assert tokens_run(datums, whole_rows=False) == sum(d.model_input.length for d in datums)


@pytest.mark.slow
def test_a_sampled_image_token_in_a_completion_is_embedded_as_a_token(loaded, prompts):
    model, tokenizer = loaded
    image_token = model.config.image_token_id
    tokens, images = encode_image_prompt(tokenizer, prompts[0])
    sample = image_sample(tokens, [5, image_token, 6], images)
    (lp,), _ = target_logprobs(TransformersForward(model), [sample_to_datum(sample)], torch.device("cpu"))
    # transformers' own forward refuses 5 image tokens for 4 features. The prompt's 4 get the image
    # features, the completion's one keeps the token's embedding.
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([sample.tokens]))
        at = [t for t, token in enumerate(tokens) if token == image_token]
        embeds[0, at] = model.get_image_features(**images).pooler_output[0]
        logits = model(inputs_embeds=embeds).logits[0]
    start = len(tokens) - 1
    own = torch.log_softmax(logits, -1)[start:-1].gather(-1, torch.tensor(sample.tokens[start + 1 :]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp[start:], own, rtol=0, atol=1e-5)


def test_image_features_that_do_not_fit_the_image_tokens_are_an_error(loaded, prompts):
    model, tokenizer = loaded
    tokens, images = encode_image_prompt(tokenizer, prompts[7])  # two images
    one = {"pixel_values": images["pixel_values"][:1]}
    placed = PlacedImages(model, [tokens], [one], [len(tokens)], where=["prompt rows.jsonl:8"])
    with pytest.raises(ValueError, match="prompt rows.jsonl:8: 8 image tokens in its prompt, but its images make 4 features"):
        with placed.placed([0]):
            pass


@pytest.mark.slow
def test_the_local_sampler_prefills_with_the_images(loaded, prompts):
    """The sampler's logprobs of what it drew are the model's own with the images (to fp32 rounding)."""
    model, tokenizer = loaded
    sampler = LocalSampler(model=model, tokenizer=tokenizer, device=torch.device("cpu"), seed=0)
    encoded = [encode_image_prompt(tokenizer, p) for p in (prompts[0], prompts[7])]
    params = SamplingParams(max_tokens=5)
    groups = sampler.sample([t for t, _ in encoded], 2, params, images=[PromptImages([], i) for _, i in encoded])
    for (tokens, images), group in zip(encoded, groups):
        for completion in group:
            own = own_logprobs(model, tokens + completion.tokens, images, len(tokens) - 1)
            torch.testing.assert_close(torch.tensor(completion.logprobs), own, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_lora_adapters_go_on_the_language_model_unless_vision_trains(tiny_vlm_dir):
    def adapted(excluded):
        model, _ = load_model(str(tiny_vlm_dir), torch.device("cpu"), "sdpa")
        model = add_lora(model, 4, 8.0, ["auto"], excluded=excluded)
        return {name.split(".")[1] for name, module in model.named_modules() if hasattr(module, "lora_A")}

    model, _ = load_model(str(tiny_vlm_dir), torch.device("cpu"), "sdpa")
    assert adapted(frozen_vision_parts(model, False)) == {"language_model"}
    assert adapted(frozen_vision_parts(model, True)) == {"language_model", "vision_tower", "multi_modal_projector"}


def test_a_full_fine_tune_freezes_the_vision_parts(tiny_vlm_dir):
    model, _ = load_model(str(tiny_vlm_dir), torch.device("cpu"), "sdpa")
    freeze(model, frozen_vision_parts(model, False))
    trained = {name.split(".")[1] if name.startswith("model.") else name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"language_model", "lm_head.weight"}


def test_a_qwen_vl_processor_without_torchvision_is_refused_in_one_line(tmp_path):
    """transformers 5's Qwen-VL processors need a video processor, which needs torchvision."""
    pytest.importorskip("transformers")
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None and vision._torchvision_problem() is None:
        pytest.skip("torchvision works here: Qwen-VL's processor loads")
    folder = qwen_vl_folder(tmp_path)
    with pytest.raises(PluginError) as caught:
        load_model(str(folder), torch.device("cpu"), "sdpa")
    text = str(caught.value)
    assert text.startswith(f"cannot load the processor of vision-language model '{folder}': it needs torchvision, which ")
    assert "\n" not in text


def test_a_model_whose_positions_follow_its_images_is_refused(tmp_path, monkeypatch):
    from transformers import AutoConfig

    folder = qwen_vl_folder(tmp_path)
    monkeypatch.setattr(vision, "processor_at", lambda path: object())
    with pytest.raises(PluginError, match=r"model type 'qwen2_vl': its position ids follow each image's grid \(M-RoPE\)"):
        load_vision_model(str(folder), AutoConfig.from_pretrained(folder), torch.device("cpu"), torch.float32, "sdpa")


def qwen_vl_folder(tmp_path):
    config = {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "vision_config": {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2},
        "text_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 400},
        "image_token_id": 390,
        "bos_token_id": None,
        "eos_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    return tmp_path


def test_the_memory_plan_counts_the_vision_parts_as_trained_only_when_they_train(tiny_vlm_dir):
    from grpo_core.engine.memory_plan import model_size

    model, _ = load_model(str(tiny_vlm_dir), torch.device("cpu"), "sdpa")
    everything = sum(p.numel() for p in model.parameters())
    freeze(model, frozen_vision_parts(model, False))
    language = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < language < everything
    assert model_size(tiny_vlm_dir) == attrs.evolve(model_size(tiny_vlm_dir, train_vision=True), trained=language)
    assert model_size(tiny_vlm_dir, train_vision=True).trained == everything
    adapters = add_lora(model, 4, 8.0, ["auto"], excluded=frozen_vision_parts(model, False))
    expected = sum(p.numel() for p in adapters.parameters() if p.requires_grad)
    assert model_size(tiny_vlm_dir, lora_rank=4, lora_alpha=8.0).trained == expected


def test_image_datums_scored_by_a_text_model_are_refused(tiny_model_dir, loaded, prompts):
    text_model, _ = load_model(str(tiny_model_dir), torch.device("cpu"), "sdpa")
    tokens, images = encode_image_prompt(loaded[1], prompts[0])
    with pytest.raises(PluginError, match="^image prompts reach a qwen3 model, which is not a vision-language model$"):
        PlacedImages(text_model, [tokens], [images], [len(tokens)])
