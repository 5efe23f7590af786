"""Mixtures: several datasets in one run (--mix NAME[:WEIGHT]=DATASET), drawn by weight, resumed exactly."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from grpo_core.config import RunConfig
from grpo_core.data import DEFAULT_TASK_TEMPLATE, DataError, load_dataset
from grpo_core.errors import PluginError
from grpo_core.metrics import computed_only
from grpo_core.mixture import MixSource, mixture_batches, parse_mix, shares
from grpo_core.train import run
from grpo_core.types import Prompt
from tests.core.tiny_runs import config, length_reward, metrics_of, weights_of  # noqa: F401 - length_reward: the 'length' reward
from tests.helpers import captured_run_config, grpo_core_in_process


def rows(tmp_path, name, n, word="plus"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"question": f"what is {i} {word} 1?", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


def test_specs_give_names_weights_and_datasets_that_may_hold_colons_and_equals():
    assert parse_mix(["math:3=data/m.jsonl", "code=https://h/c.jsonl?v=2", "saved:0.5=folder:test"]) == [
        MixSource("math", 3.0, "data/m.jsonl"),
        MixSource("code", 1.0, "https://h/c.jsonl?v=2"),
        MixSource("saved", 0.5, "folder:test"),
    ]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["math.jsonl"], r"--mix 'math.jsonl': expected NAME\[:WEIGHT\]=DATASET"),
        (["math="], "expected NAME"),
        (["=math.jsonl"], "expected NAME"),
        (["ma th=m.jsonl"], "expected NAME"),
        (["m/x=m.jsonl"], "expected NAME"),
        (["m:0=m.jsonl"], r"--mix 'm:0=m.jsonl': the weight '0' is not a positive number"),
        (["m:-1=m.jsonl"], "the weight '-1' is not a positive number"),
        (["m:inf=m.jsonl"], "the weight 'inf'"),
        (["m:nan=m.jsonl"], "the weight 'nan'"),
        (["m:three=m.jsonl"], "the weight 'three'"),
        (["m=a.jsonl", "m:2=b.jsonl"], "the source name 'm' is given twice"),
    ],
)
def test_bad_specs_are_refused(specs, message):
    with pytest.raises(PluginError, match=message):
        parse_mix(specs)


def prompts_of(counts):
    return [Prompt(id=f"{name}/{i}", text=str(i), source=name) for name, n in counts.items() for i in range(n)]


def test_three_to_one_gives_shares_within_5_percent_over_400_prompts_at_every_seed():
    prompts = prompts_of({"a": 150, "b": 250})
    for seed in range(5):
        drawn = [p.source for batch in mixture_batches(prompts, {"a": 3.0, "b": 1.0}, 8, 1, seed, True) for p in batch]
        assert len(drawn) == 400
        assert abs(Counter(drawn)["a"] / 400 - 0.75) <= 0.05
        # Every prefix holds each share to within one prompt.
        for n in range(1, 401):
            assert abs(drawn[:n].count("a") - 0.75 * n) <= 1


def test_a_small_source_is_reshuffled_when_used_up_and_each_pass_covers_it():
    prompts = prompts_of({"a": 4, "b": 40})
    drawn = [p.id for batch in mixture_batches(prompts, {"a": 1.0, "b": 1.0}, 4, 1, 3, True) for p in batch]
    a_ids = [i for i in drawn if i.startswith("a/")]
    assert len(drawn) == 44 and len(a_ids) == 22
    passes = [a_ids[i : i + 4] for i in range(0, 20, 4)]
    assert all(sorted(p) == ["a/0", "a/1", "a/2", "a/3"] for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # reshuffled between passes


def test_the_order_comes_from_the_seed_and_no_shuffle_keeps_each_files_order():
    prompts = prompts_of({"a": 10, "b": 10})
    order = lambda seed, shuffle=True: [p.id for b in mixture_batches(prompts, {"a": 2.0, "b": 1.0}, 3, 2, seed, shuffle) for p in b]  # noqa: E731
    assert order(1) == order(1) and order(1) != order(2)
    assert len(order(1)) == (20 // 3) * 3 * 2
    plain = order(1, shuffle=False)
    assert [i for i in plain if i.startswith("b/")][:5] == ["b/0", "b/1", "b/2", "b/3", "b/4"]
    assert plain == order(2, shuffle=False)


def test_shares_are_each_sources_part_of_the_steps_prompts_and_0_without_any():
    assert shares(["a", "b", "c"], {"data/a/prompts": 3.0, "data/b/prompts": 1.0}, "prompts") == {
        "data/a/share": 0.75,
        "data/b/share": 0.25,
        "data/c/share": 0.0,
    }
    assert shares(["a"], {}, "prompts") == {"data/a/share": 0.0}


def test_a_mixture_loads_each_source_with_its_name_and_template(tmp_path):
    math_rows, other = rows(tmp_path, "d.jsonl", 3), tmp_path / "other"
    other.mkdir()
    dataset = load_dataset(RunConfig(mix=[f"math:3={math_rows}", f"copy={rows(other, 'd.jsonl', 2, 'minus')}", "task=default:test"]))
    by_source = Counter(p.source for p in dataset.prompts)
    assert by_source["math"] == 3 and by_source["copy"] == 2 and by_source["task"] > 0
    assert dataset.mixture == {"math": 3.0, "copy": 1.0, "task": 1.0}
    # Two files of one name stay apart: ids are prefixed with the source's name.
    assert [p.id for p in dataset.prompts[:4]] == ["math/d.jsonl:1", "math/d.jsonl:2", "math/d.jsonl:3", "copy/d.jsonl:1"]
    assert dataset.where(dataset.prompts[3]) == other / "d.jsonl:1"
    assert dataset.prompts[0].text == "what is 0 plus 1?"
    task = next(p for p in dataset.prompts if p.source == "task")
    assert task.text.startswith(DEFAULT_TASK_TEMPLATE.split("{prompt}")[0])  # the embedded task keeps its template
    assert dataset.name == f"math:3={math_rows} copy={other / 'd.jsonl'} task=default:test"


def test_max_rows_counts_in_each_source(tmp_path):
    dataset = load_dataset(RunConfig(mix=[f"a={rows(tmp_path, 'a.jsonl', 5)}", f"b={rows(tmp_path, 'b.jsonl', 5)}"], max_rows=2))
    assert [p.id for p in dataset.prompts] == ["a/a.jsonl:1", "a/a.jsonl:2", "b/b.jsonl:1", "b/b.jsonl:2"]


def test_a_mixture_beside_dataset_and_of_both_prompt_forms_is_refused(tmp_path):
    text = rows(tmp_path, "t.jsonl", 2)
    with pytest.raises(DataError, match="--dataset .* and --mix both name the prompts"):
        load_dataset(RunConfig(dataset=str(text), mix=[f"a={text}"]))
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"question": [1, 2]}\n')
    with pytest.raises(DataError, match="--mix: the source ids's prompts are token ids, text's are text"):
        load_dataset(RunConfig(mix=[f"text={text}", f"ids={ids}"]))


def test_the_cli_repeats_mix_and_toml_lists_it(monkeypatch, tmp_path):
    code, output, config_ = captured_run_config(monkeypatch, "--mix", "a:3=x.jsonl", "--mix", "b=y.jsonl")
    assert code == 0, output
    assert config_.mix == ["a:3=x.jsonl", "b=y.jsonl"]
    toml = tmp_path / "run.toml"
    toml.write_text('mix = ["a:3=x.jsonl", "b=https://h/y.jsonl"]\neval_mix = ["held=z.jsonl"]\n')
    code, output, config_ = captured_run_config(monkeypatch, "--config", str(toml))
    assert code == 0, output
    assert config_.mix == ["a:3=x.jsonl", "b=https://h/y.jsonl"] and config_.eval_mix == ["held=z.jsonl"]


def mixed_run(tiny_model_dir, tmp_path, run_dir, **kw):
    math_rows, other = rows(tmp_path, "m.jsonl", 12), rows(tmp_path, "o.jsonl", 12, "minus")
    return config(tiny_model_dir, "default", run_dir, mix=[f"math:3={math_rows}", f"other={other}"], **kw)


@pytest.mark.slow
def test_a_run_reports_each_sources_share_and_reward_and_resumes_bitwise(tiny_model_dir, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(mixed_run(tiny_model_dir, tmp_path, whole, max_steps=4))
    lines = metrics_of(whole)
    assert [m["data/math/share"] for m in lines] == [1.0, 0.5, 1.0, 0.5]  # 2 prompts a step: m m | o m | m m | o m
    assert [m["data/other/share"] for m in lines] == [0.0, 0.5, 0.0, 0.5]
    assert all(m["data/math/prompts"] + m.get("data/other/prompts", 0) == 2 for m in lines)
    # Each source's mean reward, weighted by its samples, makes up the step's.
    first = lines[1]
    assert math.isclose((first["data/math/reward"] + first["data/other/reward"]) / 2, first["reward/total"], rel_tol=1e-6)
    run(mixed_run(tiny_model_dir, tmp_path, resumed, max_steps=2, checkpoint_every=1))
    run(mixed_run(tiny_model_dir, tmp_path, resumed, max_steps=4, checkpoint_every=1), resume=True)
    assert [computed_only(m) for m in metrics_of(resumed)] == [computed_only(m) for m in lines]
    a, b = weights_of(whole), weights_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_names_its_own_sources_and_measures_each(tiny_model_dir, tmp_path):
    held = [f"plus={rows(tmp_path, 'p.jsonl', 3)}", f"minus={rows(tmp_path, 'q.jsonl', 2, 'minus')}"]
    run(mixed_run(tiny_model_dir, tmp_path, tmp_path / "run", max_steps=1, eval_every=1, eval_mix=held, eval_samples=2))
    evaluated = metrics_of(tmp_path / "run")[0]
    assert evaluated["eval/prompts"] == 5
    for name in ("plus", "minus"):
        assert 0 <= evaluated[f"eval/data/{name}/reward_mean"] and 0 <= evaluated[f"eval/data/{name}/pass@1"] <= 1
    assert math.isclose(
        (3 * evaluated["eval/data/plus/reward_mean"] + 2 * evaluated["eval/data/minus/reward_mean"]) / 5,
        evaluated["eval/reward_mean"],
        rel_tol=1e-6,
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(eval_every=1), r"the run trains on a mixture \(--mix\); pass --eval-dataset with the held-out rows"),
        (dict(eval_every=1, eval_mix=["a:2=x.jsonl"]), "--eval-mix a:2=x.jsonl: a weight does nothing there"),
        (dict(eval_every=1, eval_mix=["a=x.jsonl"], eval_dataset="default:test"), "--eval-dataset and --eval-mix both name"),
        (dict(eval_mix=["a=x.jsonl"]), "--eval-mix would do nothing"),
    ],
)
def test_eval_settings_that_cannot_work_are_refused(tiny_model_dir, tmp_path, kw, message):
    with pytest.raises(PluginError, match=message):
        run(mixed_run(tiny_model_dir, tmp_path, tmp_path / "run", max_steps=1, **kw))


def test_grpo_core_eval_measures_each_source_of_a_mixture(tiny_model_dir, tmp_path):
    plus, minus = rows(tmp_path, "p.jsonl", 3), rows(tmp_path, "q.jsonl", 2, "minus")
    out = grpo_core_in_process(
        "eval", "--model", str(tiny_model_dir), "--mix", f"plus={plus}", "--mix", f"minus={minus}", "--reward", "format",
        "--prompt-template", "Q: {prompt}", "--max-completion-tokens", "4", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["prompts"] == 5
    assert {"data/plus/reward_mean", "data/minus/reward_mean", "data/plus/pass@1", "data/minus/pass@1"} <= set(result)


def test_a_policy_trained_on_a_mixture_names_it_and_is_not_taken_for_the_embedded_task(tmp_path):
    from grpo_core.data import prompt_settings

    settings = prompt_settings(RunConfig(mix=["a:2=x.jsonl", "b=y.jsonl"]))
    assert settings["dataset"] == "a:2=x.jsonl b=y.jsonl" and settings["embedded_task"] is False
    assert prompt_settings(RunConfig())["embedded_task"] is True


def test_a_source_whose_prompts_are_all_too_long_is_refused(tmp_path):
    from grpo_core.data import check_prompt_lengths
    from grpo_core.plugins.rollouts.single_turn import SingleTurnRollout
    from tests.conftest import build_tiny_tokenizer

    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question": "what is 1 plus 2? " * 20}) + "\n")
    dataset = load_dataset(RunConfig(mix=[f"short={rows(tmp_path, 's.jsonl', 2)}", f"long={long}"]))
    rollout = SingleTurnRollout(long_prompts="skip", chat_template=False)
    with pytest.raises(DataError, match="--mix: every prompt of the source long is too long for the model's context of 40 tokens"):
        check_prompt_lengths(dataset, rollout, build_tiny_tokenizer(), 40, 8)
    with pytest.raises(ValueError, match="a mixture's source has no prompts"):
        next(mixture_batches(prompts_of({"a": 2}), {"a": 1.0, "b": 1.0}, 2, 1, 0, True))
