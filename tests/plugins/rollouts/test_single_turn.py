from __future__ import annotations

import pytest

from grpo_core import PluginError, Prompt, SamplingParams, make_plugin
from grpo_core.config import RunConfig
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSamplerPlugin

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def sampler(tiny_model_dir):
    config = RunConfig(model=str(tiny_model_dir))
    return LocalSamplerPlugin().make_sampler(config=config, trainer=LocalBackend().make_trainer(config=config))


def test_text_prompts_become_aligned_samples(sampler):
    rollout = make_plugin("single_turn")
    prompts = [Prompt(id="a", text="Question: what is 1 plus 2?\nAnswer:"), Prompt(id="b", text="what")]
    groups = rollout.rollout(prompts=prompts, num_samples=3, sampler=sampler, params=SamplingParams(max_tokens=5))
    assert [len(g) for g in groups] == [3, 3]
    prompt_ids = sampler.tokenizer(prompts[0].text)["input_ids"]
    for s in groups[0]:
        n = len(prompt_ids)
        assert s.tokens[:n] == prompt_ids and s.prompt is prompts[0]
        assert s.loss_mask == [0.0] * n + [1.0] * (len(s.tokens) - n)
        assert s.sampling_logprobs[:n] == [0.0] * n and all(lp <= 0 for lp in s.sampling_logprobs[n:])
        assert s.text == sampler.tokenizer.decode(s.tokens[n:], skip_special_tokens=True)
        assert s.policy_version == 0
        # "stop" exactly when the completion ends with the end-of-sequence token, else "length" at max_tokens.
        ends_with_eos = s.tokens[-1] == sampler.tokenizer.eos_token_id
        assert s.finish_reason == ("stop" if ends_with_eos else "length")
        assert ends_with_eos or len(s.tokens) - n == 5


def test_chat_messages_use_the_chat_template(sampler):
    rollout = make_plugin("single_turn")
    chat = Prompt(id="c", messages=[{"role": "user", "content": "what is 1 plus 2?"}])
    with pytest.raises(PluginError, match="prompt c is a chat .* no chat template"):
        rollout.rollout(prompts=[chat], num_samples=1, sampler=sampler, params=SamplingParams(max_tokens=2))
    sampler.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        group = rollout.rollout(prompts=[chat], num_samples=1, sampler=sampler, params=SamplingParams(max_tokens=2))[0]
        expected = sampler.tokenizer("<user>what is 1 plus 2?\n<assistant>")["input_ids"]
        assert group[0].tokens[: len(expected)] == expected
        # A plain prompt goes through the template too, unless chat_template=false.
        text = Prompt(id="t", text="hi")
        wrapped = make_plugin("single_turn").rollout(prompts=[text], num_samples=1, sampler=sampler, params=SamplingParams(max_tokens=1))[
            0
        ][0]
        raw = make_plugin("single_turn", chat_template=False).rollout(
            prompts=[text], num_samples=1, sampler=sampler, params=SamplingParams(max_tokens=1)
        )[0][0]
        assert wrapped.tokens[:-1] == sampler.tokenizer("<user>hi\n<assistant>")["input_ids"]
        assert raw.tokens[:-1] == sampler.tokenizer("hi")["input_ids"]
    finally:
        sampler.tokenizer.chat_template = None


def test_long_prompts_error_or_skip(sampler):
    long = Prompt(id="d.jsonl:7", text="zq!~" * 100)
    short = Prompt(id="d.jsonl:8", text="what")
    params = SamplingParams(max_tokens=8)
    with pytest.raises(PluginError, match=r"prompt d.jsonl:7 has \d+ tokens; with max_completion_tokens=8 that exceeds the model's 256"):
        make_plugin("single_turn").rollout(prompts=[long, short], num_samples=2, sampler=sampler, params=params)
    groups = make_plugin("single_turn", long_prompts="skip").rollout(prompts=[long, short], num_samples=2, sampler=sampler, params=params)
    assert len(groups[0]) == 0 and len(groups[1]) == 2


def test_encode_is_what_the_rollout_samples_from_and_is_kept(sampler):
    rollout = make_plugin("single_turn")
    prompt = Prompt(id="d.jsonl:3", text="what is 2 plus 2?")
    tokens = rollout.encode(sampler.tokenizer, prompt)
    assert tokens == sampler.tokenizer(prompt.text)["input_ids"]
    # The start-up length check encodes every prompt; the rollout then reuses those tokens.
    rollout._token_cache[prompt.id] = tokens[:3]
    sample = rollout.rollout(prompts=[prompt], num_samples=1, sampler=sampler, params=SamplingParams(max_tokens=1))[0][0]
    assert sample.tokens[:3] == tokens[:3] and sample.loss_mask[:4] == [0.0, 0.0, 0.0, 1.0]
    sampler.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        assert (
            make_plugin("single_turn").encode(sampler.tokenizer, prompt)
            == sampler.tokenizer("<user>what is 2 plus 2?\n<assistant>")["input_ids"]
        )
        assert make_plugin("single_turn", chat_template=False).encode(sampler.tokenizer, prompt) == tokens
    finally:
        sampler.tokenizer.chat_template = None
