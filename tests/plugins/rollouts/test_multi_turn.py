from __future__ import annotations

import json
import re
import threading

import attrs
import pytest

from grpo_core import PluginError, Prompt, make_plugin
from grpo_core.embedded import ASSETS
from grpo_core.metrics import scope
from grpo_core.plugins.rollouts.multi_turn import PLAIN_TEMPLATE, PrefixMismatch, render
from grpo_core.types import EnvStep, Turn
from tests.helpers import grpo_core_in_process, small_run_args
from tests.plugins.rollouts.scripted_rollouts import (
    EOS,
    RECORDED,
    Endless,
    FakeTool,
    ScriptedSampler,
    ids,
    policy_logprobs,
    retry_math,
    run,
)

QWEN_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
"""Qwen2.5's chat template, cut to what these tests use: a default system prompt, a tools
section, tool results merged into one user turn."""

# Like Qwen3's: an assistant turn's reasoning is dropped from the history.
DROPS_REASONING = QWEN_TEMPLATE.replace(
    "'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>'",
    "'<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1].lstrip() + '<|im_end|>'",
)


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """A byte-level BPE trained here, with Qwen's special tokens and (a cut of) its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"what is {a} plus {b}? The answer is {a + b}. calculator expression tool_call" for a in range(30) for b in range(30)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


QUESTION = "Question: Mia has 18 marbles. She buys 34 more. How many marbles does Mia have now?\nAnswer:"


def test_embedded_tokenizer_retry_math_conversation_flattens_token_in_token_out(embedded_tokenizer):
    """The embedded tokenizer has no chat template, so the plain one renders: a wrong answer, the
    feedback with the question again, a right answer. Hand-built from the pieces."""
    tok = embedded_tokenizer
    assert tok.chat_template is None
    prompt = Prompt(id="p", text=QUESTION, answer="18 + 34 = 52\n#### 52")
    sampler = ScriptedSampler(tok, [[" 18 + 34 = 50\n#### 50" + EOS], [" 18 + 34 = 52\n#### 52" + EOS]])
    rollout = make_plugin("multi_turn")
    (sample,) = run(rollout, [prompt], 1, sampler, env=retry_math())[0]

    opening = ids(tok, QUESTION)
    turn1 = ids(tok, " 18 + 34 = 50\n#### 50") + [tok.eos_token_id]
    observation = ids(tok, "\nIncorrect, try again.\n" + QUESTION)
    turn2 = ids(tok, " 18 + 34 = 52\n#### 52") + [tok.eos_token_id]
    assert sample.tokens == opening + turn1 + observation + turn2
    assert sample.loss_mask == [0.0] * len(opening) + [1.0] * len(turn1) + [0.0] * len(observation) + [1.0] * len(turn2)
    assert sample.sampling_logprobs == (
        [0.0] * len(opening) + policy_logprobs(len(turn1)) + [0.0] * len(observation) + policy_logprobs(len(turn2))
    )
    a = len(opening)
    b = a + len(turn1)
    c = b + len(observation)
    assert sample.turns == [Turn(start=a, end=b, context_end=c), Turn(start=c, end=len(sample.tokens), context_end=len(sample.tokens))]
    # The second prompt the sampler saw is exactly the tokens up to turn 1's context_end.
    assert sampler.calls[1][0] == [sample.tokens[:c]]
    # A right answer at the second try: discount**1.
    assert sample.env_reward == 0.5 and sample.text == " 18 + 34 = 52\n#### 52" and sample.finish_reason == "stop"
    # The tokens are the plain template's text of the whole conversation.
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": " 18 + 34 = 50\n#### 50"},
        {"role": "user", "content": "Incorrect, try again.\n" + QUESTION},
        {"role": "assistant", "content": " 18 + 34 = 52\n#### 52"},
    ]
    full = tok.apply_chat_template(messages, chat_template=PLAIN_TEMPLATE, tokenize=False)
    assert tok.decode(sample.tokens, skip_special_tokens=False) == full
    assert RECORDED[-1] == {
        "multi_turn/turns_mean": 2.0, "multi_turn/max_turns_frac": 0.0,
        "tool/calls": 0.0, "tool/errors": 0.0, "tool/timeouts": 0.0, "multi_turn/prefix_failures": 0.0,
        "multi_turn/history_rewrites": 0.0,
    }  # fmt: skip


def test_qwen_template_with_system_prompt_and_a_tool_call(qwen_tokenizer):
    tok = qwen_tokenizer
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "what is 18 plus 34?"}]
    prompt = Prompt(id="q", messages=messages, answer="52")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 + 34"}}\n</tool_call>'
    sampler = ScriptedSampler(tok, [[call], ["The answer is 52." + EOS]])
    rollout = make_plugin("multi_turn")
    calculator = make_plugin("calculator")
    (sample,) = run(rollout, [prompt], 1, sampler, env=retry_math(), tools={"calculator": calculator}, max_tokens=200)[0]

    specs = [{"type": "function", "function": calculator.tool_spec()}]
    opening_text = render(tok, QWEN_TEMPLATE, messages, specs)
    assert opening_text.startswith("<|im_start|>system\nYou add numbers.\n\n# Tools") and '"name": "calculator"' in opening_text
    opening = ids(tok, opening_text)
    turn1 = ids(tok, call)  # stopped on the stop string: no end-of-turn token of its own
    added = ids(tok, "<|im_end|>\n<|im_start|>user\n<tool_response>\n52\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    turn2 = ids(tok, "The answer is 52.") + [tok.eos_token_id]
    assert sample.tokens == opening + turn1 + added + turn2
    assert sample.loss_mask == [0.0] * len(opening) + [1.0] * len(turn1) + [0.0] * len(added) + [1.0] * len(turn2)
    # Two policy turns as mask transitions 0 -> 1 -> 0 -> 1.
    transitions = [i for i in range(1, len(sample.loss_mask)) if sample.loss_mask[i] != sample.loss_mask[i - 1]]
    assert transitions == [len(opening), len(opening) + len(turn1), len(opening) + len(turn1) + len(added)]
    assert [(t.start, t.end) for t in sample.turns] == [(transitions[0], transitions[1]), (transitions[2], len(sample.tokens))]
    # The template's text of the whole conversation, up to the policy's own end of turn.
    full = render(
        tok, QWEN_TEMPLATE,
        [*messages, {"role": "assistant", "content": call}, {"role": "tool", "name": "calculator", "content": "52"},
         {"role": "assistant", "content": "The answer is 52."}], specs,
    )  # fmt: skip
    assert full.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(sample.tokens, skip_special_tokens=False) == full.removesuffix("\n<|im_start|>assistant\n")
    # The tool turn is not an answer: retry_math saw one try, right.
    assert sample.env_reward == 1.0
    assert sampler.calls[0][2].stop == ["</tool_call>"]
    metrics = RECORDED[-1]
    assert metrics["tool/calls"] == 1.0 and metrics["tool/errors"] == 0.0 and metrics["multi_turn/turns_mean"] == 2.0


def test_a_template_that_rewrites_history_is_an_error_naming_the_position(qwen_tokenizer):
    tok = qwen_tokenizer
    prompt = Prompt(id="r", messages=[{"role": "user", "content": "what is 1 plus 2?"}], answer="3")
    script = [["<think>what is 1 plus 2</think> The answer is 4." + EOS], ["The answer is 3." + EOS]]
    env = retry_math()
    opening = render(tok, DROPS_REASONING, prompt.messages, [])

    def rollout_with(option: str):
        sampler = ScriptedSampler(tok, script)
        original = tok.chat_template
        tok.chat_template = DROPS_REASONING
        try:
            rollout = make_plugin("multi_turn", on_prefix_mismatch=option)
            return rollout, sampler, run(rollout, [prompt], 1, sampler, env=env)
        finally:
            tok.chat_template = original

    with pytest.raises(PrefixMismatch) as err:
        rollout_with("error")
    message = str(err.value)
    # The rewrite starts at the policy's "<think>", right after the opening.
    assert f"At character {len(opening)} of its text, in the policy's turn 1 (from token {len(ids(tok, opening))})" in message
    assert (
        "the conversation reads '<think>what is 1 plus 2</think> The answ' "
        "but the template now renders 'The answer is 4.<|im_end|>\\n<|im_start|>u'" in message
    )
    assert message.startswith("prompt r, after turn 1: the chat template does not extend the conversation")

    rollout, sampler, groups = rollout_with("end")
    (sample,) = groups[0]
    assert len(sampler.calls) == 1
    assert sample.finish_reason == "prefix_mismatch" and sample.env_reward == 0.0
    n = len(ids(tok, opening))
    assert len(sample.tokens) == n + len(ids(tok, "<think>what is 1 plus 2</think> The answer is 4.")) + 1
    assert sample.turns == [Turn(start=n, end=len(sample.tokens), context_end=len(sample.tokens))]
    assert RECORDED[-1]["multi_turn/prefix_failures"] == 1.0


def test_one_sampler_call_per_round_for_every_live_conversation(embedded_tokenizer):
    tok = embedded_tokenizer
    prompts = [
        Prompt(id="a", text="Question: Tom has 2 apples. He buys 3 more. How many apples does Tom have now?\nAnswer:", answer="#### 5"),
        Prompt(id="b", text="Question: Sam has 9 pens. He gives 4 away. How many pens does Sam have left?\nAnswer:", answer="#### 5"),
    ]
    right, wrong = " 5" + EOS, " 6" + EOS
    # Round 1: a: right, wrong; b: wrong, wrong. Round 2: a2 wrong, b1 right, b2 wrong. Round 3: a2 right, b2 wrong.
    script = [[right, wrong, wrong, wrong], [wrong, right, wrong], [right, wrong]]
    sampler = ScriptedSampler(tok, script)
    groups = run(make_plugin("multi_turn"), prompts, 2, sampler, env=retry_math())
    # Round 1 prefills each prompt once for its group; later rounds send each live conversation.
    assert [(len(p), n) for p, n, _ in sampler.calls] == [(2, 2), (3, 1), (2, 1)]
    assert sampler.calls[0][0] == [ids(tok, prompts[0].text), ids(tok, prompts[1].text)]
    assert [[len(s.turns) for s in g] for g in groups] == [[1, 3], [2, 3]]
    assert [[s.env_reward for s in g] for g in groups] == [[1.0, 0.25], [0.5, 0.0]]
    assert [[s.prompt.id for s in g] for g in groups] == [["a", "a"], ["b", "b"]]
    for sample, calls in ((groups[0][1], [0, 1, 2]), (groups[1][1], [0, 1, 2])):
        # Each turn's prompt extends the tokens so far: it is the sample's own prefix.
        for turn, call in zip(sample.turns, calls):
            assert sample.tokens[: turn.start] in sampler.calls[call][0]


def test_openings_that_differ_within_a_group_are_sampled_one_by_one(embedded_tokenizer):
    tok = embedded_tokenizer
    openings = iter(["Question: 1 plus 1?\nAnswer:", "Question: 2 plus 2?\nAnswer:"])

    @attrs.define
    class Once:
        messages: list

        def step(self, text, tokens):
            return EnvStep(messages=[], reward=1.0, done=True)

    sampler = ScriptedSampler(tok, [[" 2" + EOS, " 4" + EOS]])
    (group,) = run(
        make_plugin("multi_turn"), [Prompt(id="x", text="x")], 2, sampler, env=lambda p: Once([{"role": "user", "content": next(openings)}])
    )
    assert [(len(p), n) for p, n, _ in sampler.calls] == [(2, 1)]
    assert [s.tokens[: s.turns[0].start] for s in group] == [
        ids(tok, "Question: 1 plus 1?\nAnswer:"),
        ids(tok, "Question: 2 plus 2?\nAnswer:"),
    ]
    assert [s.env_reward for s in group] == [1.0, 1.0]


def test_max_turns_ends_a_conversation(embedded_tokenizer):
    sampler = ScriptedSampler(embedded_tokenizer, [[" 1" + EOS]] * 3)
    episode = Endless()
    rollout = make_plugin("multi_turn", max_turns=3)
    (sample,) = run(rollout, [Prompt(id="c", text="c")], 1, sampler, env=lambda p: episode)[0]
    assert len(sampler.calls) == 3 and len(sample.turns) == 3 and episode.steps == 3
    assert sample.finish_reason == "max_turns" and sample.env_reward == 0.75
    assert sample.turns[-1].context_end == len(sample.tokens) == sample.turns[-1].end
    assert RECORDED[-1]["multi_turn/max_turns_frac"] == 1.0 and RECORDED[-1]["multi_turn/turns_mean"] == 3.0


def test_max_total_tokens_cuts_the_turn_that_reaches_it(embedded_tokenizer):
    tok = embedded_tokenizer
    opening = ids(tok, "Question: count\nAnswer:")
    first = ids(tok, " 1") + [tok.eos_token_id]
    observation = ids(tok, "\nmore\nAnswer:")
    limit = len(opening) + len(first) + len(observation) + 2
    sampler = ScriptedSampler(tok, [[" 1" + EOS], [" 1 2 3 4 5" + EOS]])
    (sample,) = run(
        make_plugin("multi_turn", max_total_tokens=limit, max_turns=10), [Prompt(id="c", text="c")], 1, sampler, env=lambda p: Endless()
    )[0]
    # The second round may sample only what is left.
    assert [params.max_tokens for _, _, params in sampler.calls] == [limit - len(opening), 2]
    assert len(sample.tokens) == limit and sample.finish_reason == "length"
    assert sample.loss_mask[-2:] == [1.0, 1.0] and len(sample.turns) == 2
    assert sample.turns[1].end == limit == sample.turns[1].context_end


@attrs.define
class ScoredAtEnd(Endless):
    """Endless, but its score comes at the end only (as a verifiers task's rubric)."""

    scored_at_end: bool = True


@pytest.mark.parametrize(("env", "score"), [(Endless, 0.5), (ScoredAtEnd, None)])
def test_a_conversation_cut_before_an_end_scored_episode_ends_is_unscored_not_zero(embedded_tokenizer, env, score):
    tok = embedded_tokenizer
    opening = ids(tok, "Question: count\nAnswer:")
    limit = len(opening) + len(ids(tok, " 1")) + 1 + len(ids(tok, "\nmore\nAnswer:")) + 2
    sampler = ScriptedSampler(tok, [[" 1" + EOS], [" 1 2 3 4 5" + EOS]])
    (sample,) = run(
        make_plugin("multi_turn", max_total_tokens=limit, max_turns=10), [Prompt(id="c", text="c")], 1, sampler, env=lambda p: env()
    )[0]
    assert sample.finish_reason == "length" and sample.env_reward == score
    # reward 'env' passes None on: the sample is counted as failed, not scored 0.
    assert make_plugin("env", "reward").reward(prompt=sample.prompt, samples=[sample]) == [score]


def test_an_observation_that_leaves_no_room_ends_the_conversation_after_the_turn(embedded_tokenizer):
    tok = embedded_tokenizer
    opening = ids(tok, "Question: count\nAnswer:")
    first = ids(tok, " 1") + [tok.eos_token_id]
    observation = ids(tok, "\nmore\nAnswer:")
    limit = len(opening) + len(first) + len(observation)  # the observation fits, an answer would not
    sampler = ScriptedSampler(tok, [[" 1" + EOS]])
    (sample,) = run(make_plugin("multi_turn", max_total_tokens=limit), [Prompt(id="c", text="c")], 1, sampler, env=lambda p: Endless())[0]
    assert sample.tokens == opening + first and sample.finish_reason == "length"
    assert sample.turns == [Turn(len(opening), len(opening) + len(first), len(opening) + len(first))]


def test_the_model_context_is_the_default_limit_and_an_opening_must_leave_room(embedded_tokenizer):
    tok = embedded_tokenizer
    n = len(ids(tok, "Question: count\nAnswer:"))
    sampler = ScriptedSampler(tok, [[" 1 2 3" + EOS]], max_context=n + 2)
    (sample,) = run(make_plugin("multi_turn"), [Prompt(id="c", text="c")], 1, sampler, env=lambda p: Endless())[0]
    assert len(sample.tokens) == n + 2 and sample.finish_reason == "length"
    with pytest.raises(PluginError, match=rf"prompt c: its conversation opens with {n} tokens, which leaves no room within {n}"):
        run(make_plugin("multi_turn", max_total_tokens=n), [Prompt(id="c", text="c")], 1, sampler, env=lambda p: Endless())


def tool_conversation(tok, replies, tools, **options):
    """A conversation without an environment: tool turns, then a last turn without a call."""
    sampler = ScriptedSampler(tok, [[r] for r in replies])
    rollout = make_plugin("multi_turn", **options)
    (sample,) = run(
        rollout, [Prompt(id="t", messages=[{"role": "user", "content": "what is 1 plus 2?"}])], 1, sampler, tools=tools, max_tokens=200
    )[0]
    text = tok.decode(sample.tokens, skip_special_tokens=False)
    return sample, text, RECORDED[-1]


def test_tool_results_and_errors_come_back_as_tool_messages(qwen_tokenizer):
    tok = qwen_tokenizer
    calls = [
        '<tool_call>{"name": "fake", "arguments": {"x": 1}}</tool_call>',
        '<tool_call>{"name": "fake", "arguments": "{\\"x\\": 2}"}</tool_call><tool_call>{"name": "nope"}</tool_call>',
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "fake", "arguments": {"fail": true}}</tool_call>',
        '<tool_call>{"name": "fake", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "fake", "arguments": {"x": 3}}',  # cut before its end
        "The answer is 3." + EOS,
    ]
    tool = FakeTool()
    sample, text, metrics = tool_conversation(tok, calls, {"fake": tool}, max_turns=10)
    responses = [part.split("\n</tool_response>")[0] for part in text.split("<tool_response>\n")[1:]]
    assert responses == [
        'got {"x": 1}',
        'got {"x": 2}',
        "error: unknown tool 'nope'; tools: fake",
        "error: Expecting value: line 1 column 1 (char 0)",
        "error: asked to fail",
        "error: the arguments of fake must be a JSON object",
        "error: the tool call is not closed with </tool_call>",
    ]
    assert tool.calls == [{"x": 1}, {"x": 2}, {"fail": True}]
    assert len(sample.turns) == 7 and sample.env_reward is None and sample.text == "The answer is 3."
    assert metrics["tool/calls"] == 7.0 and metrics["tool/errors"] == 5.0 and metrics["tool/timeouts"] == 0.0


