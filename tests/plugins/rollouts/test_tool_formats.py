"""Tool calls as each model family writes them: parsing (well-formed and malformed outputs, as
those models produce them), detection from the template or vocabulary, and conversations whose
calls reach a tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_core import Completion, PluginError, Prompt, hookimpl, make_plugin
from grpo_core.plugins.rollouts.tool_formats import FORMATS, ToolCall, detect
from grpo_core.plugins.samplers.local import LocalSamplerPlugin
from tests.plugins.rollouts.chat_templates import FAMILIES, build_chat_model, build_chat_tokenizer
from tests.plugins.rollouts.scripted_rollouts import EOS, RECORDED, FakeTool, ScriptedSampler, ids, run

ADD = {"expression": "18 + 34"}
CALL = ToolCall(name="calculator", arguments=ADD)
ONE = ToolCall(name="calculator", arguments={"expression": "1"})
NOT_AN_OBJECT = ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
NO_COMMA = "Expecting ',' delimiter: line 1 column {} (char {})"


@pytest.mark.parametrize(
    "fmt, text, calls",
    [
        # Qwen2.5 / Qwen3 / Hermes
        ("hermes", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 + 34"}}\n</tool_call>', [CALL]),
        (
            "hermes",
            "<think>\nI should add with the calculator.\n</think>\n\n"
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 + 34"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2 * 3\\"}"}\n</tool_call>',
            [CALL, ToolCall(name="calculator", arguments={"expression": "2 * 3"})],
        ),
        ("hermes", "The answer is 52.", []),
        (
            "hermes",
            "<tool_call>\n{'name': 'calculator', 'arguments': {'expression': '18 + 34'}}\n</tool_call>",
            [ToolCall(error="Expecting property name enclosed in double quotes: line 2 column 2 (char 2)")],
        ),
        (
            "hermes",
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 + 34"}',
            [ToolCall(error="the tool call is not closed with </tool_call>")],
        ),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', [NOT_AN_OBJECT]),
        # Llama 3.1-3.3: JSON with "parameters", or after <|python_tag|>
        ("llama3", '{"name": "calculator", "parameters": {"expression": "18 + 34"}}', [CALL]),
        ("llama3", '<|python_tag|>{"name": "calculator", "parameters": {"expression": "18 + 34"}}', [CALL]),
        (
            "llama3",
            '{"type": "function", "name": "calculator", "parameters": {"expression": "18 + 34"}}; '
            '{"name": "calculator", "parameters": {"expression": "1 + 1"}}',
            [CALL, ToolCall(name="calculator", arguments={"expression": "1 + 1"})],
        ),
        ("llama3", "The answer is 52.", []),
        ("llama3", '{"name": "calculator", "parameters": {"expression": "18 + 34"}', [ToolCall(error=NO_COMMA.format(63, 62))]),
        ("llama3", '{"expression": "18 + 34"}', [NOT_AN_OBJECT]),
        (
            "llama3",
            '{"name": "calculator", "parameters": "18 + 34"}',
            [ToolCall(name="calculator", error="Extra data: line 1 column 4 (char 3)")],
        ),
        # Mistral: v3 list, and name[ARGS]{...} (Mistral Small 3.2, Magistral)
        ("mistral", '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "18 + 34"}}]', [CALL]),
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "18 + 34"}}, '
            '{"name": "calculator", "arguments": {"expression": "1"}}]',
            [CALL, ONE],
        ),
        ("mistral", '[TOOL_CALLS]calculator[ARGS]{"expression": "18 + 34"}[TOOL_CALLS]calculator[ARGS]{"expression": "1"}', [CALL, ONE]),
        ("mistral", "The answer is 52.", []),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "18 + 34"}}',
            [ToolCall(error=NO_COMMA.format(64, 63))],
        ),
        (
            "mistral",
            '[TOOL_CALLS]{"name": "calculator", "arguments": {}}',
            [ToolCall(error="[TOOL_CALLS] is followed by a JSON list of calls, or name[ARGS]{...}")],
        ),
        ("mistral", "[TOOL_CALLS]calculator[ARGS]18 + 34", [ToolCall(name="calculator", error="Extra data: line 1 column 4 (char 3)")]),
        # DeepSeek V3 / R1, and V3.1
        (
            "deepseek",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n{"expression": "18 + 34"}\n```'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            [CALL],
        ),
        (
            "deepseek",
            '<think>\nadd\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{"expression": "18 + 34"}'
            '<｜tool▁call▁end｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{"expression": "1"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            [CALL, ONE],
        ),
        ("deepseek", "The answer is 52.", []),
        (
            "deepseek",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{"expression": "18',
            [ToolCall(error="the tool call is not closed with <｜tool▁call▁end｜>")],
        ),
        (
            "deepseek",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n{"expression": "1"}<｜tool▁call▁end｜>',
            [ToolCall(name="calculator", error="the arguments of a tool call go in a ```json block")],
        ),
        (
            "deepseek",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator {"expression": "1"}<｜tool▁call▁end｜>',
            [ToolCall(error="a tool call is NAME<｜tool▁sep｜>{arguments}")],
        ),
        # gpt-oss (harmony): the turn as the rollout reads it, its last <|call|> or <|return|> token taken off
        (
            "harmony",
            "<|channel|>analysis<|message|>Need to use function calculator.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.calculator <|constrain|>json<|message|>{"expression":"18 + 34"}',
            [CALL],
        ),
        (
            "harmony",
            ' to=functions.calculator<|channel|>commentary json<|message|>{"expression": "18 + 34"}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "1"}',
            [CALL, ONE],
        ),
        (
            "harmony",
            "<|channel|>analysis<|message|>18 + 34 = 52.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Adding up.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 52.",
            [],
        ),
        (
            "harmony",
            '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "18 + 34"',
            [ToolCall(name="calculator", error=NO_COMMA.format(25, 24))],
        ),
        (
            "harmony",
            "<|channel|>commentary to=functions.calculator <|constrain|>json",
            [ToolCall(name="calculator", error="the tool call has no <|message|> with its arguments")],
        ),
        (
            "harmony",
            '<|channel|>commentary to=functions. <|constrain|>json<|message|>{"expression": "1"}',
            [ToolCall(error="a tool call is addressed to=functions.NAME")],
        ),
        (
            "harmony",
            "<|channel|>analysis<|message|>Run it.<|end|><|start|>assistant to=python<|channel|>analysis<|message|>print(18 + 34)",
            [ToolCall(name="python", error="Expecting value: line 1 column 1 (char 0)")],
        ),
    ],
)
def test_parsing_model_outputs(fmt, text, calls):
    assert FORMATS[fmt].calls(text) == calls


@pytest.mark.parametrize(
    "family, fmt", [("qwen3", "hermes"), ("mistral", "mistral"), ("deepseek", "deepseek"), ("llama3", None), ("gpt_oss", "harmony")]
)
def test_detection_from_the_template_text(family, fmt):
    assert detect(FAMILIES[family][0], {}) == fmt


def test_detection_by_the_rollout_from_each_familys_tokenizer():
    from grpo_core.plugins.rollouts.multi_turn import MultiTurnRollout

    for family, fmt in (("qwen3", "hermes"), ("llama3", "llama3"), ("mistral", "mistral"), ("deepseek", "deepseek")):
        assert MultiTurnRollout()._tool_format(build_chat_tokenizer(family)) == fmt, family
    assert MultiTurnRollout()._tool_format(build_chat_tokenizer("qwen3_thinking")) == "hermes"  # no marker anywhere: the default


def test_detection_of_gpt_oss_from_its_tokenizer_and_vocabulary():
    from grpo_core.plugins.rollouts.multi_turn import MultiTurnRollout

    assert MultiTurnRollout()._tool_format(build_chat_tokenizer("gpt_oss")) == "harmony"
    assert detect("{{ messages }}", {"<|channel|>": 200005, "<|call|>": 200012}) == "harmony"


def test_detection_falls_back_to_the_vocabulary():
    # The hand-made Llama template names no <|python_tag|>; Llama's vocabulary has it (so do these test tokenizers).
    assert detect(FAMILIES["llama3"][0], {"<|python_tag|>": 1}) == "llama3"
    assert detect("{{ messages }}", {"a": 0}) is None
    # The template is read before the vocabulary: a Hermes template on a Llama tokenizer is Hermes.
    assert detect("<tool_call>", {"<|python_tag|>": 1}) == "hermes"


CALLS = {
    "qwen3": (
        '<tool_call>\n{"name": "fake", "arguments": {"x": 1}}\n</tool_call>',
        '<tool_call>\n{"name": "fake", "arguments": {"x": 2}\n</tool_call>',
    ),
    "llama3": ('<|python_tag|>{"name": "fake", "parameters": {"x": 1}}', '{"name": "fake", "parameters": {"x": 2}'),
    "mistral": ('[TOOL_CALLS][{"name": "fake", "arguments": {"x": 1}}]', "[TOOL_CALLS]fake[ARGS]{x: 2}"),
    "deepseek": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>fake\n```json\n{"x": 1}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>fake<｜tool▁sep｜>{"x": 2<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    ),
    "gpt_oss": (
        '<|channel|>commentary to=functions.fake <|constrain|>json<|message|>{"x": 1}<|call|>',
        '<|channel|>analysis<|message|>Again.<|end|><|start|>assistant<|channel|>commentary to=functions.fake <|message|>{"x": 2<|call|>',
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(CALLS))
def test_three_turns_whose_calls_reach_the_tool_in_each_family(family):
    """A call, a malformed call (answered with an error the policy sees), then an answer: under
    the family's template and detected format, the first call reaches the tool with its
    arguments, the second is answered ``error: ...``, and the trajectory holds the policy's tokens."""
    tok = build_chat_tokenizer(family)
    good, bad = CALLS[family]
    stop = "</tool_call>" if family == "qwen3" else EOS
    replies = [good + EOS if stop == EOS else good, bad + EOS, "The answer is 3." + EOS]
    sampler = ScriptedSampler(tok, [[r] for r in replies])
    tool = FakeTool()
    prompt = Prompt(id="t", messages=[{"role": "user", "content": "what is 1 plus 2?"}])
    (sample,) = run(make_plugin("multi_turn"), [prompt], 1, sampler, tools={"fake": tool}, max_tokens=200)[0]
    metrics = RECORDED[-1]
    assert tool.calls == [{"x": 1}]
    assert len(sample.turns) == 3 and sample.text == "The answer is 3." and sample.finish_reason == "stop"
    assert metrics["tool/calls"] == 2.0 and metrics["tool/errors"] == 1.0 and metrics["multi_turn/prefix_failures"] == 0.0
    first, second, _ = sample.turns
    result = tok.decode(sample.tokens[first.end : second.start], skip_special_tokens=False)
    error = tok.decode(sample.tokens[second.end : sample.turns[2].start], skip_special_tokens=False)
    assert 'got {"x": 1}' in result or json.dumps('got {"x": 1}') in result  # Mistral's template writes results as JSON
    assert "error: " in error and "got" not in error
    # The policy's tokens are kept as sampled, each turn prompted with the trajectory so far.
    assert [call[0] for call in sampler.calls] == [[sample.tokens[: t.start]] for t in sample.turns]
    # The tools' specs reached the template (a template that lists them: not DeepSeek's, which leaves them to the system prompt).
    opening = tok.decode(sampler.calls[0][0][0], skip_special_tokens=False)
    assert ('"name": "fake"' in opening or "type fake = " in opening) == (family != "deepseek")
    assert sampler.calls[0][2].stop == {"qwen3": ["</tool_call>"], "gpt_oss": ["<|call|>"]}.get(family, [])


