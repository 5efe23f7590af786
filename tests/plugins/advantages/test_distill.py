"""The distill advantage: the teacher's per-token logprobs against the sampler's, on tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.config import RunConfig
from grpo_core.engine.trainer import LocalReference
from grpo_core.plugins.advantages.distill import same_tokenizer
from grpo_core.plugins.advantages.grpo import GRPOAdvantage
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import compute_advantages
from tests.conftest import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)


def teacher_logprobs(path, tokens: list[int]) -> list[float]:
    """log pi_teacher(tokens[t] | tokens[:t]) for t >= 1, computed here with transformers alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def make_group(rewards=(1.0, 0.0, 0.5)) -> list[Sample]:
    tokenizer = build_tiny_tokenizer()
    prompt = Prompt(id="p", text="Question: what is 2 plus 3?\nAnswer:")
    group = []
    for i, reward in enumerate(rewards):
        ids = tokenizer.encode(prompt.text + f" 2 + 3 = {4 + i}\n#### {4 + i}")
        start = len(tokenizer.encode(prompt.text))
        sampled = [-0.1 * (t % 5) - 0.5 for t in range(len(ids))]  # some sampler logprobs
        sample = Sample(prompt, ids, [0.0] * start + sampled[start:], [0.0] * start + [1.0] * (len(ids) - start), "", "stop", 0)
        sample.reward = reward
        group.append(sample)
    return group


def started(plugin, model: str, device: str = "cpu"):
    plugin.on_run_start(config=RunConfig(model=model, device=device), run_dir=None, total_steps=None, start_step=0)
    return plugin


def advantages_of(plugin, group):
    kept, metrics = compute_advantages(build_manager([plugin]), [group], drop_zero_variance=True)
    return kept[0], metrics


def test_each_trained_token_gets_the_teacher_minus_the_sampler_logprob(teacher_dir, tiny_model_dir):
    group = make_group()
    plugin = started(make_plugin("distill", teacher=str(teacher_dir)), str(tiny_model_dir))
    kept, metrics = advantages_of(plugin, group)
    kl, tokens = 0.0, 0
    for sample in kept:
        expected_teacher = teacher_logprobs(teacher_dir, sample.tokens)
        for t, (adv, trained) in enumerate(zip(sample.advantages, sample.loss_mask)):
            if trained and t > 0:
                assert adv == pytest.approx(expected_teacher[t - 1] - sample.sampling_logprobs[t], abs=1e-4)
                kl += sample.sampling_logprobs[t] - expected_teacher[t - 1]
                tokens += 1
            else:
                assert adv == 0.0
    assert metrics["distill/reverse_kl"] == pytest.approx(kl / tokens, abs=1e-4)


def test_kl_coef_scales_and_reward_weight_adds_the_grpo_advantage(teacher_dir, tiny_model_dir):
    base, _ = advantages_of(started(make_plugin("distill", teacher=str(teacher_dir)), str(tiny_model_dir)), make_group())
    base_adv = [list(s.advantages) for s in base]
    group = make_group()
    plugin = started(make_plugin("distill", teacher=str(teacher_dir), kl_coef=0.5, reward_weight=2.0), str(tiny_model_dir))
    mixed, _ = advantages_of(plugin, group)
    task = GRPOAdvantage().advantage([1.0, 0.0, 0.5], group)
    for sample, before, bonus in zip(mixed, base_adv, task):
        for t, trained in enumerate(sample.loss_mask):
            expected = 0.5 * before[t] + 2.0 * bonus if trained and t > 0 else 0.0
            assert sample.advantages[t] == pytest.approx(expected, abs=1e-5)


def test_a_teacher_that_is_the_sampler_gives_no_advantage(tiny_model_dir):
    group = make_group()
    for sample in group:
        own = teacher_logprobs(tiny_model_dir, sample.tokens)
        sample.sampling_logprobs = [0.0] + [lp if m else 0.0 for lp, m in zip(own, sample.loss_mask[1:])]
    plugin = started(make_plugin("distill", teacher=str(tiny_model_dir)), str(tiny_model_dir))
    kept, metrics = compute_advantages(build_manager([plugin]), [group], drop_zero_variance=False)
    assert max(abs(a) for s in kept[0] for a in s.advantages) < 1e-4
    assert abs(metrics["distill/reverse_kl"]) < 1e-5


