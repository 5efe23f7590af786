"""The local sampler's stop rules without a model: which token ids stop a completion, and when a
stop string counts as hit (mutation testing, CONTRIBUTING.md)."""

from types import SimpleNamespace

from grpo_core import SamplingParams
from grpo_core.plugins.samplers.local import LocalSampler


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i); token 0 is a special token, "<eos>"."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 and skip_special_tokens else "<eos>" if i == 0 else chr(ord("a") + i) for i in ids)


def stop_ids(tokenizer_eos, generation_eos, extra=(7,)):
    sampler = SimpleNamespace(
        tokenizer=SimpleNamespace(eos_token_id=tokenizer_eos),
        model=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=generation_eos)),
    )
    return LocalSampler._stop_token_ids(sampler, SamplingParams(stop_token_ids=list(extra)))


def test_stop_token_ids_are_the_params_the_tokenizer_eos_and_the_generation_config_eos():
    assert stop_ids(2, [3, 4]) == {7, 2, 3, 4}
    assert stop_ids(2, 5) == {7, 2, 5}
    assert stop_ids(None, [3]) == {7, 3}
    assert stop_ids(2, None) == {7, 2}
    assert stop_ids(None, None, extra=()) == set()


def hit(completion, stops):
    return LocalSampler._hit_stop_string(SimpleNamespace(tokenizer=CharTokenizer()), completion, stops)


def letters(text):
    return [ord(c) - ord("a") for c in text]


def test_a_stop_string_at_the_tail_is_hit_whatever_the_completions_length():
    assert hit(letters("bc"), ["bc"])  # shorter than the window
    assert not hit(letters("bd"), ["bc"])
    # Twelve characters: the window must cover the longest stop string, not the shortest.
    assert hit(letters("zz" + "bcdefghijklm"), ["x", "bcdefghijklm"])
    assert hit(letters("b" * 30 + "cd"), ["cd"])


def test_a_stop_string_can_be_the_text_of_a_special_token():
    assert hit(letters("bc") + [0], ["<eos>"])
