"""The vllm sampler's logic without vLLM: a fake engine that records its calls (the real engine:
tests/integration/test_vllm_in_process.py)."""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import attrs
import pytest
import torch

from grpo_core import PluginError, SamplingParams
from grpo_core.config import RunConfig
from grpo_core.metrics import scope
from grpo_core.plugins.samplers.vllm import (
    VLLMSampler,
    VLLMSamplerPlugin,
    import_vllm,
    kept_process_state,
    parse_outputs,
    request_seed,
    sleep_words,
    staged,
)


def logprob(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value)


class FakeLLM:
    """vllm.LLM's surface the sampler uses; each completion is the prompt's last token + 1, + 2, ..."""

    def __init__(self, finish_reason: str = "length") -> None:
        self.calls: list[str] = []
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.requests: list = []
        self.finish_reason = finish_reason

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append("generate")
        self.requests.extend(params)
        outputs = []
        for prompt, p in zip(prompts, params):
            if p.prompt_logprobs is not None:
                ids = prompt["prompt_token_ids"]
                rows = [None] + [{t: logprob(-0.5 * i)} for i, t in enumerate(ids[1:], 1)]
                outputs.append(SimpleNamespace(prompt_logprobs=rows, outputs=[]))
                continue
            last = prompt["prompt_token_ids"][-1]
            choices = []
            for j in range(p.n):
                tokens = [(last + j + k) % 50 for k in range(1, p.max_tokens + 1)]
                choices.append(
                    SimpleNamespace(
                        index=j, token_ids=tokens, logprobs=[{t: logprob(-0.25)} for t in tokens], finish_reason=self.finish_reason
                    )
                )
            outputs.append(SimpleNamespace(outputs=list(reversed(choices))))
        return outputs

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags) if tags else 'all'})")

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        self.loaded = list(kwargs["weights_iterator"])

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def fake_params(**kwargs):
    kwargs.setdefault("prompt_logprobs", None)
    return SimpleNamespace(**kwargs)


def make_sampler(llm: FakeLLM, tokenizer, level: int = 0, **kwargs) -> VLLMSampler:
    return VLLMSampler(
        llm=llm, tokenizer=tokenizer, seed=7, sleep_level=level, device_type="cpu", engine_device=torch.device("cpu"),
        sampling_params=fake_params, tokens_prompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}, **kwargs,
    )  # fmt: skip


def weights() -> list[tuple[str, torch.Tensor]]:
    return [("a.weight", torch.ones(2, 3)), ("b.weight", torch.zeros(4))]


@pytest.mark.parametrize(
    ("options", "config", "device", "level"),
    [
        ({}, {}, "cuda", 2),  # a full fine-tune: the next sync replaces every weight
        ({}, {}, "cpu", 2),  # the calls are made on CPU too, where vLLM ignores them
        ({}, {"lora_rank": 4}, "cuda", 1),  # LoRA replaces the adapted modules only: the rest must survive sleep
        ({}, {"weight_sync_interval": 2}, "cuda", 1),  # sampling runs ahead on weights no sync brings back
        ({"sleep_mode": "on"}, {}, "cuda", 2),
        ({"sleep_mode": "off"}, {}, "cuda", 0),
        ({}, {"loop": "async"}, "cuda", 0),  # the async loop samples while training: never idle
    ],
)
def test_sleep_level(options, config, device, level):
    assert VLLMSamplerPlugin(**options).sleep_level(RunConfig(**config), device) == level