@pytest.mark.parametrize(("batch_size", "forwards"), [(1, 3), (2, 2), (16, 1)])
def test_batch_size_sets_the_teacher_forwards(teacher_dir, tiny_model_dir, batch_size, forwards, monkeypatch):
    plugin = started(make_plugin("distill", teacher=str(teacher_dir), batch_size=batch_size), str(tiny_model_dir))
    sizes, forward = [], LocalReference.forward
    monkeypatch.setattr(LocalReference, "forward", lambda self, datums: sizes.append(len(datums)) or forward(self, datums))
    advantages_of(plugin, make_group())
    assert len(sizes) == forwards and sum(sizes) == 3 and max(sizes) <= batch_size


def test_dtype_is_the_teachers_own(teacher_dir, tiny_model_dir):
    default = started(make_plugin("distill", teacher=str(teacher_dir)), str(tiny_model_dir))
    bf16 = started(make_plugin("distill", teacher=str(teacher_dir), dtype="bfloat16"), str(tiny_model_dir))
    assert next(default._teacher_model()[0].model.parameters()).dtype == torch.float32  # auto on CPU
    assert next(bf16._teacher_model()[0].model.parameters()).dtype == torch.bfloat16
    a, _ = advantages_of(default, make_group())
    b, _ = advantages_of(bf16, make_group())
    assert a[0].advantages != b[0].advantages


def test_the_teacher_runs_on_the_runs_device(teacher_dir, tiny_model_dir):
    plugin = started(make_plugin("distill", teacher=str(teacher_dir)), str(tiny_model_dir))
    assert plugin._teacher_model()[0].device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(PluginError, match="--device cuda was asked for, but no CUDA device is available"):
            started(make_plugin("distill", teacher=str(teacher_dir)), str(tiny_model_dir), device="cuda")


def test_a_teacher_with_another_tokenizer_is_refused_at_start(tiny_model_dir):
    with pytest.raises(
        PluginError, match=r"distill: the teacher 'default' and the policy .* must share the tokenizer .*, but the student's vocabulary"
    ):
        started(make_plugin("distill", teacher="default"), str(tiny_model_dir))


def test_same_tokenizer_names_the_difference():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert same_tokenizer(a, b) is None
    b.add_tokens(["<extra>"])
    assert "vocabulary has 300 tokens, the teacher's 301" in same_tokenizer(a, b)