def test_a_gpt_oss_call_is_answered_as_harmony_writes_it():
    """The turn stops at the format's stop, <|call|>; the template closes a past call with <|call|> too, which is not
    written twice: the trajectory reads as gpt-oss's own, the call, the tool's message from functions.NAME, the next header."""
    tok = build_chat_tokenizer("gpt_oss")
    call = '<|channel|>commentary to=functions.fake <|constrain|>json<|message|>{"x": 1}<|call|>'
    sampler = ScriptedSampler(tok, [[(ids(tok, call), "stop")], ["<|channel|>final<|message|>3" + EOS]])
    tool = FakeTool()
    (sample,) = run(make_plugin("multi_turn"), [Prompt(id="t", text="x")], 1, sampler, tools={"fake": tool}, max_tokens=200)[0]
    first, second = sample.turns
    assert tool.calls == [{"x": 1}] and sample.text == "final3"
    assert tok.decode(sample.tokens[first.start : second.start], skip_special_tokens=False) == (
        call
        + "<|start|>functions.fake to=assistant<|channel|>commentary<|message|>"
        + json.dumps('got {"x": 1}')
        + "<|end|><|start|>assistant"
    )
    assert RECORDED[-1]["multi_turn/prefix_failures"] == 0.0 and RECORDED[-1]["multi_turn/history_rewrites"] == 0.0