@pytest.mark.parametrize(
    ("config", "device", "message"),
    [
        ({"loop": "async"}, "cuda", "--loop async samples while the trainer trains"),
        ({}, "cpu", "vLLM runs on cpu here, where sleep does nothing"),
    ],
)
def test_sleep_mode_on_is_refused_where_it_cannot_free_memory(config, device, message):
    with pytest.raises(PluginError, match=message):
        VLLMSamplerPlugin(sleep_mode="on").sleep_level(RunConfig(**config), device)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be in"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_model_len": -1}, "max_model_len must be >= 0"),
        ({"kv_cache_gib": -1.0}, "kv_cache_gib must be >= 0"),
        ({"sleep_mode": "sometimes"}, "sleep_mode must be one of auto, on, off"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        VLLMSamplerPlugin(**options)


def test_without_vllm_the_error_names_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(PluginError, match=r'pip install "grpo-core\[vllm\]"'):
        import_vllm()


def test_a_trainer_outside_this_process_is_refused_before_vllm_is_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    remote = SimpleNamespace(tokenizer=None, version=0)
    with pytest.raises(PluginError, match="needs --backend local or fsdp, not a SimpleNamespace"):
        VLLMSamplerPlugin().make_sampler(config=RunConfig(), trainer=remote)


def test_sampling_sleeps_after_and_the_sync_wakes_weights_then_kv_cache(tokenizer):
    llm = FakeLLM()
    sampler = make_sampler(llm, tokenizer, level=2)
    with scope() as recorded:
        groups = sampler.sample([[3, 4], [9]], 2, SamplingParams(max_tokens=3))
    assert [[c.tokens for c in g] for g in groups] == [[[5, 6, 7], [6, 7, 8]], [[10, 11, 12], [11, 12, 13]]]
    assert all(c.logprobs == [-0.25] * 3 and c.finish_reason == "length" for g in groups for c in g)
    assert recorded["sampler/prompts"] == 2.0 and recorded["sampler/completions"] == 4.0
    assert llm.calls == ["generate", "sleep(2)"] and sampler.asleep
    loaded = sampler.load_weights(weights, max_staged_bytes=1 << 20)
    assert loaded == (6 + 4) * 4
    assert llm.calls[2:] == ["wake_up(weights)", "reload_weights", "wake_up(kv_cache)", "reset_prefix_cache"]
    assert [n for n, _ in llm.loaded] == ["a.weight", "b.weight"] and not sampler.asleep
    # Awake: a load (the start of a run) makes no wake calls.
    sampler.load_weights(weights, max_staged_bytes=1 << 20)
    assert llm.calls[6:] == ["reload_weights", "reset_prefix_cache"]


def test_sampling_again_before_a_sync_wakes_level_1_and_reloads_level_2(tokenizer):
    llm = FakeLLM()
    sampler = make_sampler(llm, tokenizer, level=1)
    params = SamplingParams(max_tokens=1)
    sampler.sample([[1]], 2, params)
    sampler.sample([[1]], 2, params)  # a second round of the step: the weights came back from CPU memory
    assert llm.calls == ["generate", "sleep(1)", "wake_up(all)", "generate", "sleep(1)"]

    llm = FakeLLM()
    sampler = make_sampler(llm, tokenizer, level=2)
    sampler.sample([[1]], 2, params)
    with pytest.raises(PluginError, match="before any weight sync gave it weights"):
        sampler.sample([[1]], 2, params)
    sampler.load_weights(weights, max_staged_bytes=1 << 20)
    sampler.sample([[1]], 2, params)
    sampler.sample([[1]], 2, params)  # level 2 freed them: the last sync's weights are loaded again
    reloaded = ["wake_up(weights)", "reload_weights", "wake_up(kv_cache)", "reset_prefix_cache"]
    assert llm.calls[-8:] == ["generate", "sleep(2)", *reloaded, "generate", "sleep(2)"]


def test_no_sleep_means_no_sleep_calls(tokenizer):
    llm = FakeLLM()
    sampler = make_sampler(llm, tokenizer, level=0)
    sampler.sample([[1]], 2, SamplingParams(max_tokens=1))
    sampler.load_weights(weights, max_staged_bytes=1 << 20)
    assert llm.calls == ["generate", "reload_weights", "reset_prefix_cache"]


def test_requests_carry_the_run_settings_and_seeds_that_repeat_on_resume_and_differ_between_prompts(tokenizer):
    llm = FakeLLM()
    sampler = make_sampler(llm, tokenizer, version=3)
    params = SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, top_k=5, stop=["\n"], stop_token_ids=[2])
    sampler.sample([[1], [2]], 2, params)
    sampler.sample([[1], [2]], 2, params)
    first = llm.requests[0]
    assert (first.n, first.max_tokens, first.temperature, first.top_p, first.top_k) == (2, 2, 0.7, 0.9, 5)
    assert (first.stop, first.stop_token_ids, first.logprobs) == (["\n"], [2], 0)
    seeds = [r.seed for r in llm.requests]
    assert seeds == [request_seed(7, 3, call, prompt) for call in (0, 1) for prompt in (0, 1)]
    assert len(set(seeds)) == 4
    # A new version starts its calls from 0: a resumed run (a new sampler) draws what the first run drew.
    sampler.version = 4
    sampler.sample([[1]], 2, params)
    assert llm.requests[-1].seed == request_seed(7, 4, 0, 0) != request_seed(7, 3, 0, 0)