def test_a_slow_tool_times_out_unless_the_timeout_is_off(qwen_tokenizer):
    call = '<tool_call>{"name": "fake", "arguments": {}}</tool_call>'
    _, text, metrics = tool_conversation(qwen_tokenizer, [call, "done" + EOS], {"fake": FakeTool(delay=0.5)}, tool_timeout=0.1)
    assert "<tool_response>\nerror: fake did not return within 0.1 s\n</tool_response>" in text
    assert metrics["tool/timeouts"] == 1.0 and metrics["tool/errors"] == 1.0
    _, text, metrics = tool_conversation(qwen_tokenizer, [call, "done" + EOS], {"fake": FakeTool(delay=0.3)}, tool_timeout=0)
    assert "<tool_response>\ngot {}\n</tool_response>" in text and metrics["tool/timeouts"] == 0.0


def test_tool_calls_are_text_without_tools_and_end_a_conversation_without_an_environment(qwen_tokenizer):
    call = '<tool_call>{"name": "fake", "arguments": {}}</tool_call>'
    sampler = ScriptedSampler(qwen_tokenizer, [[call + EOS]])
    rollout = make_plugin("multi_turn")
    (sample,) = run(rollout, [Prompt(id="t", text="what is 1 plus 2?")], 1, sampler, max_tokens=200)[0]
    assert len(sampler.calls) == 1 and sampler.calls[0][2].stop == []
    assert sample.text == call and len(sample.turns) == 1 and sample.finish_reason == "stop" and sample.env_reward is None
    assert RECORDED[-1]["tool/calls"] == 0.0