def test_an_explicit_tool_format_overrides_detection():
    tok = build_chat_tokenizer("qwen3")
    call = '{"name": "fake", "parameters": {"x": 1}}'
    for fmt, calls in (("llama3", [{"x": 1}]), ("hermes", [])):
        tool = FakeTool()
        sampler = ScriptedSampler(tok, [[call + EOS], ["done" + EOS]])
        run(make_plugin("multi_turn", tool_format=fmt), [Prompt(id="t", text="x")], 1, sampler, tools={"fake": tool})
        assert tool.calls == calls, fmt


def test_tool_format_without_tools_or_unknown_is_refused():
    tok = build_chat_tokenizer("qwen3")
    with pytest.raises(PluginError, match="tool_format=mistral is given but no tool is selected"):
        run(make_plugin("multi_turn", tool_format="mistral"), [Prompt(id="t", text="x")], 1, ScriptedSampler(tok, [["3" + EOS]]))
    with pytest.raises(PluginError, match="expected one of 'auto', 'hermes', 'llama3', 'mistral', 'deepseek', 'harmony'"):
        make_plugin("multi_turn", tool_format="gemma")


def test_a_tool_result_that_is_not_text_is_sent_as_json():
    tok = build_chat_tokenizer("qwen3")

    class Structured(FakeTool):
        def tool_call(self, arguments):
            return {"sum": 3}

    sampler = ScriptedSampler(tok, [['<tool_call>{"name": "fake", "arguments": {}}</tool_call>'], ["done" + EOS]])
    (sample,) = run(make_plugin("multi_turn"), [Prompt(id="t", text="x")], 1, sampler, tools={"fake": Structured()}, max_tokens=200)[0]
    assert "<tool_response>\n" + json.dumps({"sum": 3}) + "\n</tool_response>" in tok.decode(sample.tokens, skip_special_tokens=False)


