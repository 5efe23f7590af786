"""The agent rollout: user programs (tests/plugins/rollouts/agents/) trained through the gateway."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import attrs
import pytest

from grpo_core import Completion, PluginError, Prompt, SamplingParams, make_plugin
from grpo_core.config import RunConfig
from grpo_core.metrics import scope
from grpo_core.plugins.rollouts.agent import reward_line, segments_of
from grpo_core.remote.gateway import Call
from grpo_core.types import Turn
from tests.helpers import grpo_core_in_process, small_run_args
from tests.plugins.rollouts.chat_templates import QWEN3, build_chat_tokenizer
from tests.plugins.rollouts.scripted_rollouts import EOS, ScriptedSampler, ids

AGENTS = Path(__file__).parent / "agents"
PROMPT = Prompt(id="p", text="Question: what is 1 plus 2?\nAnswer:", answer="#### 3")


def agent(name: str, **options):
    return make_plugin("rollout.agent", command=f"{sys.executable} {AGENTS / name}.py", **options)


def roll(rollout, sampler, prompts=(PROMPT,), num_samples=2, **params):
    with scope() as metrics:
        try:
            groups = rollout.rollout(prompts=list(prompts), num_samples=num_samples, sampler=sampler, params=SamplingParams(**params))
        finally:
            rollout.on_run_end()
    return groups, metrics


@attrs.define
class Answers:
    """A sampler that answers every prompt with the same tokens."""

    tokenizer: object
    reply: list[int]
    max_context: int | None = None
    version: int = 0

    def sample(self, prompts, num_samples, params):
        return [[Completion(list(self.reply), [-0.1] * len(self.reply), "stop") for _ in range(num_samples)] for _ in prompts]


def call(prompt, tokens, version=0):
    return Call(list(prompt), list(tokens), [-0.5] * len(tokens), "stop", version, None)


def test_calls_that_extend_each_other_are_one_trajectory_and_others_open_a_segment():
    calls = [
        call([1, 2], [3, 4], version=2),
        call([1, 2, 3, 4, 5], [6], version=1),  # extends the first: 5 is the program's, untrained
        call([9], [10]),  # a prefix break: a new segment
        call([1, 2, 3, 4, 5, 6, 7], [8]),  # extends the first segment again, not the latest
        call([1, 2], [11]),  # the first prompt again: its reply differs, so it extends nothing
    ]
    segments, breaks = segments_of(calls)
    assert breaks == 2 and len(segments) == 3
    first = segments[0]
    assert first.tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert first.mask == [0, 0, 1, 1, 0, 1, 0, 1]
    assert first.logprobs == [0, 0, -0.5, -0.5, 0, -0.5, 0, -0.5]
    assert first.turns == [Turn(2, 4, 5), Turn(5, 6, 7), Turn(7, 8, 8)] and first.versions == [2, 1, 0]
    assert (segments[1].tokens, segments[1].mask) == ([9, 10], [0, 1])
    assert (segments[2].tokens, segments[2].mask) == ([1, 2, 11], [0, 0, 1])
    assert segments_of([]) == ([], 0)


@pytest.mark.parametrize(
    ("stdout", "expected"),
    [
        ('thinking...\n{"reward": 0.5}\n\n', (0.5, None)),
        ('{"reward": 2}', (2.0, None)),
        ("", (None, None)),
        ('{"reward": 1}\nthe answer is 3', (None, None)),  # not the last line: no reward line
        ('{"score": 1}', (None, None)),
        ('{"reward": "high"}', (None, 'its last stdout line {"reward": "high"} holds no finite number as "reward"')),
        ('{"reward": true}', (None, 'its last stdout line {"reward": true} holds no finite number as "reward"')),
        ('{"reward": NaN}', (None, 'its last stdout line {"reward": NaN} holds no finite number as "reward"')),
    ],
)
def test_the_reward_is_the_last_stdout_line(stdout, expected):
    assert reward_line(stdout) == expected


def test_a_run_is_refused_before_anything_loads_without_a_program_or_with_r3(tmp_path):
    config = RunConfig(rollout="agent")
    with pytest.raises(PluginError, match='pass --rollout-opt command="python my_agent.py"'):
        make_plugin("rollout.agent").check_config(config=config)
    with pytest.raises(PluginError, match="'no-such-agent' is not a program found on PATH"):
        make_plugin("rollout.agent", command="no-such-agent --fast").check_config(config=config)
    with pytest.raises(PluginError, match="No closing quotation"):
        make_plugin("rollout.agent", command="python 'open").check_config(config=config)
    with pytest.raises(PluginError, match="--router-replay R3"):
        agent("two_turn").check_config(config=RunConfig(rollout="agent", router_replay="R3"))
    for bad in ({"timeout": 0}, {"max_concurrent": 0}, {"template": "jinja"}):
        with pytest.raises(PluginError):
            agent("two_turn", **bad)
    assert config.reward == {"agent": 1.0} and RunConfig(rollout="agent", reward={"gsm8k": 1.0}).reward == {"gsm8k": 1.0}


@pytest.mark.slow  # a trainer and four calls of two programs: seconds
def test_a_two_turn_agent_trains_on_its_turns_with_the_trainers_logprobs(tiny_model_dir):
    """The local sampler on a tiny model behind the gateway: each program's two calls are one
    trajectory, and the trainer's logprobs of its tokens equal those the gateway recorded (fp32)."""
    import torch

    from grpo_core.backend import sample_to_datum
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    config = RunConfig(model=str(tiny_model_dir))
    trainer = LocalBackend().make_trainer(config=config)
    sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=trainer)
    groups, metrics = roll(agent("two_turn"), sampler, num_samples=2, max_tokens=6)
    assert metrics["agent/calls_mean"] == 2.0 and metrics["agent/prefix_breaks"] == 0
    assert metrics["agent/failed"] == 0 and metrics["agent/timeouts"] == 0
    tokenizer = sampler.tokenizer
    (group,) = groups
    assert len(group) == 2
    for sample in group:
        first, second = sample.turns
        assert first.end < first.context_end == second.start and second.end == second.context_end == len(sample.tokens)
        # Between the turns, untrained: what the (plain) template writes after the answer and the agent's next message.
        between = tokenizer.decode(sample.tokens[first.end : first.context_end])
        assert between.endswith("\nCheck it.\nAnswer:") and sum(sample.loss_mask[first.end : first.context_end]) == 0
        assert sample.text == tokenizer.decode(sample.tokens[second.start : second.end], skip_special_tokens=True)
        assert sample.env_reward == float(any(c.isdigit() for c in sample.text))
        (logprobs,) = trainer.forward([sample_to_datum(sample)])
        mask = torch.tensor(sample.loss_mask[1:]) > 0
        assert int(mask.sum()) == (first.end - first.start) + (second.end - second.start)
        assert (logprobs[mask] - torch.tensor(sample.sampling_logprobs[1:])[mask]).abs().max() <= 2e-5