def test_top_k_off_is_vllms_minus_one_and_greedy_logprobs_are_zero(tokenizer):
    llm = FakeLLM(finish_reason="stop")
    groups = make_sampler(llm, tokenizer).sample([[1]], 2, SamplingParams(max_tokens=2, temperature=0.0))
    assert llm.requests[0].top_k == -1 and llm.requests[0].stop is None
    assert all(c.logprobs == [0.0, 0.0] and c.finish_reason == "stop" for c in groups[0])


def test_empty_prompts_are_refused(tokenizer):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        make_sampler(FakeLLM(), tokenizer).sample([[1], []], 2, SamplingParams())


def choice(tokens, logprobs, finish="length", index=0):
    return SimpleNamespace(index=index, token_ids=tokens, logprobs=logprobs, finish_reason=finish)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (SimpleNamespace(outputs=[choice([1], [{1: logprob(-1.0)}])]), "returned 1 completions for n=2"),
        (SimpleNamespace(outputs=[choice([1, 2], None), choice([1], [{1: logprob(-1.0)}], index=1)]), "no logprob for every sampled token"),
        (SimpleNamespace(outputs=[choice([99], [{99: logprob(-1.0)}]), choice([1], [{1: logprob(-1.0)}], index=1)]), "outside"),
        (SimpleNamespace(outputs=[choice([1], [{1: logprob(-1.0)}], "abort"), choice([1], [{1: logprob(-1.0)}], index=1)]), "'abort'"),
    ],
)
def test_unusable_engine_outputs_are_errors(output, message):
    with pytest.raises(PluginError, match=message):
        parse_outputs(output, 2, vocab_size=50, greedy=False)


def test_prompt_logprobs_skip_the_first_token(tokenizer):
    sampler = make_sampler(FakeLLM(), tokenizer)
    assert sampler.prompt_logprobs([5, 6, 7]) == [0.0, -0.5, -1.0]


def test_staging_copies_other_devices_in_chunks_bounded_in_bytes():
    events: list[str] = []

    def source():
        for i in range(4):  # 4, 8, 12, 16 bytes
            events.append(f"take w{i}")
            yield f"w{i}", torch.zeros(i + 1)

    for name, tensor in staged(source(), torch.device("meta"), max_bytes=20):
        assert tensor.device.type == "meta"
        events.append(f"hand {name}")
    # A chunk is copied and handed over before the next one is copied: at most 20 bytes staged.
    assert events == ["take w0", "take w1", "take w2", "hand w0", "hand w1", "take w3", "hand w2", "hand w3"]
    # Tensors on the engine's device pass without a copy.
    same = torch.zeros(3)
    assert next(staged(iter([("x", same)]), torch.device("cpu"), max_bytes=1))[1] is same


def test_the_run_keeps_its_random_streams_and_threads_whatever_the_engine_does():
    import numpy as np

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    threads = torch.get_num_threads()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    set_num_threads = torch.set_num_threads
    with kept_process_state():
        # What vLLM's worker does in this process: reseed everything, replace set_num_threads.
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        torch.set_num_threads(threads + 1)
        torch.set_num_threads = lambda n: None
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_run_info_says_how_it_samples(tokenizer):
    # On a CPU sleep and wake_up are vLLM's no-ops: called, and said to free nothing.
    assert make_sampler(FakeLLM(), tokenizer, level=2).run_info == {
        "engine": "vllm.LLM in this process on cpu, processed logprobs; "
        "sleep while training: off (level 2 calls, which free nothing on cpu)"
    }
    assert sleep_words(2, "cuda") == "level 2" and sleep_words(1, "cuda") == "level 1" and sleep_words(0, "cpu") == "off"
    assert attrs.fields_dict(VLLMSamplerPlugin)["sleep_mode"].default == "auto"
