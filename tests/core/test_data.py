from __future__ import annotations

import json
import shutil

import attrs
import pytest

from grpo_core.data import (
    ASSETS,
    DEFAULT_TASK_TEMPLATE,
    PROMPT_SETTINGS_FILE,
    DataError,
    check_prompt_lengths,
    decode_escapes,
    load_dataset,
    load_prompts,
    prompt_batches,
    read_prompt_settings,
    write_prompt_settings,
)


def write(tmp_path, lines):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rows_become_prompts_with_template_and_answers(tmp_path):
    path = write(
        tmp_path,
        [
            json.dumps({"question": "2+2?", "answer": "#### 4"}),
            "",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": 5}),
        ],
    )
    prompts = load_prompts(path, template="Q: {prompt}\nA:")
    assert prompts[0].text == "Q: 2+2?\nA:" and prompts[0].answer == "#### 4"
    assert prompts[0].id == "d.jsonl:1"
    assert prompts[1].messages == [{"role": "user", "content": "hi"}] and prompts[1].answer == "5"
    assert len(load_prompts(path, max_rows=1)) == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "x"', r"d.jsonl:2: malformed JSON"),
        ('{"q": "x"}', r"d.jsonl:2: missing field 'question' \(fields: q\)"),
        ("[1, 2]", r"d.jsonl:2: expected a JSON object"),
        ('{"question": 3}', r"d.jsonl:2: field 'question' must be a string"),
        ('{"messages": "hi"}', r"d.jsonl:2: 'messages' must be a list"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path, [json.dumps({"question": "ok"}), line])
    with pytest.raises(DataError, match=message):
        load_prompts(path)


def test_missing_file_and_bad_template(tmp_path):
    with pytest.raises(DataError, match="dataset file not found"):
        load_prompts(tmp_path / "none.jsonl")
    with pytest.raises(DataError, match="no {prompt} placeholder"):
        load_prompts(write(tmp_path, ['{"question": "x"}']), template="Q:")


def test_batches_are_seeded_full_and_cover_each_epoch(tmp_path):
    prompts = load_prompts(write(tmp_path, [json.dumps({"question": str(i)}) for i in range(10)]))
    batches = list(prompt_batches(prompts, 3, epochs=2, seed=1, shuffle=True))
    assert len(batches) == 6 and all(len(b) == 3 for b in batches)
    first_epoch = [p.text for b in batches[:3] for p in b]
    assert len(set(first_epoch)) == 9
    again = list(prompt_batches(prompts, 3, epochs=2, seed=1, shuffle=True))
    assert [[p.text for p in b] for b in again] == [[p.text for p in b] for b in batches]
    assert [p.text for p in next(prompt_batches(prompts, 3, 1, 0, shuffle=False))] == ["0", "1", "2"]


def test_skip_bad_rows_counts_them(tmp_path):
    path = write(tmp_path, [json.dumps({"question": "a"}), "{oops", json.dumps({"q": 1}), json.dumps({"question": "b"})])
    skipped: list[str] = []
    prompts = load_prompts(path, skipped=skipped)
    assert [p.text for p in prompts] == ["a", "b"]
    assert len(skipped) == 2 and skipped[0].endswith("d.jsonl:2: malformed JSON: Expecting property name enclosed in double quotes")
    assert "d.jsonl:3: missing field 'question'" in skipped[1]


def test_a_line_that_is_not_utf8_is_named_not_a_traceback(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"question": "a"}\n{"question": "caf\xe9"}\n{"question": "b"}\n')
    with pytest.raises(DataError, match=r"^\S*d.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 18\)$"):
        load_prompts(path)
    skipped: list[str] = []
    assert [p.text for p in load_prompts(path, skipped=skipped)] == ["a", "b"]
    assert len(skipped) == 1 and skipped[0].endswith("d.jsonl:2: not valid UTF-8 (byte 0xe9 at column 18)")


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "a"}\n')
    assert load_prompts(path)[0].text == "a"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "  \n"}, r"d.jsonl:2: the prompt \(field 'question'\) is empty"),
        ({"question": ""}, r"d.jsonl:2: the prompt \(field 'question'\) is empty"),
        ({"messages": []}, r"d.jsonl:2: 'messages' is empty"),
        (
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": " "}]},
            r"d.jsonl:2: message 2 \(user\) has empty content",
        ),
    ],
)
def test_empty_prompts_are_bad_rows(tmp_path, row, message):
    path = write(tmp_path, [json.dumps({"question": "ok"}), json.dumps(row), json.dumps({"question": "fine"})])
    with pytest.raises(DataError, match=message):
        load_prompts(path)
    skipped: list[str] = []
    assert [p.text for p in load_prompts(path, skipped=skipped)] == ["ok", "fine"]
    assert len(skipped) == 1 and skipped[0].split("/")[-1].startswith("d.jsonl:2: ")