@pytest.mark.slow  # it waits for the deadline
def test_a_hanging_program_is_ended_at_its_deadline_with_its_process_group(tmp_path, monkeypatch, embedded_tokenizer):
    """Program p hangs: it fails at its deadline. Program q exits with its reward while a child of
    its own holds its output: it succeeds, read once the deadline ends the child. Both children end."""
    children = tmp_path / "children"
    monkeypatch.setenv("CHILDREN", str(children))
    sampler = Answers(embedded_tokenizer, ids(embedded_tokenizer, " 3"))
    t0 = time.perf_counter()
    groups, metrics = roll(agent("hanging", timeout=4), sampler, prompts=[PROMPT, attrs.evolve(PROMPT, id="q")], num_samples=1)
    assert time.perf_counter() - t0 < 30
    assert metrics["agent/timeouts"] == 1 and metrics["agent/failed"] == 1
    assert groups[0] == [] and [s.env_reward for s in groups[1]] == [1.0]
    pids = [int(p) for p in children.read_text().split()]
    assert len(pids) == 2
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    with pytest.raises(PluginError, match=r"every agent program failed \(1 of 1; 1 timed out\).*past its timeout of 1 s"):
        roll(agent("hanging", timeout=1), sampler, num_samples=1)


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_failed_programs_are_counted_and_dropped_while_others_train(tmp_path, monkeypatch, embedded_tokenizer):
    monkeypatch.setenv("COUNTER", str(tmp_path / "counter"))
    sampler = Answers(embedded_tokenizer, ids(embedded_tokenizer, " 3"))
    rollout = agent("counted_crash")
    groups, metrics = roll(rollout, sampler, prompts=[PROMPT, attrs.evolve(PROMPT, id="q")], num_samples=2)
    # The second and fourth programs to start crash, whichever prompt they were for.
    assert sum(len(g) for g in groups) == 2 and metrics["agent/failed"] == 2 and metrics["agent/calls_mean"] == 1
    assert all(s.env_reward == 1.0 and s.text == " 3" for g in groups for s in g)
    # Once one has succeeded, a call whose every program fails leaves empty groups, counted.
    monkeypatch.setenv("COUNTER", str(tmp_path / "odd"))
    (tmp_path / "odd").write_text("x")
    groups, metrics = roll(rollout, sampler, num_samples=1)
    assert groups == [[]] and metrics["agent/failed"] == 1


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from transformers import AutoTokenizer

    from grpo_core.embedded import ASSETS

    return AutoTokenizer.from_pretrained(ASSETS)