RUN_CALLS = {
    "qwen3": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1 + 2"}}',
    "mistral": '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1 + 2"}}]',
    "deepseek": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{"expression": "1 + 2"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "gpt_oss": '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "1 + 2"}<|call|>',
}


class FirstTurnCallsSampler(LocalSamplerPlugin):
    """The local sampler, except that a group's first turn is the family's calculator call
    (a random tiny model would not write one)."""

    @hookimpl
    def make_sampler(self, config, trainer):
        return FirstTurnCalls(super().make_sampler(config=config, trainer=trainer), RUN_CALLS[Path(config.model).name])


class FirstTurnCalls:
    def __init__(self, inner, call):
        self.inner, self.call = inner, call

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, prompts, num_samples, params):
        if num_samples == 1:  # a later round: the model answers the tool's result
            return self.inner.sample(prompts, num_samples, params)
        tokens = self.tokenizer(self.call, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [[Completion(tokens=tokens, logprobs=[-1.0] * len(tokens), finish_reason="stop")] * num_samples for _ in prompts]


@pytest.mark.parametrize("family", list(RUN_CALLS))
def test_a_three_step_run_whose_calls_reach_the_calculator(family, tmp_path, monkeypatch):
    from grpo_core import plugins_manager
    from grpo_core.plugins_manager import PluginEntry, catalog
    from grpo_core.train import run as run_loop
    from tests.core.tiny_runs import config, metrics_of

    builtins = catalog()
    entry = PluginEntry("sampler", "first_turn_calls", f"{__name__}:FirstTurnCallsSampler", "grpo-test", "0.1")
    monkeypatch.setattr(plugins_manager, "catalog", lambda: (*builtins, entry))
    model = build_chat_model(tmp_path / family, family)
    dataset = tmp_path / "q.jsonl"
    dataset.write_text("".join(json.dumps({"question": f"what is {n} plus 2?"}) + "\n" for n in range(6)))
    summary = run_loop(
        config(model, dataset, tmp_path / "r", rollout="multi_turn", tool=["calculator"], sampler="first_turn_calls", reward=["format"],
               weight_sync="in_process", max_steps=3, max_completion_tokens=8, prompt_template="{prompt}")
    )  # fmt: skip
    assert summary["steps"] == 3
    for m in metrics_of(tmp_path / "r"):
        # 2 groups of 4 conversations, each opening with a call that reaches the calculator (the
        # random model's later turns may hold calls of their own).
        assert m["tool/calls"] - m["tool/errors"] >= 8 and m["multi_turn/turns_mean"] >= 2.0
        assert m["multi_turn/prefix_failures"] == 0.0
