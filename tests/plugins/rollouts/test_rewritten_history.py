"""Multi-turn conversations under templates that rewrite the policy's past turns (Qwen3 drops
reasoning, Llama 3 and Mistral trim): the trajectory still holds exactly the sampled tokens, and
only what the template writes after each new turn is appended."""

from __future__ import annotations

import json

import pytest

from grpo_core import PluginError, Prompt, make_plugin
from grpo_core.plugins.rollouts.multi_turn import PrefixMismatch
from grpo_core.types import Turn
from tests.plugins.rollouts.chat_templates import QWEN3, build_chat_model, build_chat_tokenizer
from tests.plugins.rollouts.scripted_rollouts import EOS, RECORDED, Endless, ScriptedSampler, ids, policy_logprobs, retry_math, run

QUESTION = [{"role": "user", "content": "what is 1 plus 2?"}]


class Chat:
    """A scripted conversation on one family's tokenizer: the opening, then each reply."""

    def __init__(self, family: str):
        self.tok = build_chat_tokenizer(family)

    def roll(self, replies, env=None, messages=QUESTION, **options):
        sampler = ScriptedSampler(self.tok, [[r] for r in replies])
        (sample,) = run(make_plugin("multi_turn", **options), [Prompt(id="h", messages=messages, answer="3")], 1, sampler, env=env)[0]
        return sample, sampler, RECORDED[-1]

    def ids(self, text: str) -> list[int]:
        return ids(self.tok, text)

    def turn(self, text: str) -> list[int]:
        return self.ids(text) + [self.tok.eos_token_id]


def assert_trajectory(sample, sampler, pieces: list[tuple[list[int], bool]]):
    """The sample is the pieces in order (policy turns marked True), each prompt the sampler saw
    is the trajectory up to that turn, and each turn carries the sampler's logprobs."""
    tokens, mask, logprobs = [], [], []
    for piece, policy in pieces:
        tokens += piece
        mask += [float(policy)] * len(piece)
        logprobs += policy_logprobs(len(piece)) if policy else [0.0] * len(piece)
    assert sample.tokens == tokens
    assert sample.loss_mask == mask and sample.sampling_logprobs == logprobs
    assert [call[0] for call in sampler.calls] == [[tokens[: turn.start]] for turn in sample.turns]


