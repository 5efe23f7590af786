"""The openai sampler's image prompts: each goes alone to /v1/chat/completions as its chat with
``image_url`` parts, and the server's prompt token ids must be the trainer's."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch

from grpo_core import SamplingParams
from grpo_core.data import load_prompts
from grpo_core.engine.vision import encode_image_prompt
from grpo_core.plugins.samplers.openai import chat_body
from grpo_core.remote.server_client import TOKENIZER_PROBE, ServerResponseError
from grpo_core.types import PromptImages
from tests.plugins.samplers.fake_server import FakeVLLM, LocalHTTPServer
from tests.plugins.samplers.test_openai import expected_tokens, make_sampler

PARAMS = SamplingParams(max_tokens=3, temperature=1.0, top_p=1.0, top_k=0)


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    return AutoTokenizer.from_pretrained(tiny_vlm_dir), AutoProcessor.from_pretrained(tiny_vlm_dir), model


@pytest.fixture(scope="module")
def rows(tiny_vlm_dir):
    """The tiny model's image rows, resolved as a run loads them (files as absolute paths)."""
    return load_prompts(tiny_vlm_dir / "data" / "rows.jsonl")


def prompt_images(tokenizer, prompt):
    tokens, tensors = encode_image_prompt(tokenizer, prompt)
    return tokens, PromptImages([], tensors, prompt.messages)


def test_an_image_prompt_goes_as_a_chat_with_its_file_as_a_data_url_beside_text_prompts_as_ids(vlm, rows, tiny_vlm_dir):
    tokenizer, processor, model = vlm
    fake = FakeVLLM(tokenizer, model=model, processor=processor)
    sampler = make_sampler(fake, tokenizer, prompts_per_request=8)
    tokens, images = prompt_images(tokenizer, rows[0])
    groups = sampler.sample([[5, 6, 7], tokens, [9, 10]], 2, PARAMS, images=[None, images, None])

    paths = [path for path, _ in fake.requests]
    assert sorted(paths) == ["/v1/chat/completions", "/v1/completions"]
    (text_body,) = [b for p, b in fake.requests if p == "/v1/completions"]
    assert text_body["prompt"] == [[5, 6, 7], [9, 10]]
    (chat,) = [b for p, b in fake.requests if p == "/v1/chat/completions"]
    red = (tiny_vlm_dir / "data" / "red.png").read_bytes()
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(red).decode()}},
                {"type": "text", "text": "What colour is this image?"},
            ],
        }
    ]
    assert chat["n"] == 2 and chat["max_tokens"] == 3 and chat["logprobs"] is True and chat["return_token_ids"] is True
    assert chat["add_generation_prompt"] is True and chat["add_special_tokens"] is False and "prompt" not in chat
    # Each group is its own prompt's: the text prompts' follow the fake's formula, the image prompt's were drawn from the model.
    for prompt, group in ((([5, 6, 7]), groups[0]), ([9, 10], groups[2])):
        assert [c.tokens for c in group] == [expected_tokens(fake, prompt, j, 3) for j in range(2)]
    assert len(groups[1]) == 2
    for completion in groups[1]:
        assert len(completion.tokens) == 3 and all(-30 < lp < 0 for lp in completion.logprobs)
        assert completion.tokens != expected_tokens(fake, tokens, 0, 3)
    sampler.close()


def test_a_chat_sends_urls_as_given_and_string_contents_unchanged(tmp_path):
    url = "https://example.com/cat.png"
    data = "data:image/png;base64,AAAA"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": url}, {"type": "image", "image": data}, {"type": "text", "text": "?"}]},
    ]
    body = chat_body("tiny", PromptImages([url, data], {}, messages), 1, SamplingParams(max_tokens=2, top_k=5, stop=["x"]))
    assert body["messages"][0] == messages[0]
    assert [p.get("image_url") for p in body["messages"][1]["content"]] == [{"url": url}, {"url": data}, None]
    assert body["top_k"] == 5 and body["stop"] == ["x"] and body["model"] == "tiny"
    with pytest.raises(ValueError, match="without its chat"):
        chat_body("tiny", PromptImages([url], {}), 1, SamplingParams(max_tokens=2))


