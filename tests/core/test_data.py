from __future__ import annotations

import json

import pytest

from grpo_core.data import DataError, load_prompts, prompt_batches


def write(tmp_path, lines):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rows_become_prompts_with_template_and_answers(tmp_path):
    path = write(tmp_path, [json.dumps({"question": "2+2?", "answer": "#### 4"}), "", json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": 5})])
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
