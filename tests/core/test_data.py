from __future__ import annotations

import json
import shutil
import sys

import attrs
import pytest

from grpo_core import PluginError
from grpo_core.config import decode_escapes, load
from grpo_core.data import (
    DEFAULT_TASK_TEMPLATE,
    PROMPT_SETTINGS_FILE,
    DataError,
    check_prompt_lengths,
    load_dataset,
    load_prompts,
    prompt_batches,
    read_prompt_settings,
    write_prompt_settings,
)
from grpo_core.embedded import ASSETS


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
    # A template as typed in a shell: the config reads its escapes once, where it is given.
    typed = load_dataset(load(None, {"dataset": str(copy), "max_rows": 1, "prompt_template": r"Q: {prompt}\nA:"}, {}))
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
    from tests.helpers import grpo_core_in_process, small_run_args

    good = tiny_dataset.read_bytes()
    for bad_row, message in [
        (b'{"question": "\xff"}\n', "not valid UTF-8 (byte 0xff at column 15)"),
        (b'{"question": " "}\n', "the prompt (field 'question') is empty"),
    ]:
        data = tmp_path / "data.jsonl"
        data.write_bytes(good[: good.index(b"\n") + 1] + bad_row + good[good.index(b"\n") + 1 :])
        # A hub model that does not exist (a missing folder is refused first): the data must be refused before it loads.
        out = grpo_core_in_process(*small_run_args("grpo-core-tests/no-such-model", data, tmp_path / "r"))
        assert out.returncode == 1 and out.stderr.strip() == f"error: {data}:2: {message}"
        assert not (tmp_path / "r").exists()
        skipped = grpo_core_in_process(*small_run_args(tiny_model_dir, data, tmp_path / "r", "--max-steps", "1", "--skip-bad-rows"))
        assert skipped.returncode == 0, skipped.stderr
        assert f"skipped 1 bad rows of {data}" in skipped.stderr and f"{data}:2: {message}" in skipped.stderr
        shutil.rmtree(tmp_path / "r")


# Other sources: Parquet files, save_to_disk folders and the hub go through the same row checks.

ROWS = [
    {"q": "2+2?", "a": "4"},
    {"q": "", "a": "1"},
    {"q": None, "a": "2"},
    {"q": "3+3?", "a": None},
    {"q": "1+1?", "a": "2"},
]
"""One good row, an empty prompt, a null prompt, a missing answer, one more good row."""


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def save_to_disk(folder, rows=None, splits=None):
    import datasets

    if splits is None:
        datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    else:
        datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in splits.items()}).save_to_disk(str(folder))
    return folder


def test_a_parquet_file_has_the_same_field_mapping_and_bad_rows_named_by_index(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    skipped: list[str] = []
    prompts = load_prompts(path, "q", "a", "Q: {prompt}", skipped=skipped, answer_needed_by=["gsm8k"])
    assert [(p.id, p.text, p.answer) for p in prompts] == [("d.parquet[0]", "Q: 2+2?", "4"), ("d.parquet[4]", "Q: 1+1?", "2")]
    assert prompts[1].metadata == {"q": "1+1?", "a": "2"}
    assert skipped == [
        f"{path}[1]: the prompt (field 'q') is empty",
        f"{path}[2]: the prompt (field 'q') is empty",
        f"{path}[3]: the answer field 'a' is missing (fields: q, a); the gsm8k reward needs it (set --answer-field)",
    ]
    with pytest.raises(DataError, match=rf"^{path}\[1\]: the prompt \(field 'q'\) is empty$"):
        load_prompts(path, "q", "a")
    with pytest.raises(DataError, match=rf"^{path}\[0\]: missing field 'question' \(fields: q, a\); set --prompt-field$"):
        load_prompts(path)
    assert [p.text for p in load_prompts(path, "q", "a", max_rows=1)] == ["2+2?"]


def test_a_parquet_file_of_chats(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "answer": "5"}, {"messages": [], "answer": "6"}]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    skipped: list[str] = []
    (prompt,) = load_prompts(path, skipped=skipped)
    assert (prompt.messages, prompt.answer, skipped) == ([{"role": "user", "content": "hi"}], "5", [f"{path}[1]: 'messages' is empty"])


def test_a_saved_dataset_folder_with_or_without_splits(tmp_path):
    one = save_to_disk(tmp_path / "one", ROWS)
    assert [p.id for p in load_prompts(one, "q", "a", skipped=[])] == ["one[0]", "one[3]", "one[4]"]
    with pytest.raises(DataError, match=rf"^{one}\[1\]: the prompt \(field 'q'\) is empty$"):
        load_prompts(one, "q", "a")
    with pytest.raises(DataError, match=f"{one} holds one dataset, not splits; drop ':test'"):
        load_prompts(f"{one}:test", "q", "a")
    split = save_to_disk(tmp_path / "split", splits={"train": ROWS[:1], "test": ROWS[4:]})
    assert [(p.id, p.text) for p in load_prompts(split, "q", "a")] == [("split[0]", "2+2?")]
    assert [(p.id, p.text) for p in load_prompts(f"{split}:test", "q", "a")] == [("split:test[0]", "1+1?")]
    with pytest.raises(DataError, match=rf"{split} has no split 'dev'; splits: train, test \(choose one with {split}:SPLIT\)"):
        load_prompts(f"{split}:dev", "q", "a")
    only_test = save_to_disk(tmp_path / "only_test", splits={"test": ROWS[:1]})
    with pytest.raises(DataError, match="has no split 'train'; splits: test"):
        load_prompts(only_test, "q", "a")
    (tmp_path / "plain").mkdir()
    with pytest.raises(
        DataError, match=r"plain: not a dataset folder \(save_to_disk of HF datasets writes dataset_dict.json or state.json"
    ):
        load_prompts(tmp_path / "plain")