def edited_chat(fake, edit):
    """``fake``, its chat answers passed through ``edit`` (a server that answers otherwise)."""

    def handler(request: httpx.Request) -> httpx.Response:
        response = fake(request)
        if request.url.path != "/v1/chat/completions":
            return response
        data = json.loads(response.read())
        edit(data)
        return httpx.Response(200, json=data)

    return handler


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(prompt_token_ids=d["prompt_token_ids"][:-1]), r"differ from the trainer's \(\d+\) from token \d+ on"),
        (lambda d: d["prompt_token_ids"].__setitem__(3, 7), r"image prompt 0 \(\d+\) differ from the trainer's \(\d+\) from token 3 on"),
        (lambda d: d.pop("prompt_token_ids"), "without its prompt token ids"),
        (lambda d: d["choices"][0].pop("logprobs"), "no usable logprob"),
    ],
)
def test_a_chat_answer_the_trainer_cannot_score_is_an_error(vlm, rows, edit, message):
    tokenizer, processor, model = vlm
    fake = FakeVLLM(tokenizer, model=model, processor=processor)
    sampler = make_sampler(edited_chat(fake, edit), tokenizer)
    tokens, images = prompt_images(tokenizer, rows[0])
    with pytest.raises(ServerResponseError, match=message):
        sampler.sample([tokens], 1, PARAMS, images=[images])
    sampler.close()


def test_the_logprobs_mode_probe_of_an_image_prompt_goes_as_text(vlm, rows):
    tokenizer, processor, model = vlm
    fake = FakeVLLM(tokenizer, model=model, processor=processor)
    sampler = make_sampler(fake, tokenizer)
    tokens, images = prompt_images(tokenizer, rows[0])
    sampler.sample([tokens], 1, SamplingParams(max_tokens=2, temperature=0.7), images=[images])
    probe = tokenizer.encode(TOKENIZER_PROBE)
    assert [b["prompt"] for p, b in fake.requests if p == "/v1/completions"][0] == [probe]
    assert sampler.logprobs_mode == "processed"
    assert [p for p, _ in fake.requests][-1] == "/v1/chat/completions"
    sampler.close()


@pytest.mark.slow
def test_two_fp32_steps_through_the_server_score_the_prompts_it_sampled_from(tiny_vlm_dir, vlm, tmp_path):
    from transformers import AutoModelForImageTextToText

    from grpo_core.config import RunConfig
    from grpo_core.train import run

    tokenizer, processor, _ = vlm
    fake = FakeVLLM(tokenizer, model=AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval(), processor=processor)
    initial = {name: value.clone() for name, value in fake.model.state_dict().items()}
    server = LocalHTTPServer(fake)
    try:
        config = RunConfig(
            model=str(tiny_vlm_dir), dataset=str(tiny_vlm_dir / "data" / "rows.jsonl"), max_steps=2, prompt_groups_per_step=2,
            completions_per_prompt=4, max_completion_tokens=6, reward=["format"], logger=["jsonl"], run_dir=str(tmp_path / "run"),
            drop_zero_variance_groups=False, learning_rate=1e-2, sampler="openai", dtype="float32",
            plugin_options={
                "sampler": {"openai": {"base_url": server.url}},
                "reward": {"format": {"pattern": "e"}},  # earned about half the time by the random model
                "weight_sync": {"vllm": {"weights_dir": str(tmp_path / "weights"), "method": "full"}},
            },
        )  # fmt: skip
        run(config)
    finally:
        server.close()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["mismatch/logprob_abs_max"] <= 1e-4, m
        assert m["sync/logprob_max_abs_diff"] <= 1e-4, m
    assert any(m["optim/grad_norm"] > 0 for m in metrics)
    chats = [b for p, b in fake.requests if p == "/v1/chat/completions"]
    assert len(chats) == 4 and all(b["n"] == 4 for b in chats)
    assert all(any(part["type"] == "image_url" for part in b["messages"][0]["content"]) for b in chats)
    # The second step sampled from the first step's update, which the server reloaded: its language model changed.
    assert len(fake.reload_paths) >= 2
    served = fake.model.state_dict()
    changed = {name.removeprefix("model.").split(".")[0] for name in initial if not torch.equal(served[name], initial[name])}
    assert "language_model" in changed and not changed & {"vision_tower", "multi_modal_projector"}, changed