TOOL_TEMPLATE = QWEN3.replace(
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == 'tool' %}",
    "        {%- for call in message.tool_calls or [] %}{{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{\"name\": \"'"
    " + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == 'tool' %}",
)
"""Qwen3's template with its rendering of the assistant's tool calls."""


@pytest.mark.slow  # the program imports the openai package: seconds
def test_a_tool_calling_streaming_agent_is_one_trajectory_through_its_tool_call():
    tokenizer = build_chat_tokenizer("qwen3")
    tokenizer.chat_template = TOOL_TEMPLATE
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    sampler = ScriptedSampler(tokenizer, [[call_text], ["The answer is 5." + EOS]], max_context=1024)
    groups, metrics = roll(
        agent("tool_calling"), sampler, prompts=[attrs.evolve(PROMPT, text="what is 2 plus 3?")], num_samples=1, max_tokens=64
    )
    (sample,) = groups[0]
    assert metrics["agent/prefix_breaks"] == 0 and metrics["agent/calls_mean"] == 2
    assert sample.env_reward == 1.0 and sample.text == "The answer is 5."
    first, second = sample.turns
    assert sample.tokens[first.start : first.end] == ids(tokenizer, call_text)
    assert tokenizer.decode(sample.tokens[first.end : second.start]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.tokens[second.start : second.end] == [*ids(tokenizer, "The answer is 5."), tokenizer.eos_token_id]
    # The gateway asked for the format's stop string with the tools.
    assert sampler.calls[0][2].stop == ["</tool_call>"]


def run_args(tiny_model_dir, tiny_dataset, run_dir, name, *extra):
    return small_run_args(
        tiny_model_dir, tiny_dataset, run_dir, "--rollout", "agent", "--rollout-opt", f"command={sys.executable} {AGENTS / name}.py", *extra
    )


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_run_trains_an_agent_program_through_the_cli_and_resumes(tiny_model_dir, tiny_dataset, tmp_path, loop):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(*run_args(tiny_model_dir, tiny_dataset, run_dir, "two_turn", "--loop", loop))
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["reward"] == {"agent": 1.0} and config["rollout"] == "agent"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        assert m["agent/calls_mean"] == 2.0 and m["agent/failed"] == 0 and m["agent/prefix_breaks"] == 0
        assert m["train/samples"] == 8 and m["train/tokens"] > 0 and m["reward/failed"] == 0
    # Resumed: the program and its options come back from config.json, the gateway with a new key.
    resumed = grpo_core_in_process("run", "--resume", str(run_dir), "--max-steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[2]["agent/calls_mean"] == 2.0 and metrics[2]["train/tokens"] > 0


@pytest.mark.slow
def test_a_run_whose_every_program_crashes_exits_1_without_a_traceback(tiny_model_dir, tiny_dataset, tmp_path):
    out = grpo_core_in_process(*run_args(tiny_model_dir, tiny_dataset, tmp_path / "run", "crashing"))
    assert out.returncode == 1 and "Traceback" not in out.stderr and "internal error" not in out.stderr
    assert "error: every agent program failed (8 of 8; 0 timed out) and none has succeeded in this run" in out.stderr
    assert "it exited with exit code 1: the agent broke down" in out.stderr


REPO = Path(__file__).resolve().parents[3]
PAGE = REPO / "docs" / "agents.md"


def test_the_docs_show_the_example_agent_as_it_is():
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)
    assert (REPO / "examples" / "agent.py").read_text() in blocks
    assert "grpo_core" not in (REPO / "examples" / "agent.py").read_text()


@pytest.mark.slow
def test_the_docs_command_trains_the_example_agent_on_the_embedded_model_every_step(tmp_path):
    """Acceptance: an agent written with httpx alone, two turns where its first answer is wrong,
    trains 3 steps of the embedded model (its chat template grpo-core's plain one); completion
    tokens are trained on every step."""
    (command,) = re.findall(r"^grpo-core run --rollout agent .*$", PAGE.read_text(), flags=re.M)
    args = shlex.split(command)[1:]
    # The docs' `python` is the one running the tests (it has httpx); the run folder goes to tmp_path.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    out = grpo_core_in_process(*args, "--run-dir", str(tmp_path / "run"), cwd=REPO, env={"PATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    for m in metrics:
        assert m["train/tokens"] > 0 and m["agent/failed"] == 0 and m["agent/prefix_breaks"] == 0
        assert 1.0 <= m["agent/calls_mean"] <= 2.0 and m["reward/failed"] == 0
    assert any(m["agent/calls_mean"] > 1.0 for m in metrics)  # wrong first answers got their second turn


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return build_chat_tokenizer("qwen3")


def probe(tmp_path, monkeypatch, sampler, num_samples=1, **options):
    """The probe agent's view of the programs run with ``options``, and the rollout's groups (its error when it refused)."""
    log = tmp_path / f"probe{len(list(tmp_path.iterdir()))}"
    monkeypatch.setenv("PROBE", str(log))
    try:
        groups, _ = roll(agent("probe", **options), sampler, num_samples=num_samples)
    except PluginError as exc:
        groups = str(exc)
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else [], groups


@pytest.mark.slow  # ten programs, one at a time for a part
def test_the_options_reach_the_programs_and_the_gateway(tmp_path, monkeypatch, qwen3_tokenizer):
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    sampler = Answers(qwen3_tokenizer, ids(qwen3_tokenizer, call_text))
    # override_sampling: the probe's temperature 0.5 is refused, then sampled with the run's; model_name.
    seen, refused = probe(tmp_path, monkeypatch, sampler, model_name="mine")
    assert [s["status"] for s in seen] == [400] and "differs from the run's temperature 1.0" in seen[0]["body"]["error"]["message"]
    assert "it made no call to the gateway" in refused and {s["model"] for s in seen} == {"mine"}
    seen, groups = probe(tmp_path, monkeypatch, sampler, override_sampling=True)
    assert [s["status"] for s in seen] == [200] and {s["model"] for s in seen} == {"policy"} and len(groups[0]) == 1
    # tool_format: auto reads Qwen's hermes calls; read as llama3, the same reply is text.
    calls = [s["body"]["choices"][0]["message"]["tool_calls"] for s in seen]
    assert [[c["function"]["name"] for c in called] for called in calls] == [["add"]]
    seen, _ = probe(tmp_path, monkeypatch, sampler, override_sampling=True, tool_format="llama3")
    assert {s["body"]["choices"][0]["message"]["content"] for s in seen} == {call_text}
    # template: plain writes the contents in a row, whatever the tokenizer's own.
    seen, groups = probe(tmp_path, monkeypatch, sampler, override_sampling=True, template="plain")
    assert qwen3_tokenizer.decode(groups[0][0].tokens[: groups[0][0].turns[0].start]) == "2 plus 3?"
    # max_concurrent: one program at a time, or both at once.
    one, _ = probe(tmp_path, monkeypatch, sampler, 2, override_sampling=True, max_concurrent=1)
    first, second = sorted(one, key=lambda s: s["started"])
    assert first["ended"] <= second["started"]
    both, _ = probe(tmp_path, monkeypatch, sampler, 2, override_sampling=True)
    first, second = sorted(both, key=lambda s: s["started"])
    assert second["started"] < first["ended"]


def test_template_tokenizer_is_refused_for_a_tokenizer_without_one(embedded_tokenizer):
    with pytest.raises(PluginError, match="the tokenizer has no chat template"):
        roll(agent("two_turn", template="tokenizer"), Answers(embedded_tokenizer, [1]))


def test_one_gateway_serves_a_run_and_ends_with_it(tmp_path, monkeypatch, embedded_tokenizer):
    monkeypatch.setenv("COUNTER", str(tmp_path / "counter"))
    rollout = agent("counted_crash")
    gateway = rollout.gateway()
    assert rollout.gateway() is gateway
    rollout.on_run_end()
    assert rollout._gateway is None and rollout.gateway() is not gateway
    rollout.on_run_end()


def test_an_openai_compatible_server_sampler_serves_behind_the_gateway(tiny_model_dir):
    """The openai sampler (a stand-in vLLM server, several calls at once) behind the gateway: the
    server's tokens and logprobs are what the samples hold, turns extending each other."""
    import httpx
    from transformers import AutoTokenizer

    from grpo_core.plugins.samplers.openai import ServerSampler
    from grpo_core.remote.server_client import ServerClient
    from tests.plugins.samplers.fake_server import FakeVLLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    fake = FakeVLLM(tokenizer)
    client = ServerClient("http://fake/v1", api_key="", concurrency=4, retry_deadline=5.0, transport=httpx.MockTransport(fake))
    sampler = ServerSampler(client=client, tokenizer=tokenizer, model="tiny", concurrent_samples=4)
    groups, metrics = roll(agent("two_turn"), sampler, max_tokens=4)
    assert metrics["agent/calls_mean"] == 2 and metrics["agent/prefix_breaks"] == 0
    prompts = [body["prompt"][0] for path, body in fake.requests if path == "/v1/completions"]
    assert len(prompts) == 4
    for sample in groups[0]:
        for turn in sample.turns:
            # The server's completion of the prompt before the turn: token k is (sum(prompt) + k) mod V.
            prompt = sample.tokens[: turn.start]
            assert prompt in prompts
            assert sample.tokens[turn.start : turn.end] == [(sum(prompt) + k) % len(tokenizer) for k in range(4)]
            assert sample.sampling_logprobs[turn.start : turn.end] == pytest.approx([-0.1, -0.2, -0.3, -0.4])


def test_a_sampler_error_behind_the_gateway_is_raised_by_the_rollout(embedded_tokenizer):
    class Broken(Answers):
        def sample(self, prompts, num_samples, params):
            raise ConnectionError("the server went away")

    with pytest.raises(ConnectionError, match="the server went away"):
        roll(agent("two_turn"), Broken(embedded_tokenizer, [1]), num_samples=1)


def test_a_template_that_drops_reasoning_breaks_the_prefix_into_two_samples_with_one_reward(qwen3_tokenizer):
    """Qwen3's template drops a past turn's reasoning: the second call does not extend the first
    one's tokens, so each is a sample of its own (agent/prefix_breaks), both with the program's reward."""
    reply = "<think>\nadd 1 and 2\n</think>\n\nThe answer is 3." + EOS
    sampler = ScriptedSampler(qwen3_tokenizer, [[reply], [reply]], max_context=1024)
    groups, metrics = roll(agent("two_turn"), sampler, num_samples=1, max_tokens=64)
    assert metrics["agent/prefix_breaks"] == 1 and metrics["agent/calls_mean"] == 2
    first, second = groups[0]
    assert [len(first.turns), len(second.turns)] == [1, 1] and first.env_reward == second.env_reward == 1.0
    assert first.text == second.text == "<think>\nadd 1 and 2\n</think>\n\nThe answer is 3."
    # The second prompt is the template's own rendering: the first turn without its reasoning.
    history = qwen3_tokenizer.decode(second.tokens[: second.turns[0].start])
    assert "<|im_start|>assistant\nThe answer is 3.<|im_end|>" in history and "add 1 and 2" not in history
