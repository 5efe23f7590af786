from __future__ import annotations

import pytest

from grpo_core import PluginError, Prompt, make_plugin
from grpo_core.types import EnvStep

QUESTION = "Question: Ben has 28 pencils. He gives 5 to a friend. How many pencils does Ben have left?\nAnswer:"
PROMPT = Prompt(id="p", text=QUESTION, answer="28 - 5 = 23\n#### 23")


def play(answers, prompt=PROMPT, **options):
    episode = make_plugin("retry_math", **options).env_reset(prompt=prompt)
    return episode, [episode.step(text, []) for text in answers]


def test_a_right_first_answer_earns_one_and_ends():
    episode, steps = play([" 28 - 5 = 23\n#### 23"])
    assert episode.messages == [{"role": "user", "content": QUESTION}]
    assert steps == [EnvStep(messages=[], reward=1.0, done=True)]


def test_a_wrong_answer_hears_the_feedback_and_the_question_and_later_answers_are_discounted():
    _, steps = play([" 22", "#### 24", "it is 23"])
    retry = EnvStep(messages=[{"role": "user", "content": "Incorrect, try again.\n" + QUESTION}], reward=0.0, done=False)
    assert steps == [retry, retry, EnvStep(messages=[], reward=0.25, done=True)]


def test_no_right_answer_in_max_turns_earns_zero():
    _, steps = play([" 1", " 2"], max_turns=2)
    assert steps[-1] == EnvStep(messages=[], reward=0.0, done=True) and not steps[0].done


def test_options_change_the_conversation_and_the_reward():
    _, steps = play([" 1", " 23"], discount=0.9, feedback="No.", restate=False)
    assert steps[0].messages == [{"role": "user", "content": "No."}]
    assert steps[1].reward == pytest.approx(0.9)
    # strict: the final number alone is no answer; an explicit marker is.
    assert play([" 23"], strict=True)[1][0].reward == 0.0
    assert play(["#### 23"], strict=True)[1][0].reward == 1.0
    assert play([" 23"], discount=0.0)[1][0].reward == 1.0 and play([" 1", " 23"], discount=0.0)[1][1].reward == 0.0


def test_a_chat_prompt_opens_the_conversation_and_its_last_user_message_is_restated():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 28 - 5?"}]
    episode, steps = play([" 1"], prompt=Prompt(id="c", messages=messages, answer="23"))
    assert episode.messages == messages and episode.messages is not messages
    assert steps[0].messages == [{"role": "user", "content": "Incorrect, try again.\nWhat is 28 - 5?"}]


def test_episodes_are_independent():
    env = make_plugin("retry_math", max_turns=2)
    first, second = env.env_reset(prompt=PROMPT), env.env_reset(prompt=PROMPT)
    first.step(" 1", [])
    assert second.step(" 23", []).reward == 1.0 and first.step(" 23", []).reward == 0.5


def test_a_row_without_an_answer_is_refused():
    with pytest.raises(PluginError, match="retry_math: prompt n has no reference answer"):
        make_plugin("retry_math").env_reset(prompt=Prompt(id="n", text="x"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_turns": 0}, "max_turns must be positive"),
        ({"discount": 1.5}, r"discount must be in \[0, 1\]"),
        ({"discount": -0.1}, "discount"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("retry_math", **options)