def test_an_answer_is_required_only_when_a_reward_needs_one(tmp_path):
    path = write(
        tmp_path, [json.dumps({"question": "a", "answer": 4}), json.dumps({"question": "b"}), json.dumps({"question": "c", "answer": " "})]
    )
    assert [p.answer for p in load_prompts(path)] == ["4", None, " "]
    with pytest.raises(
        DataError, match=r"d.jsonl:2: the answer field 'answer' is missing \(fields: question\); the gsm8k, sympy reward needs it"
    ):
        load_prompts(path, answer_needed_by=["gsm8k", "sympy"])
    skipped: list[str] = []
    assert [p.text for p in load_prompts(path, skipped=skipped, answer_needed_by=["gsm8k"])] == ["a"]
    assert skipped[1].endswith("d.jsonl:3: the answer field 'answer' is empty; the gsm8k reward needs it (set --answer-field)")


def test_rows_past_max_rows_are_not_read_and_skips_do_not_count_towards_it(tmp_path):
    path = write(tmp_path, [json.dumps({"question": "a"}), "{bad", json.dumps({"question": "b"}), "{bad too"])
    assert [p.text for p in load_prompts(path, max_rows=2, skipped=[])] == ["a", "b"]
    assert [p.text for p in load_prompts(path, max_rows=1)] == ["a"]


def test_a_file_of_only_bad_rows_says_so(tmp_path):
    with pytest.raises(DataError, match=r"d.jsonl: no usable rows; all 2 were bad, first: .*d.jsonl:1: malformed JSON"):
        load_prompts(write(tmp_path, ["{x", "{y"]), skipped=[])


@pytest.mark.parametrize(
    ("typed", "decoded"),
    [
        (r"Q: {prompt}\nA:", "Q: {prompt}\nA:"),
        (r"{prompt}\t=", "{prompt}\t="),
        (r"a\\nb {prompt}", "a\\nb {prompt}"),
        ("x\n{prompt}", "x\n{prompt}"),
        (r"\d {prompt}", r"\d {prompt}"),
    ],
)
def test_template_escapes_typed_in_a_shell_are_decoded(typed, decoded):
    assert decode_escapes(typed) == decoded


def config_for(**values):
    from grpo_core.config import RunConfig

    return RunConfig(**values)


def test_embedded_splits_by_name_or_path_keep_the_task_template(tmp_path):
    train = load_dataset(config_for(dataset="default"))
    assert (train.name, train.path, train.template, len(train.prompts)) == (
        "default:train",
        ASSETS / "task" / "train.jsonl",
        DEFAULT_TASK_TEMPLATE,
        5000,
    )
    test = load_dataset(config_for(dataset="default:test"))
    assert (test.name, test.path.name, len(test.prompts)) == ("default:test", "test.jsonl", 500)
    assert test.prompts[0].text.startswith("Question: ") and test.prompts[0].text.endswith("\nAnswer:")
    by_path = load_dataset(config_for(dataset=str(ASSETS / "task" / "test.jsonl")))
    assert (by_path.name, by_path.template) == ("default:test", DEFAULT_TASK_TEMPLATE)
    assert [p.text for p in by_path.prompts] == [p.text for p in test.prompts]
    assert load_dataset(config_for(dataset="default:train", max_rows=3)).counts == {
        "data/prompts": 3,
        "data/skipped_bad_rows": 0,
        "data/skipped_long_prompts": 0,
    }
    with pytest.raises(DataError, match="unknown split 'dev' of the embedded task; splits: train, test"):
        load_dataset(config_for(dataset="default:dev"))
    # Another file is not the embedded task, even with the same rows.
    copy = tmp_path / "train.jsonl"
    copy.write_text((ASSETS / "task" / "train.jsonl").read_text())
    other = load_dataset(config_for(dataset=str(copy), max_rows=1))
    assert (other.name, other.template) == (str(copy), "{prompt}") and not other.prompts[0].text.startswith("Question:")
    typed = load_dataset(config_for(dataset=str(copy), max_rows=1, prompt_template=r"Q: {prompt}\nA:"))
    assert typed.template == "Q: {prompt}\nA:" and typed.prompts[0].text.endswith("?\nA:")


