from __future__ import annotations

import json
import shlex
import sys

import pytest

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.data import dataset_source, load_prompts
from tests.helpers import grpo_core_in_process

reasoning_gym = pytest.importorskip("reasoning_gym")


def samples(prompt, *texts):
    return [
        Sample(prompt=prompt, tokens=[1], sampling_logprobs=[0.0], loss_mask=[1.0], text=t, finish_reason="stop", policy_version=0)
        for t in texts
    ]


def rows(dataset: str, seed: int = 0) -> list[Prompt]:
    return load_prompts(dataset_source(dataset, seed))


def test_right_answer_scores_one_wrong_scores_zero_as_the_tasks_own_scorer():
    reward = make_plugin("reasoning_gym")
    for prompt in rows("reasoning_gym:basic_arithmetic=1,chain_sum=1,letter_counting=1:6"):
        entry = prompt.metadata
        answer = entry["answer"]
        wrong = int(answer) + 1  # these three tasks have integer answers
        texts = [f"so <answer>{answer}</answer>", f"<answer>{wrong}</answer>", answer, f"<answer>0</answer> <answer>{answer}</answer>"]
        scores = reward.reward(prompt=prompt, samples=samples(prompt, *texts))
        own = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
        assert scores == [1.0, 0.0, 0.0, 1.0]  # no tags: 0; the last tag pair decides
        assert scores == [own(reasoning_gym.utils.extract_answer(t), entry) for t in texts]


def test_answer_tag_option_is_the_tag_read():
    prompt = rows("reasoning_gym:basic_arithmetic:1")[0]
    answer = prompt.metadata["answer"]
    texts = [f"<final>{answer}</final>", f"<answer>{answer}</answer>"]
    assert make_plugin("reasoning_gym", answer_tag="final").reward(prompt=prompt, samples=samples(prompt, *texts)) == [1.0, 0.0]
    with pytest.raises(PluginError, match="tag name"):
        make_plugin("reasoning_gym", answer_tag="<answer>")


def test_answer_format_number_reads_the_final_number_as_the_gsm8k_reward_does():
    prompt = rows("reasoning_gym:letter_counting:1")[0]
    answer = int(prompt.metadata["answer"])
    texts = [f"h h h\n#### {answer}", f"#### {answer + 1}", f"I count {answer + 1}, no: {answer}", "no number", f"#### {answer}.0"]
    reward = make_plugin("reasoning_gym", answer_format="number")
    assert reward.reward(prompt=prompt, samples=samples(prompt, *texts)) == [1.0, 0.0, 1.0, 0.0, 1.0]
    # The default reads tags only: the same completions score nothing.
    assert make_plugin("reasoning_gym").reward(prompt=prompt, samples=samples(prompt, *texts)) == [0.0] * 5


def test_answer_format_is_checked_and_answer_tag_is_refused_where_it_is_not_read():
    with pytest.raises(PluginError, match="answer_format"):
        make_plugin("reasoning_gym", answer_format="boxed")
    with pytest.raises(PluginError, match="answer_tag is read only with answer_format=tag"):
        make_plugin("reasoning_gym", answer_format="number", answer_tag="final")


def test_partial_credit_and_a_scorer_that_raises_on_the_answer():
    prompt = rows("reasoning_gym:prime_factorization:1")[0]
    reward = make_plugin("reasoning_gym")
    right = prompt.metadata["answer"]
    # prime_factorization's scorer calls int() on each factor: unparsable text scores 0, not a crash.
    assert reward.reward(prompt=prompt, samples=samples(prompt, f"<answer>{right}</answer>", "<answer>garbage ][</answer>")) == [1.0, 0.0]


def test_entries_read_back_from_a_jsonl_file_score_the_same(tmp_path):
    generated = rows("reasoning_gym:basic_arithmetic:3", seed=7)
    path = tmp_path / "rg.jsonl"
    path.write_text("".join(json.dumps(p.metadata) + "\n" for p in generated))
    reward = make_plugin("reasoning_gym")
    for prompt in load_prompts(path):
        assert reward.reward(prompt=prompt, samples=samples(prompt, f"<answer>{prompt.answer}</answer>")) == [1.0]


def test_a_row_that_is_not_a_reasoning_gym_entry_is_refused():
    prompt = Prompt(id="p", text="q", answer="1", metadata={"question": "q", "answer": "1"})
    with pytest.raises(ValueError, match="not a reasoning-gym entry"):
        make_plugin("reasoning_gym").reward(prompt=prompt, samples=samples(prompt, "<answer>1</answer>"))
    prompt = Prompt(id="p", text="q", metadata={"metadata": {"source_dataset": "no_such_task"}})
    with pytest.raises(ValueError, match="no task 'no_such_task'"):
        make_plugin("reasoning_gym").reward(prompt=prompt, samples=samples(prompt, "<answer>1</answer>"))


def test_without_the_extra_the_reward_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(PluginError, match=r"pip install 'grpo-core\[reasoning-gym\]'"):
        make_plugin("reasoning_gym")


def test_listed_by_grpo_core_plugins():
    infos = json.loads(grpo_core_in_process("plugins", "--json").stdout)
    info = next(i for i in infos if (i["kind"], i["name"]) == ("reward", "reasoning_gym"))
    assert info["distribution"] == "grpo-core" and [o["name"] for o in info["options"]] == ["answer_tag", "answer_format"]
    assert "score_answer" in info["help"] and "<answer>" in info["help"]


@pytest.mark.slow  # 4-6 s: the quick suite stays under its 5 minutes
def test_a_three_step_run_on_the_embedded_model(tmp_path):
    out = grpo_core_in_process(
        "run", "--dataset", "reasoning_gym:basic_arithmetic", "--reward", "reasoning_gym", "--max-steps", "3",
        "--run-dir", str(tmp_path / "run"), "--no-drop-zero-variance-groups",  # the embedded model solves none: equal rewards
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all("reward/reasoning_gym" in s and s["reward/failed"] == 0 for s in steps)


@pytest.mark.slow
def test_the_documented_command_shows_a_non_zero_reward(tmp_path):
    """docs/multi-turn.md's embedded-model command, run as written (in an empty folder: its run
    lands in runs/<time> there), trains and scores some completion above 0."""
    from tests.test_docs import documented_commands

    (command,) = [c for page, c in documented_commands() if page == "docs/multi-turn.md" and "reasoning_gym" in c and "--max-steps 3" in c]
    out = grpo_core_in_process(*shlex.split(command)[1:], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (run,) = (tmp_path / "runs").iterdir()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert max(s["reward/reasoning_gym"] for s in steps) > 0
    assert all(s["reward/failed"] == 0 for s in steps)


def test_without_the_extra_a_run_is_one_line_and_exit_1(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    out = grpo_core_in_process("run", "--dataset", "reasoning_gym:basic_arithmetic", "--max-steps", "1", "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "error: the dataset reasoning_gym:basic_arithmetic needs the optional extra 'reasoning-gym': pip install 'grpo-core[reasoning-gym]'"
    ]


def test_a_bad_task_name_exits_1_listing_close_names(tmp_path):
    out = grpo_core_in_process(
        "run", "--dataset", "reasoning_gym:basic_arithmatic", "--reward", "reasoning_gym", "--run-dir", str(tmp_path / "r")
    )
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert "no task 'basic_arithmatic'; close names: basic_arithmetic" in out.stderr
