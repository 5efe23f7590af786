"""The ``reasoning_gym:TASKS[:N][:SPLIT]`` dataset source: generated offline, seeded, checked."""

from __future__ import annotations

from collections import Counter

import pytest

from grpo_core.config import RunConfig
from grpo_core.data import REASONING_GYM_TEMPLATE, dataset_source, load_dataset, load_prompts
from grpo_core.errors import DataError

reasoning_gym = pytest.importorskip("reasoning_gym")


def questions(dataset: str, seed: int = 0) -> list[str]:
    return [p.metadata["question"] for p in load_prompts(dataset_source(dataset, seed))]


def test_rows_are_the_tasks_entries_n_of_them_1000_by_default():
    prompts = load_prompts(dataset_source("reasoning_gym:basic_arithmetic:7", 3))
    assert len(prompts) == 7
    assert [p.id for p in prompts[:2]] == ["reasoning_gym:basic_arithmetic:7[0]", "reasoning_gym:basic_arithmetic:7[1]"]
    entry = prompts[0].metadata
    assert set(entry) == {"question", "answer", "metadata"} and entry["metadata"]["source_dataset"] == "basic_arithmetic"
    assert (prompts[0].text, prompts[0].answer) == (entry["question"], entry["answer"])
    assert len(load_prompts(dataset_source("reasoning_gym:basic_arithmetic"))) == 1000


def test_same_seed_same_rows_other_seed_or_split_other_rows():
    train = questions("reasoning_gym:basic_arithmetic:20", seed=1)
    assert train == questions("reasoning_gym:basic_arithmetic:20:train", seed=1)
    assert train != questions("reasoning_gym:basic_arithmetic:20", seed=2)
    test = questions("reasoning_gym:basic_arithmetic:20:test", seed=1)
    assert test != train and test == questions("reasoning_gym:basic_arithmetic:20:test", seed=1)
    # The row count does not change which rows come first.
    assert questions("reasoning_gym:basic_arithmetic:5", seed=1) == train[:5]


def test_load_dataset_uses_the_runs_seed_and_asks_for_answer_tags():
    config = RunConfig(dataset="reasoning_gym:basic_arithmetic:4", seed=5)
    dataset = load_dataset(config)
    assert [p.metadata["question"] for p in dataset.prompts] == questions("reasoning_gym:basic_arithmetic:4", seed=5)
    assert dataset.template == REASONING_GYM_TEMPLATE and dataset.prompts[0].text.endswith("inside <answer></answer> tags.")
    own = load_dataset(RunConfig(dataset="reasoning_gym:basic_arithmetic:4", seed=5, prompt_template="Q: {prompt}"))
    assert own.prompts[0].text == "Q: " + dataset.prompts[0].metadata["question"]
    assert len(load_dataset(RunConfig(dataset="reasoning_gym:basic_arithmetic:10", max_rows=3)).prompts) == 3


def test_weighted_tasks_are_drawn_in_proportion():
    prompts = load_prompts(dataset_source("reasoning_gym:basic_arithmetic=3,chain_sum=1:400"))
    drawn = Counter(p.metadata["metadata"]["source_dataset"] for p in prompts)
    assert set(drawn) == {"basic_arithmetic", "chain_sum"} and 0.65 < drawn["basic_arithmetic"] / 400 < 0.85
    unweighted = Counter(
        p.metadata["metadata"]["source_dataset"] for p in load_prompts(dataset_source("reasoning_gym:basic_arithmetic,chain_sum:400"))
    )
    assert 0.4 < unweighted["basic_arithmetic"] / 400 < 0.6
    # One task with a weight is that task alone.
    assert questions("reasoning_gym:basic_arithmetic=2:5") == questions("reasoning_gym:basic_arithmetic:5")


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ("reasoning_gym:basic_arithmatic", "no task 'basic_arithmatic'; close names: basic_arithmetic, "),
        ("reasoning_gym:qqqqqqqq", "no task 'qqqqqqqq'; 105 tasks, e.g. "),
        ("reasoning_gym:composite", "no task 'composite'; "),
        ("reasoning_gym:basic_arithmetic=2,chain_sums=1", "no task 'chain_sums'; close names: chain_sum"),
        ("reasoning_gym:basic_arithmetic:0", "N a positive row count"),
        ("reasoning_gym:basic_arithmetic:ten", "N a positive row count"),
        ("reasoning_gym:basic_arithmetic:5:valid", "N a positive row count, SPLIT train or test"),
        ("reasoning_gym:basic_arithmetic:5:6:test", "expected reasoning_gym:TASK[:N][:SPLIT]"),
        ("reasoning_gym:basic_arithmetic=0", "'basic_arithmetic=0' is not TASK or TASK=WEIGHT"),
        ("reasoning_gym:basic_arithmetic=x", "'basic_arithmetic=x' is not TASK or TASK=WEIGHT"),
        ("reasoning_gym:basic_arithmetic=inf", "'basic_arithmetic=inf' is not TASK or TASK=WEIGHT"),
        (
            "reasoning_gym:basic_arithmetic,basic_arithmetic",
            "'basic_arithmetic' is not TASK or TASK=WEIGHT (a positive number, each task once)",
        ),
        ("reasoning_gym:", "'' is not TASK or TASK=WEIGHT"),
    ],
)
def test_bad_names_are_one_clear_error(dataset, message):
    with pytest.raises(DataError) as raised:
        load_prompts(dataset_source(dataset))
    assert str(raised.value).startswith(f"{dataset}: ") and message in str(raised.value)