def test_advantage_without_prepare_is_an_error(teacher_dir):
    plugin = make_plugin("distill", teacher=str(teacher_dir))
    with pytest.raises(PluginError, match="the prepare_advantages hook must run before advantage"):
        plugin.advantage(rewards_G=[1.0, 0.0], samples=make_group((1.0, 0.0)))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "teacher: name the teacher model"),
        ({"teacher": "x", "kl_coef": 0}, "kl_coef must be > 0"),
        ({"teacher": "x", "reward_weight": -1}, "reward_weight must be >= 0"),
        ({"teacher": "x", "batch_size": 0}, "batch_size must be > 0"),
        ({"teacher": "x", "dtype": "float16"}, "expected one of 'auto', 'float32', 'bfloat16'"),
        ({"teacher": "x", "teacher_url": "http://h", "dtype": "bfloat16"}, "dtype is the local teacher's"),
        ({"teacher": "x", "retry_deadline": 5}, "retry_deadline is for a teacher behind teacher_url"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("distill", **options)


def test_a_missing_teacher_is_named(tmp_path, tiny_model_dir):
    with pytest.raises(PluginError, match="distill: the teacher: cannot load model"):
        started(make_plugin("distill", teacher=str(tmp_path / "nowhere")), str(tiny_model_dir))


@pytest.mark.slow
def test_distillation_lowers_the_reverse_kl_to_a_briefly_trained_teacher(tmp_path):
    """The acceptance run: the embedded model distilled from a fine-tuned copy of itself
    (scripts/build_distill_teacher.py) for 50 steps; per-token reverse KL falls."""
    import runpy

    from tests.conftest import REPO
    from tests.helpers import grpo_core_in_process

    build_teacher = runpy.run_path(str(REPO / "scripts" / "build_distill_teacher.py"))["build_teacher"]
    teacher = build_teacher(tmp_path / "teacher", steps=60)
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        "run", "--advantage", "distill", "--advantage-opt", f"teacher={teacher}", "--max-steps", "50", "--run-dir", str(run_dir),
        "--logger", "jsonl",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    kl = [json.loads(line)["distill/reverse_kl"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(kl) == 50 and all(math.isfinite(v) for v in kl)
    first, last = sum(kl[:10]) / 10, sum(kl[-10:]) / 10
    assert last < 0.7 * first, (first, last)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_run_in_either_loop_records_the_reverse_kl(teacher_dir, tiny_model_dir, tiny_dataset, tmp_path, loop):
    from tests.helpers import grpo_core_in_process, small_run_args

    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--advantage", "distill", "--advantage-opt", f"teacher={teacher_dir}",
                        "--loop", loop, "--logger", "jsonl")
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(math.isfinite(m["distill/reverse_kl"]) and m["groups/kept"] == 2 for m in metrics)


def fake_teacher_server(tokenizer, tokenize_shift: int = 0):
    """/tokenize as ``tokenizer`` (ids shifted by ``tokenize_shift``) and /v1/completions with
    vLLM-style prompt_logprobs: the teacher's logprob of token id k is -0.01 k."""
    from tests.plugins.rewards.json_server import Reply

    def answer(path, body):
        if path == "/tokenize":
            return Reply({"tokens": [t + tokenize_shift for t in tokenizer.encode(body["prompt"], add_special_tokens=False)]})
        choices = [
            {"index": i, "text": "", "prompt_logprobs": [None] + [{str(t): {"logprob": -0.01 * t, "rank": 1}} for t in prompt[1:]]}
            for i, prompt in enumerate(body["prompt"])
        ]
        return Reply({"choices": list(reversed(choices))})  # in any order: matched by index

    return answer


def test_a_teacher_behind_a_server_gives_its_prompt_logprobs(tiny_model_dir):
    from tests.plugins.rewards.json_server import json_server

    with json_server(fake_teacher_server(build_tiny_tokenizer())) as server:
        plugin = started(make_plugin("distill", teacher="teacher-name", teacher_url=server.url, batch_size=2), str(tiny_model_dir))
        kept, metrics = advantages_of(plugin, make_group())
        plugin.on_run_end(summary={}, run_dir=None)
    completions = [body for path, body, _ in server.requests if path == "/v1/completions"]
    assert [len(b["prompt"]) for b in completions] == [2, 1]  # batch_size sequences per request
    assert all(b["model"] == "teacher-name" and b["prompt_logprobs"] == 0 and b["max_tokens"] == 1 for b in completions)
    assert completions[0]["prompt"][0] == kept[0].tokens
    for sample in kept:
        for t, trained in enumerate(sample.loss_mask):
            expected = -0.01 * sample.tokens[t] - sample.sampling_logprobs[t] if trained and t > 0 else 0.0
            assert sample.advantages[t] == pytest.approx(expected, abs=1e-9)
    assert math.isfinite(metrics["distill/reverse_kl"])


def test_a_teacher_server_with_another_tokenizer_is_refused_at_start(tiny_model_dir):
    from tests.plugins.rewards.json_server import json_server

    with json_server(fake_teacher_server(build_tiny_tokenizer(), tokenize_shift=1)) as server:
        with pytest.raises(PluginError, match="must share the tokenizer .*, but the server splits a probe text into other tokens"):
            started(make_plugin("distill", teacher="t", teacher_url=server.url), str(tiny_model_dir))


def test_a_teacher_server_answer_without_prompt_logprobs_is_an_error(tiny_model_dir):
    from tests.plugins.rewards.json_server import Reply, json_server

    def no_logprobs(path, body):
        if path == "/tokenize":
            return Reply({"tokens": build_tiny_tokenizer().encode(body["prompt"], add_special_tokens=False)})
        return Reply({"choices": [{"index": i, "text": ""} for i in range(len(body["prompt"]))]})

    with json_server(no_logprobs) as server:
        plugin = started(make_plugin("distill", teacher="t", teacher_url=server.url), str(tiny_model_dir))
        with pytest.raises(PluginError, match="the teacher server's answer has no prompt logprobs"):
            advantages_of(plugin, make_group())
        plugin.on_run_end(summary={}, run_dir=None)


def test_retry_deadline_bounds_a_failing_teacher_server(tiny_model_dir):
    from grpo_core.remote.server_client import ServerUnavailable
    from tests.plugins.rewards.json_server import Reply, json_server

    def busy(path, body):
        if path == "/tokenize":
            return Reply({"tokens": build_tiny_tokenizer().encode(body["prompt"], add_special_tokens=False)})
        return Reply({"error": "busy"}, status=503)

    with json_server(busy) as server:
        plugin = started(make_plugin("distill", teacher="t", teacher_url=server.url, retry_deadline=1.0), str(tiny_model_dir))
        with pytest.raises(ServerUnavailable, match="retry deadline 1s"):
            advantages_of(plugin, make_group())
        plugin.on_run_end(summary={}, run_dir=None)