def test_a_special_token_inside_a_turn_is_kept_and_the_template_closes_a_turn_it_did_not_end(qwen_tokenizer):
    tok = qwen_tokenizer
    start, endoftext = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    answer = ids(tok, "The answer is 4.")
    # Turn 1: a stray special token inside, ended by <|endoftext|> (a stop token, not the template's end of turn).
    turn1 = answer[:2] + [start] + answer[2:] + [endoftext]
    sampler = ScriptedSampler(tok, [[(turn1, "stop")], ["The answer is 3." + EOS]])
    prompt = Prompt(id="s", messages=[{"role": "user", "content": "what is 1 plus 2?"}], answer="3")
    (sample,) = run(make_plugin("multi_turn"), [prompt], 1, sampler, env=retry_math())[0]
    opening = ids(tok, render(tok, QWEN_TEMPLATE, prompt.messages, []))
    added = ids(tok, "<|im_end|>\n<|im_start|>user\nIncorrect, try again.\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    assert sample.tokens == opening + turn1 + added + ids(tok, "The answer is 3.") + [tok.eos_token_id]
    assert sample.env_reward == 0.5


def test_the_template_option(qwen_tokenizer, embedded_tokenizer):
    prompt = Prompt(id="t", text="what is 1 plus 2?")
    for template, tokenizer, expected in (
        (
            "auto",
            qwen_tokenizer,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "tokenizer",
            qwen_tokenizer,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n",
        ),
        ("plain", qwen_tokenizer, "what is 1 plus 2?"),
        ("auto", embedded_tokenizer, "what is 1 plus 2?"),
    ):
        sampler = ScriptedSampler(tokenizer, [["3" + EOS]])
        run(make_plugin("multi_turn", template=template), [prompt], 1, sampler)
        assert tokenizer.decode(sampler.calls[0][0][0], skip_special_tokens=False) == expected, template
    with pytest.raises(PluginError, match="the tokenizer has no chat template: pass --rollout-opt template=plain"):
        run(make_plugin("multi_turn", template="tokenizer"), [prompt], 1, ScriptedSampler(embedded_tokenizer, [["3" + EOS]]))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_turns": 0}, "max_turns must be positive"),
        ({"max_total_tokens": 0}, "max_total_tokens must be positive"),
        ({"tool_timeout": -1}, "tool_timeout must be >= 0"),
        ({"template": "jinja"}, "expected one of 'auto', 'tokenizer', 'plain'"),
        ({"on_prefix_mismatch": "skip"}, "expected one of 'error', 'end'"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("multi_turn", **options)


def test_an_env_reset_that_returns_no_episode_or_no_messages_is_an_error(embedded_tokenizer):
    rollout, sampler = make_plugin("multi_turn"), ScriptedSampler(embedded_tokenizer, [])
    with pytest.raises(PluginError, match=r"the environment's env_reset returned None for prompt e, not an episode"):
        run(rollout, [Prompt(id="e", text="x")], 1, sampler, env=lambda p: None)
    with pytest.raises(PluginError, match=r"prompt e: the conversation opens with no messages"):
        run(rollout, [Prompt(id="e", text="x")], 1, sampler, env=lambda p: Endless(messages=[]))


def test_policy_version_is_the_oldest_a_conversation_was_sampled_from(embedded_tokenizer):
    @attrs.define
    class Ageing(ScriptedSampler):
        def sample(self, prompts, num_samples, params):
            groups = super().sample(prompts, num_samples, params)
            self.version += 1
            return groups

    sampler = Ageing(embedded_tokenizer, [[" 6" + EOS], [" 5" + EOS]], version=3)
    (sample,) = run(make_plugin("multi_turn"), [Prompt(id="v", text=QUESTION, answer="5")], 1, sampler, env=retry_math())[0]
    assert len(sampler.calls) == 2 and sampler.version == 5 and sample.policy_version == 3


def test_metrics_are_recorded_in_the_calling_threads_scope(embedded_tokenizer):
    rollout = make_plugin("multi_turn")
    with scope() as main:
        worker = threading.Thread(
            target=run,
            args=(rollout, [Prompt(id="m", text=QUESTION, answer="52")], 1, ScriptedSampler(embedded_tokenizer, [[" 52" + EOS]])),
            kwargs={"env": retry_math()},
        )
        worker.start()
        worker.join()
    assert dict(main) == {} and RECORDED[-1]["multi_turn/turns_mean"] == 1.0


def test_sampler_logprobs_line_up_with_the_trainer_on_a_real_model(tiny_model_dir):
    """The local sampler on a tiny model, three turns: the trainer's logprobs of the policy's
    tokens, scored on the flattened trajectory, equal the sampler's."""
    import torch

    from grpo_core.backend import sample_to_datum
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    config = RunConfig(model=str(tiny_model_dir))
    trainer = LocalBackend().make_trainer(config=config)
    sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=trainer)
    prompt = Prompt(id="l", text="Question: what is 1 plus 2?\nAnswer:", answer="#### 3")
    groups = run(make_plugin("multi_turn", max_turns=3), [prompt], 3, sampler, env=lambda p: Endless(), max_tokens=5)
    for sample in groups[0]:
        assert len(sample.turns) == 3
        (logprobs,) = trainer.forward([sample_to_datum(sample)])
        mask = torch.tensor(sample.loss_mask[1:]) > 0
        assert int(mask.sum()) == sum(t.end - t.start for t in sample.turns)
        assert torch.allclose(logprobs[mask], torch.tensor(sample.sampling_logprobs[1:])[mask], atol=1e-4)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_small_run_through_the_cli_reports_the_conversations(tiny_model_dir, tiny_dataset, tmp_path, loop):
    run_dir = tmp_path / "run"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--rollout", "multi_turn", "--env", "retry_math", "--loop", loop)
    out = grpo_core_in_process(*args, "--env-opt", "max_turns=2", "--max-completion-tokens", "4", "--no-drop-zero-variance-groups")
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["reward"] == {"env": 1.0} and config["plugin_options"] == {"env": {"retry_math": {"max_turns": 2}}}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        # An untrained model is rarely right: most conversations take both tries.
        assert 1.0 <= m["multi_turn/turns_mean"] <= 2.0 and m["multi_turn/max_turns_frac"] == 0.0
        assert m["tool/calls"] == 0.0 and m["multi_turn/prefix_failures"] == 0.0
        assert 0.0 <= m["reward/env"] <= 1.0 and m["train/samples"] == 8.0


@pytest.mark.slow
def test_retry_math_trains_through_the_cli_with_the_reward_rising(tmp_path):
    """The embedded model and task, retried on a wrong answer: 40 steps of the embedded preset."""
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        "run", "--rollout", "multi_turn", "--env", "retry_math", "--max-steps", "40", "--seed", "0",
        "--run-dir", str(run_dir), "--checkpoint-every", "0", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["reward"] == {"env": 1.0} and config["env"] == "retry_math" and config["rollout"] == "multi_turn"
    match = re.search(r"reward: first 10 steps ([\d.]+) -> last 10 steps ([\d.]+)", out.stdout)
    assert match, out.stdout[-2000:]
    first, last = map(float, match.groups())
    print(f"retry_math via the CLI: reward first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert 0.1 < first < 0.45 and last - first >= 0.1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    turns = [m["multi_turn/turns_mean"] for m in metrics]
    # Right answers come sooner: fewer turns per conversation.
    assert sum(turns[-10:]) / 10 < sum(turns[:10]) / 10
    assert all(1.0 <= t <= 3.0 for t in turns) and all(m["multi_turn/prefix_failures"] == 0 for m in metrics)


@pytest.mark.parametrize("per_trajectory", [False, True])
def test_per_trajectory_makes_the_async_loop_roll_out_each_conversation_on_its_own(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, per_trajectory
):
    from grpo_core.async_loop import SharedSampler
    from grpo_core.train import run
    from tests.core.tiny_runs import config

    calls = []
    original = SharedSampler.sample

    def spy(self, prompts, num_samples, params):  # what the rollout asks for (the shared sampler may batch it with others)
        calls.append((len(prompts), num_samples))
        return original(self, prompts, num_samples, params)

    monkeypatch.setattr(SharedSampler, "sample", spy)
    options = {"rollout": {"multi_turn": {"per_trajectory": per_trajectory}}, "env": {"retry_math": {"max_turns": 2}}}
    summary = run(
        config(
            tiny_model_dir, tiny_dataset, tmp_path / "r", loop="async", rollout="multi_turn", env="retry_math", reward=["env"],
            max_steps=2, max_completion_tokens=4, plugin_options=options,
        )
    )  # fmt: skip
    assert summary["steps"] == 2
    if per_trajectory:
        assert set(calls) == {(1, 1)}  # one conversation per call, every round
    else:
        assert (1, 4) in calls  # a group's opening round is one call for its 4 conversations


@pytest.mark.parametrize(
    "options",
    [{"max_turns": 3}, {"max_turns": 3, "per_turn_samples": True}, {"max_turns": 3, "max_total_tokens": 33}],
    ids=["flattened", "per_turn_samples", "ended_by_max_total_tokens"],
)
def test_a_moe_samplers_routes_are_carried_through_the_turns(tmp_path, options):
    """A mixture-of-experts model: each flattened sample carries the routing of its tokens[:-1],
    each token's from the sampler call that first forwarded it; in float32 exactly the routing the
    trainer's forward of the whole trajectory chooses (what --router-replay R3 replays)."""
    import torch

    from grpo_core.backend import sample_to_datum
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin
    from tests.plugins.backends.moe_models import build_tiny_moe

    build_tiny_moe("qwen3_moe", tmp_path)
    config = RunConfig(model=str(tmp_path), dtype="float32")
    trainer = LocalBackend().make_trainer(config=config)
    sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=trainer)
    prompt = Prompt(id="l", text="Question: what is 1 plus 2?\nAnswer:", answer="#### 3")
    groups = run(make_plugin("multi_turn", **options), [prompt], 3, sampler, env=lambda p: Endless(), max_tokens=5)
    samples = groups[0]
    assert len(samples) == (9 if options.get("per_turn_samples") else 3)
    if "max_total_tokens" in options:
        assert all(s.finish_reason == "length" and len(s.tokens) <= 33 for s in samples)
    _, routes = trainer.forward_routed([sample_to_datum(s) for s in samples])
    for sample, trainer_routes in zip(samples, routes):
        assert sample.routed_experts.shape == (len(sample.tokens) - 1, 2, 2)
        assert torch.equal(sample.routed_experts.long(), trainer_routes.long())