def test_load_dataset_checks_answers_and_reports_skips(tmp_path, capsys):
    rows = [
        json.dumps({"question": "a", "answer": "1"}),
        json.dumps({"question": ""}),
        json.dumps({"question": "c"}),
        "{",
        json.dumps({"question": "e", "answer": "5"}),
    ]
    path = write(tmp_path, rows)
    with pytest.raises(DataError, match=r"d.jsonl:2: the prompt \(field 'question'\) is empty"):
        load_dataset(config_for(dataset=str(path)), ["gsm8k"])
    dataset = load_dataset(config_for(dataset=str(path), skip_bad_rows=True), ["gsm8k"])
    assert [p.text for p in dataset.prompts] == ["a", "e"]
    assert dataset.counts == {"data/prompts": 2, "data/skipped_bad_rows": 3, "data/skipped_long_prompts": 0}
    assert [reason.split("d.jsonl:")[1][:2] for reason in dataset.skipped_bad_rows] == ["2:", "3:", "4:"]
    notice = capsys.readouterr().err
    assert notice.startswith(f"skipped 3 bad rows of {path} (--skip-bad-rows); first: {path}:2: the prompt")
    assert f"{path}:4: malformed JSON" in notice
    # Without a reward that needs answers, rows without one are fine.
    assert load_dataset(config_for(dataset=str(path), skip_bad_rows=True)).counts["data/prompts"] == 3


@attrs.define
class CharRollout:
    """A rollout whose encoding is one token per character plus a two-token wrapper."""

    long_prompts: str = "error"

    def encode(self, tokenizer, prompt):
        return [0, 0] + [1] * len(prompt.text)


def dataset_of(tmp_path, texts):
    return load_dataset(config_for(dataset=str(write(tmp_path, [json.dumps({"question": t}) for t in texts]))))


def test_long_prompts_are_measured_with_the_rollouts_encoding(tmp_path, capsys):
    texts = ["x" * 5, "x" * 9, "x" * 6, "x" * 20]
    # 6 chars + 2 wrapper tokens + 4 completion tokens = 12 fits; 7 and more does not.
    dataset = dataset_of(tmp_path, texts)
    with pytest.raises(DataError) as err:
        check_prompt_lengths(dataset, CharRollout(), None, max_context=12, max_completion_tokens=4)
    assert str(err.value) == (
        f"{tmp_path / 'd.jsonl'}:2: 11 prompt tokens + 4 completion tokens > 12, the model's context (and 1 more): "
        "shorten the prompts, lower --max-completion-tokens, or pass --rollout-opt long_prompts=skip"
    )
    check_prompt_lengths(dataset, CharRollout(long_prompts="skip"), None, max_context=12, max_completion_tokens=4)
    assert [len(p.text) for p in dataset.prompts] == [5, 6]
    assert dataset.counts == {"data/prompts": 2, "data/skipped_long_prompts": 2, "data/skipped_bad_rows": 0}
    assert dataset.skipped_long_prompts[1] == f"{tmp_path / 'd.jsonl'}:4: 22 prompt tokens + 4 completion tokens > 12"
    assert capsys.readouterr().err.startswith("skipped 2 prompts too long for the model's context")
    with pytest.raises(DataError, match="every prompt is too long for the model's context of 3 tokens"):
        check_prompt_lengths(dataset_of(tmp_path, texts), CharRollout(long_prompts="skip"), None, max_context=3, max_completion_tokens=1)


