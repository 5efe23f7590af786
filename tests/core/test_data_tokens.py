"""Pre-tokenized rows: a prompt field holding token ids is sampled and trained as those ids."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from grpo_core.config import RunConfig
from grpo_core.data import DataError, Dataset, check_prompt_lengths, load_dataset, load_prompts, rows_fingerprint
from grpo_core.metrics import computed_only
from grpo_core.plugins.rollouts.multi_turn import MultiTurnRollout
from grpo_core.plugins.rollouts.single_turn import SingleTurnRollout, encode_prompt
from grpo_core.train import run
from grpo_core.types import Prompt, prompt_text
from tests.conftest import build_tiny_tokenizer
from tests.core.tiny_runs import config, length_reward, metrics_of, weights_of  # noqa: F401 - length_reward: the 'length' reward
from tests.helpers import grpo_core_in_process


def write(tmp_path, rows, name="ids.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_token_id_rows_become_prompts_of_those_ids_with_no_template(tmp_path):
    path = write(tmp_path, [{"question": [5, 7, 9], "answer": "4"}, "", {"question": [0], "answer": "1"}])
    prompts = load_prompts(path, template="Q: {prompt}\nA:")
    assert [p.tokens for p in prompts] == [[5, 7, 9], [0]]
    assert [p.text for p in prompts] == [None, None] and [p.messages for p in prompts] == [None, None]
    assert [p.id for p in prompts] == ["ids.jsonl:1", "ids.jsonl:3"] and prompts[0].answer == "4"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_the_rollout_samples_the_ids_as_they_are_without_chat_template_or_special_tokens(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}<|pad|>{{ m['content'] }}{% endfor %}"
    prompt = Prompt(id="r:1", tokens=[3, 1, 4])
    assert encode_prompt(tokenizer, prompt, chat_template=True) == [3, 1, 4]
    assert SingleTurnRollout(chat_template=True).encode(tokenizer, prompt) == [3, 1, 4]
    # The same ids as text would have gone through the template: the ids are what is sampled.
    assert encode_prompt(tokenizer, Prompt(id="r:1", text="3"), chat_template=True)[0] == tokenizer.pad_token_id


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": [1]}, {"question": []}], r"ids.jsonl:2: the prompt \(field 'question'\) is an empty list of token ids"),
        ([{"question": [1, "2"]}], r"ids.jsonl:1: field 'question' is a list, so token ids, but item 1 \('2'\) is not a non-negative"),
        ([{"question": [1, -3]}], r"ids.jsonl:1: .* item 1 \(-3\) is not a non-negative integer"),
        ([{"question": [True]}], r"ids.jsonl:1: .* item 0 \(True\) is not a non-negative integer"),
        ([{"question": [1.5]}], r"ids.jsonl:1: .* item 0 \(1.5\) is not"),
        ([{"question": [1]}, {"question": "text"}], r"ids.jsonl:2: the prompt is text, but .*ids.jsonl:1's is token ids"),
        ([{"question": "a"}, {"question": [1, 2]}], r"ids.jsonl:2: the prompt is token ids, but .*ids.jsonl:1's is text"),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}, {"question": [1]}],
            r"ids.jsonl:2: the prompt is token ids, but .*ids.jsonl:1's is text",
        ),
        ([{"question": {"ids": [1]}}], r"ids.jsonl:1: field 'question' must be a string \(or a list of token ids\)"),
    ],
)
def test_bad_token_rows_are_refused_with_their_row(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        load_prompts(write(tmp_path, rows))


def test_skip_bad_rows_leaves_out_a_row_of_the_other_form_and_counts_it(tmp_path):
    skipped: list[str] = []
    prompts = load_prompts(write(tmp_path, [{"question": [1]}, {"question": "x"}, {"question": [2]}]), skipped=skipped)
    assert [p.tokens for p in prompts] == [[1], [2]]
    assert len(skipped) == 1 and "ids.jsonl:2: the prompt is text" in skipped[0]


def test_a_prompt_template_is_refused_for_token_rows(tmp_path):
    path = write(tmp_path, [{"question": [1, 2]}])
    with pytest.raises(DataError, match="the prompts are token ids, which no template changes; drop --prompt-template"):
        load_dataset(RunConfig(dataset=str(path), prompt_template="Q: {prompt}"))
    assert load_dataset(RunConfig(dataset=str(path))).prompts[0].tokens == [1, 2]
    # The identity template (what an eval reads from a policy trained on token rows) changes nothing: no refusal.
    assert load_dataset(RunConfig(dataset=str(path), prompt_template="{prompt}")).prompts[0].tokens == [1, 2]


def dataset_of(path):
    return Dataset(load_prompts(path), path, str(path), "{prompt}")


def test_ids_outside_the_vocabulary_are_refused_with_their_row(tmp_path, tokenizer):
    vocabulary = len(tokenizer)
    path = write(tmp_path, [{"question": [1, vocabulary - 1]}, {"question": [2, 3, vocabulary]}])
    with pytest.raises(
        DataError, match=rf"ids.jsonl:2: token id {vocabulary} \(item 2\) is outside the tokenizer's vocabulary of {vocabulary}"
    ):
        check_prompt_lengths(dataset_of(path), SingleTurnRollout(), tokenizer, None, 8)
    ok = write(tmp_path, [{"question": [1, vocabulary - 1]}], "ok.jsonl")
    check_prompt_lengths(dataset_of(ok), SingleTurnRollout(), tokenizer, None, 8)


def test_checked_token_rows_are_decoded_for_the_rewards_and_loggers_that_read_text(tmp_path, tokenizer):
    ids = tokenizer("What is 2 plus 3?")["input_ids"]
    dataset = dataset_of(write(tmp_path, [{"question": ids}]))
    assert prompt_text(dataset.prompts[0]) == f"token ids: {' '.join(map(str, ids))}"  # nothing decoded it yet
    check_prompt_lengths(dataset, SingleTurnRollout(), tokenizer, None, 8)
    assert dataset.prompts[0].decoded == tokenizer.decode(ids)
    assert prompt_text(dataset.prompts[0]) == tokenizer.decode(ids) and "2 plus 3" in tokenizer.decode(ids)


def test_a_rollout_that_builds_prompts_from_text_refuses_token_rows(tmp_path, tokenizer):
    path = write(tmp_path, [{"question": [1, 2]}])
    with pytest.raises(DataError, match="the prompts are token ids, which the MultiTurnRollout rollout does not take"):
        check_prompt_lengths(dataset_of(path), MultiTurnRollout(), tokenizer, None, 8)


def test_token_rows_are_measured_against_the_context(tmp_path, tokenizer):
    path = write(tmp_path, [{"question": [1] * 10}])
    with pytest.raises(DataError, match=r"ids.jsonl:1: 10 prompt tokens \+ 8 completion tokens > 16"):
        check_prompt_lengths(dataset_of(path), SingleTurnRollout(), tokenizer, 16, 8)


def test_the_fingerprint_tells_token_rows_apart_and_keeps_text_rows_as_before():
    text = Prompt(id="d:1", text="12", answer="a")
    assert rows_fingerprint([text]) != rows_fingerprint([Prompt(id="d:1", tokens=[1, 2], answer="a")])
    assert rows_fingerprint([Prompt(id="d:1", tokens=[1, 2])]) != rows_fingerprint([Prompt(id="d:1", tokens=[1, 3])])
    # A text row's fingerprint is what runs before token rows recorded in data.json: their resume goes on.
    import hashlib

    old = hashlib.sha256(json.dumps(["d:1", "12", None, "a", {}], sort_keys=True).encode() + b"\n").hexdigest()
    assert rows_fingerprint([text]) == old


def test_a_bad_id_exits_1_with_one_line(tiny_model_dir, tmp_path):
    path = write(tmp_path, [{"question": [1, 10**6], "answer": "1"}])
    result = grpo_core_in_process(
        "run", "--model", str(tiny_model_dir), "--dataset", str(path), "--reward", "format", "--run-dir", str(tmp_path / "run")
    )
    assert result.returncode == 1, result.stderr
    assert "token id 1000000 (item 1) is outside the tokenizer's vocabulary" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run" / "config.json").exists()


@pytest.mark.slow
def test_a_pre_tokenized_run_samples_and_trains_exactly_as_the_same_prompts_as_text(tiny_model_dir, tiny_dataset, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(line) for line in tiny_dataset.read_text().splitlines()]
    template = "Question: {prompt}\nAnswer:"
    # The ids the text run samples: its template, and the tokenizer's own special tokens (if any).
    tokenized = [
        {**row, "question": encode_prompt(tokenizer, Prompt(id="", text=template.replace("{prompt}", row["question"])), True)}
        for row in rows
    ]
    ids = write(tmp_path, tokenized)
    samples = {"logger": {"jsonl": {"samples_every": 1}}}
    run(config(tiny_model_dir, tiny_dataset, tmp_path / "text", dtype="float32"))
    run(config(tiny_model_dir, ids, tmp_path / "ids", dtype="float32", prompt_template=None, plugin_options=samples))
    text_metrics, id_metrics = metrics_of(tmp_path / "text"), metrics_of(tmp_path / "ids")
    assert [computed_only(m) for m in id_metrics] == [computed_only(m) for m in text_metrics]
    assert text_metrics[-1]["reward/total"] > 0
    text_weights, id_weights = weights_of(tmp_path / "text"), weights_of(tmp_path / "ids")
    assert all(torch.equal(text_weights[k], id_weights[k]) for k in text_weights)
    first = json.loads((tmp_path / "ids" / "samples.jsonl").read_text().splitlines()[0])
    # The samples log shows the ids decoded: the text run's prompt, template and all.
    assert first["prompt"] in {template.replace("{prompt}", r["question"]) for r in rows}