def test_qwen3_reasoning_dropped_from_history_is_kept_in_the_trajectory():
    chat = Chat("qwen3")
    first, second = "<think>\nadd 1 and 2\n</think>\n\nThe answer is 4.", "<think>\nadd 1 and 2 again\n</think>\n\nThe answer is 3."
    sample, sampler, metrics = chat.roll([first + EOS, second + EOS], env=retry_math())
    opening = chat.ids("<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    # The policy's <|im_end|> is the template's: only what follows it is appended.
    added = chat.ids("\n<|im_start|>user\nIncorrect, try again.\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    assert_trajectory(sample, sampler, [(opening, False), (chat.turn(first), True), (added, False), (chat.turn(second), True)])
    assert sample.env_reward == 0.5 and sample.text == second
    assert metrics["multi_turn/history_rewrites"] == 1.0 and metrics["multi_turn/prefix_failures"] == 0.0
    # The template itself drops the first turn's reasoning: the trajectory is not its rendering.
    rendered = chat.tok.apply_chat_template(
        [*QUESTION, {"role": "assistant", "content": first}, {"role": "user", "content": "x"}], tokenize=False
    )
    assert "add 1 and 2" not in rendered


def test_qwen3_thinking_2507_opens_every_turn_with_think_and_trains_three_turns():
    chat = Chat("qwen3_thinking")
    replies = ["reason\n</think>\n\nThe answer is 1.", "more\n</think>\n\nThe answer is 2.", "done\n</think>\n\nThe answer is 3."]
    sample, sampler, metrics = chat.roll([r + EOS for r in replies], env=lambda p: Endless(messages=list(QUESTION)), max_turns=3)
    header = "<|im_start|>assistant\n<think>\n"
    opening = chat.ids("<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n" + header)
    added = chat.ids("\n<|im_start|>user\nmore\nAnswer:<|im_end|>\n" + header)
    assert_trajectory(
        sample, sampler,
        [(opening, False), (chat.turn(replies[0]), True), (added, False), (chat.turn(replies[1]), True), (added, False),
         (chat.turn(replies[2]), True)],
    )  # fmt: skip
    assert len(sample.turns) == 3 and sample.finish_reason == "max_turns"
    assert metrics["multi_turn/history_rewrites"] == 2.0 and metrics["multi_turn/prefix_failures"] == 0.0


def test_qwen3_non_thinking_empty_think_block_is_a_generation_prompt_history_drops():
    chat = Chat("qwen3")
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    sample, sampler, metrics = chat.roll(["The answer is 4." + EOS, "The answer is 3." + EOS], env=retry_math(), enable_thinking=False)
    opening = chat.ids("<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n" + empty_think)
    added = chat.ids("\n<|im_start|>user\nIncorrect, try again.\nwhat is 1 plus 2?<|im_end|>\n" + empty_think)
    assert_trajectory(
        sample, sampler, [(opening, False), (chat.turn("The answer is 4."), True), (added, False), (chat.turn("The answer is 3."), True)]
    )
    assert metrics["multi_turn/history_rewrites"] == 1.0
    # Without the option the template thinks: no empty block, and its history extends the prefix.
    sample, sampler, metrics = chat.roll(["The answer is 4." + EOS, "The answer is 3." + EOS], env=retry_math())
    assert chat.tok.decode(sampler.calls[0][0][0], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert metrics["multi_turn/history_rewrites"] == 0.0


def test_qwen3_tool_turns_after_the_last_query_keep_their_reasoning_rewritten():
    """In a tool loop Qwen3 rewrites the current turn's reasoning (``<think>\\n...\\n</think>\\n\\n``):
    a turn written with other whitespace is followed by appending."""
    chat = Chat("qwen3")
    call = '<think>add</think><tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
    sampler = ScriptedSampler(chat.tok, [[call], ["The answer is 3." + EOS]])
    calculator = make_plugin("calculator")
    (sample,) = run(
        make_plugin("multi_turn"), [Prompt(id="t", messages=QUESTION)], 1, sampler, tools={"calculator": calculator}, max_tokens=200
    )[0]
    specs = [{"type": "function", "function": calculator.tool_spec()}]
    opening = chat.tok.apply_chat_template(QUESTION, tools=specs, add_generation_prompt=True, tokenize=False)
    added = "<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert_trajectory(
        sample,
        sampler,
        [(chat.ids(opening), False), (chat.ids(call), True), (chat.ids(added), False), (chat.turn("The answer is 3."), True)],
    )
    assert RECORDED[-1]["multi_turn/history_rewrites"] == 1.0 and RECORDED[-1]["tool/errors"] == 0.0


def test_llama3_trims_the_policys_whitespace():
    chat = Chat("llama3")
    first = "  The answer is 4. "
    sample, sampler, metrics = chat.roll([first + EOS, "The answer is 3." + EOS], env=retry_math())
    system = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
    )
    opening = chat.ids(
        system + "<|start_header_id|>user<|end_header_id|>\n\nwhat is 1 plus 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    added = chat.ids(
        "<|start_header_id|>user<|end_header_id|>\n\nIncorrect, try again.\nwhat is 1 plus 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert_trajectory(sample, sampler, [(opening, False), (chat.turn(first), True), (added, False), (chat.turn("The answer is 3."), True)])
    assert metrics["multi_turn/history_rewrites"] == 1.0 and sample.env_reward == 0.5


def test_mistral_writes_a_space_before_a_past_answer_and_has_no_generation_prompt():
    chat = Chat("mistral")
    sample, sampler, metrics = chat.roll(["The answer is 4." + EOS, "The answer is 3." + EOS], env=retry_math())
    opening = chat.ids("<s>[INST] what is 1 plus 2?[/INST]")
    added = chat.ids("[INST] Incorrect, try again.\nwhat is 1 plus 2?[/INST]")
    assert_trajectory(
        sample, sampler, [(opening, False), (chat.turn("The answer is 4."), True), (added, False), (chat.turn("The answer is 3."), True)]
    )
    assert metrics["multi_turn/history_rewrites"] == 1.0


def test_a_turn_cut_at_max_tokens_gets_the_templates_end_of_turn():
    chat = Chat("qwen3")
    cut = "<think>\nadd 1 and 2"  # no </think>, no end of turn: the template keeps the text, so no rewrite either
    sample, sampler, metrics = chat.roll([cut, "<think>\nx\n</think>\n\nThe answer is 3." + EOS], env=retry_math())
    added = chat.ids("<|im_end|>\n<|im_start|>user\nIncorrect, try again.\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    assert sample.tokens[sample.turns[0].end : sample.turns[1].start] == added
    assert metrics["multi_turn/history_rewrites"] == 0.0


def test_error_and_end_still_refuse_a_rewritten_history():
    chat = Chat("qwen3")
    replies = ["<think>\nadd\n</think>\n\nThe answer is 4." + EOS, "The answer is 3." + EOS]
    with pytest.raises(PrefixMismatch, match="in the policy's turn 1"):
        chat.roll(replies, env=retry_math(), on_prefix_mismatch="error")
    sample, sampler, metrics = chat.roll(replies, env=retry_math(), on_prefix_mismatch="end")
    assert sample.finish_reason == "prefix_mismatch" and len(sampler.calls) == 1
    assert metrics["multi_turn/prefix_failures"] == 1.0 and metrics["multi_turn/history_rewrites"] == 0.0


REWRITES_THE_SYSTEM_PROMPT = QWEN3.replace(
    "{%- elif messages[0].role == 'system' %}",
    "{%- elif true %}{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}{%- elif false %}",
)


def test_append_refuses_a_template_that_rewrites_more_than_the_policys_turns():
    chat = Chat("qwen3")
    chat.tok.chat_template = REWRITES_THE_SYSTEM_PROMPT
    with pytest.raises(PrefixMismatch, match=r"prompt h, after turn 1: .* in the opening messages"):
        chat.roll(["The answer is 4." + EOS, "The answer is 3." + EOS], env=retry_math())


def test_append_refuses_a_template_that_drops_a_policy_turn():
    chat = Chat("qwen3")
    chat.tok.chat_template = QWEN3.replace("{{- '<|im_start|>assistant\\n' + content }}", "{{- '<|im_start|>assistant\\n' }}")
    with pytest.raises(PrefixMismatch, match="in the policy's turn 1"):
        chat.roll(["The answer is 4." + EOS, "y" + EOS], env=lambda p: Endless(messages=list(QUESTION)))


def test_enable_thinking_is_refused_where_the_template_ignores_it():
    for family in ("llama3", "mistral"):
        with pytest.raises(PluginError, match="the chat template does not read enable_thinking"):
            Chat(family).roll(["3" + EOS], enable_thinking=False)
    with pytest.raises(PluginError, match="expected true or false"):
        make_plugin("multi_turn", enable_thinking="maybe")


def test_per_turn_samples_prompt_each_turn_with_the_templates_own_rendering():
    chat = Chat("qwen3")
    first, second = "<think>\nadd 1 and 2\n</think>\n\nThe answer is 4.", "<think>\nagain\n</think>\n\nThe answer is 3."
    sampler = ScriptedSampler(chat.tok, [[first + EOS], [second + EOS]])
    prompt = Prompt(id="p", messages=QUESTION, answer="3")
    group = run(make_plugin("multi_turn", per_turn_samples=True), [prompt], 1, sampler, env=retry_math())[0]
    history = [*QUESTION, {"role": "assistant", "content": first}, {"role": "user", "content": "Incorrect, try again.\nwhat is 1 plus 2?"}]
    served = chat.tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert "add 1 and 2" not in served  # the second turn is prompted as a served Qwen3 is: past reasoning dropped
    opening = chat.ids("<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    assert [call[0] for call in sampler.calls] == [[opening], [chat.ids(served)]]
    one, two = group  # one sample per turn, for one conversation
    for sample, context, reply in ((one, opening, first), (two, chat.ids(served), second)):
        turn = chat.turn(reply)
        assert sample.tokens == context + turn
        assert sample.loss_mask == [0.0] * len(context) + [1.0] * len(turn)
        assert sample.sampling_logprobs == [0.0] * len(context) + policy_logprobs(len(turn))
        assert sample.turns == [Turn(len(context), len(sample.tokens), len(sample.tokens))]
        # Each carries the conversation's outcome: its environment reward and its last answer.
        assert sample.env_reward == 0.5 and sample.text == second and sample.finish_reason == "stop"
    assert RECORDED[-1]["multi_turn/turns_mean"] == 2.0 and RECORDED[-1]["multi_turn/history_rewrites"] == 0.0


def test_per_turn_samples_end_a_conversation_whose_next_context_has_no_room():
    chat = Chat("qwen3")
    sampler = ScriptedSampler(chat.tok, [["The answer is 4." + EOS]])
    opening = chat.ids("<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    limit = len(opening) + len(chat.turn("The answer is 4.")) + 5
    rollout = make_plugin("multi_turn", per_turn_samples=True, max_total_tokens=limit)
    (sample,) = run(rollout, [Prompt(id="p", messages=QUESTION, answer="3")], 1, sampler, env=retry_math())[0]
    assert sample.tokens == opening + chat.turn("The answer is 4.") and sample.finish_reason == "length"


def test_per_turn_samples_refuse_a_prefix_option_they_ignore():
    for option in ("error", "end"):
        with pytest.raises(PluginError, match=f"on_prefix_mismatch={option} does nothing with per_turn_samples"):
            make_plugin("multi_turn", per_turn_samples=True, on_prefix_mismatch=option)


class Recording:
    """A sampler that keeps each prompt it was given and each completion it returned."""

    def __init__(self, sampler):
        self.inner, self.seen = sampler, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, prompts, num_samples, params):
        groups = self.inner.sample(prompts, num_samples, params)
        self.seen.extend((list(p), c) for p, g in zip(prompts, groups) for c in g)
        return groups


@pytest.mark.parametrize("per_turn_samples", [False, True])
def test_the_trainer_scores_the_samplers_tokens_with_its_logprobs_across_rewritten_turns(tmp_path, per_turn_samples):
    """A tiny model under a Qwen3 thinking template (every turn's opened <think> is dropped from
    history), the local sampler, three turns: token by token, the trainer scores what the sampler
    produced, with the sampler's logprobs (fp32)."""
    import torch

    from grpo_core.backend import sample_to_datum
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    config = RunConfig(model=str(build_chat_model(tmp_path / "m", "qwen3_thinking")), dtype="float32")
    trainer = LocalBackend().make_trainer(config=config)
    sampler = Recording(LocalSamplerPlugin().make_sampler(config=config, trainer=trainer))
    seen = sampler.seen
    groups = run(
        make_plugin("multi_turn", max_turns=3, per_turn_samples=per_turn_samples),
        [Prompt(id="l", messages=QUESTION)],
        3,
        sampler,
        env=lambda p: Endless(messages=list(QUESTION)),
        max_tokens=6,
    )
    metrics = RECORDED[-1]
    assert metrics["multi_turn/prefix_failures"] == 0.0 and metrics["multi_turn/turns_mean"] == 3.0
    assert metrics["multi_turn/history_rewrites"] == (0.0 if per_turn_samples else 6.0)
    assert len(groups[0]) == (9 if per_turn_samples else 3)
    for sample in groups[0]:
        assert len(sample.turns) == (1 if per_turn_samples else 3)
        (logprobs,) = trainer.forward([sample_to_datum(sample)])
        for turn in sample.turns:
            # The sampler was prompted with exactly the trajectory up to the turn, and produced the turn.
            (completion,) = [
                c for p, c in seen if p == sample.tokens[: turn.start] and list(c.tokens) == sample.tokens[turn.start : turn.end]
            ]
            assert sample.sampling_logprobs[turn.start : turn.end] == list(completion.logprobs)
            assert sample.loss_mask[turn.start : turn.end] == [1.0] * (turn.end - turn.start)
            trained = logprobs[turn.start - 1 : turn.end - 1]  # the trainer's logprob of token t sits at t - 1
            assert torch.allclose(trained, torch.tensor(completion.logprobs), atol=1e-5, rtol=0), (trained, completion.logprobs)
        assert sum(sample.loss_mask) == sum(t.end - t.start for t in sample.turns)


@pytest.mark.parametrize("per_turn_samples", [False, True])
def test_a_run_with_a_qwen3_thinking_template_trains_three_turns_per_conversation(tmp_path, per_turn_samples):
    from grpo_core.train import run as run_loop
    from tests.core.tiny_runs import config, metrics_of

    dataset = tmp_path / "guess.jsonl"
    dataset.write_text("".join(json.dumps({"question": "Guess my number", "answer": str(n)}) + "\n" for n in range(1, 9)))
    model = build_chat_model(tmp_path / "m", "qwen3_thinking")
    options = {"rollout": {"multi_turn": {"max_turns": 3, "per_turn_samples": per_turn_samples}}}
    summary = run_loop(
        config(model, dataset, tmp_path / "r", rollout="multi_turn", env="guess_number", reward=["env"], max_steps=3,
               max_completion_tokens=6, plugin_options=options, dtype="float32")
    )  # fmt: skip
    assert summary["steps"] == 3
    for m in metrics_of(tmp_path / "r"):
        assert m["multi_turn/turns_mean"] == 3.0 and m["multi_turn/prefix_failures"] == 0.0
        if per_turn_samples:  # 8 conversations, a sample per turn
            assert m["multi_turn/history_rewrites"] == 0 and m["train/samples"] == 24.0
        else:
            assert m["multi_turn/history_rewrites"] == 2 * 8 and m["train/samples"] == 8.0