def test_prompt_lengths_are_not_checked_without_an_encoder_or_a_known_context(tmp_path):
    dataset = dataset_of(tmp_path, ["x" * 50])
    check_prompt_lengths(dataset, object(), None, max_context=4, max_completion_tokens=4)
    check_prompt_lengths(dataset, CharRollout(), None, max_context=None, max_completion_tokens=4)
    assert len(dataset.prompts) == 1


def test_single_turn_chat_template_counts_in_the_length_check(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from grpo_core import make_plugin

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    dataset = dataset_of(tmp_path, ["what is 1 plus 2?"])
    raw = len(tokenizer("what is 1 plus 2?")["input_ids"])
    wrapped = len(tokenizer("<user>what is 1 plus 2?\n<assistant>")["input_ids"])
    assert wrapped > raw
    check_prompt_lengths(dataset, make_plugin("single_turn", chat_template=False), tokenizer, raw + 4, 4)
    with pytest.raises(DataError, match=rf"d.jsonl:1: {wrapped} prompt tokens \+ 4 completion tokens > {raw + 4}"):
        check_prompt_lengths(dataset, make_plugin("single_turn"), tokenizer, raw + 4, 4)


def test_prompt_settings_round_trip(tmp_path):
    from grpo_core.config import load

    config = load(None, {"dataset": "default", "stop": ["\n\n"], "max_completion_tokens": 12}, {"rollout": ["chat_template=false"]})
    path = write_prompt_settings(tmp_path, config)
    assert path == tmp_path / PROMPT_SETTINGS_FILE
    assert read_prompt_settings(tmp_path) == {
        "dataset": "default:train",
        "embedded_task": True,
        "trained_from": "default",
        "prompt_field": "question",
        "answer_field": "answer",
        "prompt_template": DEFAULT_TASK_TEMPLATE,
        "rollout": "single_turn",
        "rollout_options": {"chat_template": "false", "long_prompts": "error"},
        "stop": ["\n\n"],
        "max_completion_tokens": 12,
    }
    custom = load(None, {"dataset": "/data/gsm8k.jsonl", "prompt_template": r"Q: {prompt}\nA:", "prompt_field": "q"}, {})
    write_prompt_settings(tmp_path, custom)
    settings = read_prompt_settings(str(tmp_path))
    assert (settings["dataset"], settings["embedded_task"], settings["prompt_template"], settings["prompt_field"]) == (
        "/data/gsm8k.jsonl", False, "Q: {prompt}\nA:", "q",
    )  # fmt: skip
    assert settings["rollout_options"] == {"chat_template": True, "long_prompts": "error"}
    assert read_prompt_settings(tmp_path / "elsewhere") is None and read_prompt_settings("Qwen/Qwen3-0.6B") is None
    (tmp_path / PROMPT_SETTINGS_FILE).write_text("{not json")
    with pytest.raises(DataError, match=f"{PROMPT_SETTINGS_FILE}: unreadable prompt settings"):
        read_prompt_settings(tmp_path)


def test_run_stops_on_bad_rows_before_the_model_loads_or_skips_and_counts_them(tiny_model_dir, tiny_dataset, tmp_path):
    from tests.test_cli import grpo_core, small_run_args

    good = tiny_dataset.read_bytes()
    for bad_row, message in [
        (b'{"question": "\xff"}\n', "not valid UTF-8 (byte 0xff at column 15)"),
        (b'{"question": " "}\n', "the prompt (field 'question') is empty"),
    ]:
        data = tmp_path / "data.jsonl"
        data.write_bytes(good[: good.index(b"\n") + 1] + bad_row + good[good.index(b"\n") + 1 :])
        # A model that does not exist: the data must be refused before anything tries to load it.
        out = grpo_core(*small_run_args(tmp_path / "no-model", data, tmp_path / "r"))
        assert out.returncode == 1 and out.stderr.strip() == f"error: {data}:2: {message}"
        assert not (tmp_path / "r").exists()
        skipped = grpo_core(*small_run_args(tiny_model_dir, data, tmp_path / "r", "--max-steps", "1", "--skip-bad-rows"))
        assert skipped.returncode == 0, skipped.stderr
        assert f"skipped 1 bad rows of {data}" in skipped.stderr and f"{data}:2: {message}" in skipped.stderr
        shutil.rmtree(tmp_path / "r")
