"""core/data.py's row checks at the boundaries their code draws (mutation testing, CONTRIBUTING.md)."""

import pytest

from grpo_core.data import _prompt
from grpo_core.errors import DataError


def prompt_of(row, answer_needed_by=()):
    return _prompt(row, "d.jsonl:2", "d.jsonl:2", "question", "answer", "Q: {prompt}", answer_needed_by)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],  # a list, but a message without content
        [{"content": "hi"}],  # without a role
        [{"role": "user", "content": "hi"}, "hi"],  # an element that is not an object
    ],
)
def test_every_message_must_be_an_object_with_role_and_content(messages):
    with pytest.raises(DataError, match=r"d.jsonl:2: 'messages' must be a list of \{role, content\} objects"):
        prompt_of({"messages": messages})


def test_a_message_with_non_text_content_is_kept():
    content = [{"type": "text", "text": "hi"}]
    assert prompt_of({"messages": [{"role": "user", "content": content}]}).messages == [{"role": "user", "content": content}]


class CharRollout:
    """One token per character of the prompt's text."""

    long_prompts = "error"

    def encode(self, tokenizer, prompt):
        return list(prompt.text)


def test_a_prompt_exactly_at_the_context_is_kept_and_one_long_prompt_names_no_more(tmp_path):
    from grpo_core import Prompt
    from grpo_core.data import Dataset, check_prompt_lengths

    def dataset(*texts):
        prompts = [Prompt(id=f"d.jsonl:{i}", text=text) for i, text in enumerate(texts, start=1)]
        return Dataset(prompts=prompts, path=tmp_path / "d.jsonl", name="d", template="{prompt}")

    fits = dataset("abcdefgh")  # 8 prompt tokens + 4 = 12 = the context
    check_prompt_lengths(fits, CharRollout(), None, max_context=12, max_completion_tokens=4)
    assert [p.text for p in fits.prompts] == ["abcdefgh"]
    with pytest.raises(DataError, match=r"d.jsonl:2: 9 prompt tokens \+ 4 completion tokens > 12, the model's context: shorten"):
        check_prompt_lengths(dataset("abc", "abcdefghi"), CharRollout(), None, max_context=12, max_completion_tokens=4)
    with pytest.raises(DataError, match=r"> 12, the model's context \(and 1 more\): shorten"):
        check_prompt_lengths(dataset("abcdefghi", "abcdefghij"), CharRollout(), None, max_context=12, max_completion_tokens=4)


def test_batches_are_full_when_the_prompts_do_not_divide_evenly():
    from grpo_core.data import prompt_batches, steps_available

    batches = list(prompt_batches(list("abcde"), batch_size=2, epochs=2, seed=0, shuffle=False))
    assert batches == [["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"]]
    assert steps_available(5, 2, 2) == 4
    assert list(prompt_batches(list("abcd"), batch_size=2, epochs=1, seed=0, shuffle=False)) == [["a", "b"], ["c", "d"]]