def test_load_dataset_reads_a_saved_split_through_the_config(tmp_path, capsys):
    split = save_to_disk(tmp_path / "saved", splits={"train": ROWS})
    capsys.readouterr()  # datasets' progress bar
    dataset = load_dataset(config_for(dataset=str(split), prompt_field="q", answer_field="a", skip_bad_rows=True), ["gsm8k"])
    assert (dataset.name, dataset.path, [p.text for p in dataset.prompts]) == (str(split), split, ["2+2?", "1+1?"])
    assert dataset.counts["data/skipped_bad_rows"] == 3
    assert capsys.readouterr().err.startswith(f"skipped 3 bad rows of {split} (--skip-bad-rows); first: {split}[1]: the prompt")


def test_prompt_lengths_name_the_row_of_any_source(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"question": "x" * 5}, {"question": "x" * 20}])
    with pytest.raises(DataError, match=rf"^{path}\[1\]: 22 prompt tokens \+ 4 completion tokens > 12"):
        check_prompt_lengths(load_dataset(config_for(dataset=str(path))), CharRollout(), None, max_context=12, max_completion_tokens=4)


@pytest.mark.parametrize(
    ("given", "call"),
    [
        ("openai/gsm8k", ("openai/gsm8k", None, "train")),
        ("openai/gsm8k:test", ("openai/gsm8k", None, "test")),
        ("openai/gsm8k:main:test", ("openai/gsm8k", "main", "test")),
    ],
)
def test_a_hub_name_loads_through_datasets_with_config_and_split(monkeypatch, given, call):
    import datasets

    calls = []

    def load(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"question": "2+2?", "answer": "#### 4"}, {"question": " "}])

    monkeypatch.setattr(datasets, "load_dataset", load)
    skipped: list[str] = []
    prompts = load_prompts(given, skipped=skipped)
    assert calls == [call]
    assert [(p.id, p.text, p.answer) for p in prompts] == [(f"{given.split('/')[1]}[0]", "2+2?", "#### 4")]
    assert skipped == [f"{given}[1]: the prompt (field 'question') is empty"]


@pytest.mark.slow
def test_a_hub_name_fails_clearly_offline(tmp_path):
    from tests.helpers import grpo_core, small_run_args

    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = grpo_core(*small_run_args("grpo-core-tests/no-such-model", "someone/no-such-data:test", tmp_path / "r"), env=offline)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    message = out.stderr.strip()
    assert message.startswith(
        "error: someone/no-such-data:test: no such file or folder, and loading it from the Hugging Face hub failed "
        "(offline: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE set): "
    )
    assert "OfflineModeIsEnabled" in message  # datasets' own reason: it never tried the network
    assert message.endswith("; for a hub dataset give NAME, NAME:SPLIT or NAME:CONFIG:SPLIT")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "given", ["missing.jsonl", "missing.parquet", "dir/missing.json", "/abs/path/none", "a/b/c", "x:y:z:w", "bad name"]
)
def test_a_missing_file_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # a hub lookup would fail differently
    with pytest.raises(DataError, match=f"^dataset file not found: {given}$"):
        load_prompts(given)


@pytest.mark.parametrize(
    ("make", "module", "needed_for"),
    [
        (lambda tmp: write_parquet(tmp / "d.parquet", ROWS), "pyarrow.parquet", "a Parquet dataset"),
        (lambda tmp: save_to_disk(tmp / "saved", ROWS), "datasets", "a dataset folder"),
        (lambda tmp: "someone/data", "datasets", "the hub dataset someone/data"),
    ],
)
def test_without_the_datasets_extra_the_message_names_it(tmp_path, monkeypatch, make, module, needed_for):
    given = make(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(PluginError, match=rf"^{needed_for} needs the optional extra 'datasets': pip install 'grpo-core\[datasets\]'$"):
        load_prompts(given, "q", "a")


def test_a_run_stops_on_a_bad_parquet_row_before_the_model_loads(tmp_path):
    from tests.helpers import grpo_core_in_process, small_run_args

    data = write_parquet(
        tmp_path / "d.parquet", [{"question": "what is 1 plus 2?", "answer": "#### 3"}, {"question": "", "answer": "#### 0"}]
    )
    out = grpo_core_in_process(*small_run_args("grpo-core-tests/no-such-model", data, tmp_path / "r"))
    assert out.returncode == 1 and out.stderr.strip() == f"error: {data}[1]: the prompt (field 'question') is empty"
