"""examples/python-api: the notebook-style example trains, and its plugins act."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import REPO


def load_example():
    spec = importlib.util.spec_from_file_location("train_in_python", REPO / "examples" / "python-api" / "train_in_python.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_with_its_rows_reward_and_filter(tmp_path):
    example = load_example()
    summary = example.main(max_steps=2, run_dir=str(tmp_path / "run"))
    assert summary["steps"] == 2
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["reward"] == {"last_number_reward": 1.0} and config["group_filter"] == ["keep_unsolved"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all("groups/dropped_keep_unsolved" in m for m in metrics)
    rows = (tmp_path / "rows").iterdir()
    assert sum(1 for line in next(rows).open()) == 4 * 10 * 9


def test_the_example_reward_scores_the_last_number():
    example = load_example()
    from grpo_core import Prompt, Sample

    prompt = Prompt(id="p", text="2 + 3 =", answer="5")
    samples = [Sample(prompt=prompt, tokens=[1], sampling_logprobs=[0.0], loss_mask=[1.0], text=t, finish_reason="stop", policy_version=0)
               for t in (" 5", " 4 or 5", " 5 or 4", " five")]  # fmt: skip
    assert example.LastNumberReward(partial=0.2).reward(prompt=prompt, samples=samples) == [1.0, 1.0, 0.2, 0.0]
