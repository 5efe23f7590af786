from __future__ import annotations

import json
import shutil

import pytest

from grpo_core import PluginError
from grpo_core.config import load
from grpo_core.data import PROMPT_SETTINGS_FILE, resolve_template, write_prompt_settings
from grpo_core.evaluate import eval_config
from grpo_core.measure import pass_at_k
from tests.helpers import TEMPLATE, grpo_core_in_process


@pytest.mark.parametrize(
    ("n", "correct", "k", "expected"),
    [(1, 1, 1, 1.0), (1, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 4, 1.0), (4, 0, 4, 0.0), (5, 2, 2, 1 - 3 / 10)],
)
def test_pass_at_k_is_the_unbiased_estimator(n, correct, k, expected):
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


def test_greedy_sampling_is_a_point_mass(tiny_model_dir):
    from grpo_core import SamplingParams
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    config = RunConfig(model=str(tiny_model_dir))
    sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=LocalBackend().make_trainer(config=config))
    a, b = sampler.sample([[5, 6, 7]], 2, SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert a.tokens == b.tokens and a.logprobs == [0.0] * len(a.tokens)


def test_eval_cli_reports_reward_and_pass_at_k(tiny_model_dir, tiny_dataset, tmp_path):
    args = ["eval", "--model", str(tiny_model_dir), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE,
            "--max-completion-tokens", "3", "--max-rows", "5", "--reward", "format", "--json"]  # fmt: skip
    always = grpo_core_in_process(*args, "--reward-opt", r"pattern=[\s\S]*")
    assert always.returncode == 0, always.stderr
    assert json.loads(always.stdout.strip().splitlines()[-1]) == {
        "prompts": 5.0, "samples_per_prompt": 1.0, "reward/mean": 1.0, "reward/failed": 0.0,
        "data/skipped_bad_rows": 0.0, "data/skipped_long_prompts": 0.0, "pass@1": 1.0,
    }  # fmt: skip
    never = grpo_core_in_process(*args, "--reward-opt", "pattern=(?!)", "-n", "3")
    assert json.loads(never.stdout.strip().splitlines()[-1]) == {
        "prompts": 5.0, "samples_per_prompt": 3.0, "reward/mean": 0.0, "reward/failed": 0.0,
        "data/skipped_bad_rows": 0.0, "data/skipped_long_prompts": 0.0, "pass@1": 0.0, "pass@3": 0.0,
    }  # fmt: skip
    # A rollout that takes an environment and tools is called with them (none selected here).
    multi_turn = grpo_core_in_process(*args, "--reward-opt", r"pattern=[\s\S]*", "--rollout", "multi_turn")
    assert multi_turn.returncode == 0, multi_turn.stderr
    assert json.loads(multi_turn.stdout.strip().splitlines()[-1])["pass@1"] == 1.0
    assert eval_line(always).endswith("max 3 tokens, greedy; prompt settings: flags and defaults (none saved with the model)")
    # The trainer that holds the policy says nothing of training it.
    for training_line in ("optimizer state:", "memory plan:", "gradient checkpointing:", "trainer forward:", "precision:"):
        assert training_line not in always.stderr, always.stderr
    assert ", temperature 1, 3 samples per prompt; " in eval_line(never)
    bad = grpo_core_in_process("eval", "--model", str(tiny_model_dir), "--dataset", str(tmp_path / "none.jsonl"))
    assert bad.returncode != 0 and "dataset file not found" in bad.stderr


def settings_dir(tmp_path, run_values, rollout_opts=()):
    """A folder holding the prompt settings a run with these values would save beside its policy."""
    folder = tmp_path / "policy"
    folder.mkdir(exist_ok=True)
    write_prompt_settings(folder, load(None, run_values, {"rollout": list(rollout_opts)}))
    return folder


def test_eval_without_settings_or_dataset_measures_the_embedded_test_split():
    config, origin = eval_config({}, {})
    assert (config.dataset, resolve_template(config), config.model) == ("default:test", TEMPLATE, "default")
    assert origin == "prompt settings: flags and defaults (none saved with the model)"


def test_eval_uses_the_saved_prompt_settings_unless_flags_say_otherwise(tmp_path):
    folder = settings_dir(
        tmp_path,
        {"prompt_template": r"Q: {prompt}\nA:", "prompt_field": "q", "max_completion_tokens": 7, "stop": ["\n\n"]},
        ["chat_template=false"],
    )
    config, origin = eval_config({"model": str(folder)}, {})
    assert (config.dataset, resolve_template(config), config.prompt_field, config.max_completion_tokens, config.stop) == (
        "default:test", "Q: {prompt}\nA:", "q", 7, ["\n\n"],
    )  # fmt: skip
    assert config.plugin_options == {"rollout": {"single_turn": {"chat_template": "false", "long_prompts": "error"}}}
    assert origin == f"prompt settings from {folder}/{PROMPT_SETTINGS_FILE}"
    flags = {"model": str(folder), "max_completion_tokens": 3, "prompt_template": "{prompt}?", "dataset": "x.jsonl"}
    config, origin = eval_config(flags, {"rollout": ["chat_template=true"]})
    assert (config.dataset, resolve_template(config), config.prompt_field, config.max_completion_tokens) == ("x.jsonl", "{prompt}?", "q", 3)
    assert config.plugin_options["rollout"]["single_turn"]["chat_template"] == "true"
    assert origin.endswith("(flags win: --max-completion-tokens, --prompt-template)")


def test_a_saved_template_with_a_literal_backslash_comes_back_as_saved(tmp_path):
    folder = settings_dir(tmp_path, {"prompt_template": r"a\\nb {prompt}"})
    config, _ = eval_config({"model": str(folder)}, {})
    assert resolve_template(config) == "a\\nb {prompt}"


@pytest.mark.parametrize(
    "template",
    ["a\\nb {prompt}", "Say \"{prompt}\" 'now'\\t\\\\ done", "C:\\new\\table\n{prompt}\t\\", "{prompt}\\"],
)
def test_a_saved_template_with_backslashes_and_quotes_survives_eval_unchanged(tmp_path, template):
    from grpo_core.config import RunConfig

    folder = tmp_path / "policy"
    folder.mkdir()
    write_prompt_settings(folder, RunConfig(prompt_template=template))
    config, _ = eval_config({"model": str(folder)}, {})
    assert config.prompt_template == template and resolve_template(config) == template


def test_saved_rollout_options_keep_their_types_and_flags_win(tmp_path):
    folder = tmp_path / "policy"
    folder.mkdir()
    settings = {"dataset": "default:train", "embedded_task": True, "rollout": "multi_turn"}
    saved = {"max_turns": 3, "template": "plain", "tool_timeout": 2.5, "per_trajectory": False}
    (folder / PROMPT_SETTINGS_FILE).write_text(json.dumps({**settings, "rollout_options": saved}))
    config, _ = eval_config({"model": str(folder)}, {})
    assert config.rollout == "multi_turn" and config.plugin_options == {"rollout": {"multi_turn": saved}}
    config, _ = eval_config({"model": str(folder)}, {"rollout": ["max_turns=5"]})
    assert config.plugin_options == {"rollout": {"multi_turn": {**saved, "max_turns": "5"}}}


def test_bad_saved_settings_are_a_clear_error(tmp_path):
    folder = settings_dir(tmp_path, {})
    path = folder / PROMPT_SETTINGS_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_completion_tokens": 0}))
    with pytest.raises(PluginError, match=f"prompt settings from {folder}/{PROMPT_SETTINGS_FILE}: max_completion_tokens must be positive"):
        eval_config({"model": str(folder)}, {})
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_completion_tokens": "many"}))
    with pytest.raises(PluginError, match="expected an integer, got 'many'"):
        eval_config({"model": str(folder)}, {})


def test_a_policy_trained_on_other_data_needs_a_dataset(tmp_path):
    folder = settings_dir(tmp_path, {"dataset": "/data/gsm8k/train.jsonl"})
    with pytest.raises(PluginError, match=r"was trained on /data/gsm8k/train.jsonl; pass --dataset"):
        eval_config({"model": str(folder)}, {})
    config, _ = eval_config({"model": str(folder), "dataset": "test.jsonl"}, {})
    assert (config.dataset, resolve_template(config)) == ("test.jsonl", "{prompt}")


def test_rollout_options_are_saved_for_the_rollout_they_belong_to(tmp_path):
    folder = settings_dir(tmp_path, {}, ["chat_template=false"])
    config, _ = eval_config({"model": str(folder), "rollout": "other"}, {})
    assert config.rollout == "other" and "rollout" not in config.plugin_options


def eval_line(out):
    return next(line for line in out.stderr.splitlines() if line.startswith("eval: "))


def test_eval_cli_says_what_it_evaluates_with_the_saved_settings(tiny_model_dir, tiny_dataset, tmp_path):
    policy = tmp_path / "policy"
    shutil.copytree(tiny_model_dir, policy)
    write_prompt_settings(policy, load(None, {"dataset": str(tiny_dataset), "prompt_template": TEMPLATE, "max_completion_tokens": 5}, {}))
    out = grpo_core_in_process(
        "eval", "--model", str(policy), "--dataset", str(tiny_dataset), "--max-rows", "4", "--reward", "format", "--json"
    )
    assert out.returncode == 0, out.stderr
    assert eval_line(out) == (
        f"eval: {policy} on {tiny_dataset} (4 prompts), template 'Question: {{prompt}}\\nAnswer:', "
        f"no chat template (the tokenizer has none), max 5 tokens, greedy; prompt settings from {policy}/{PROMPT_SETTINGS_FILE}"
    )
    assert json.loads(out.stdout.strip().splitlines()[-1])["prompts"] == 4.0
    # A template typed in a shell: backslash-n is a line break, as in the README.
    typed = grpo_core_in_process("eval", "--model", str(policy), "--dataset", str(tiny_dataset), "--max-rows", "1", "--reward", "format",
                      "--prompt-template", r"Q: {prompt}\nA:")  # fmt: skip
    assert typed.returncode == 0, typed.stderr
    assert "template 'Q: {prompt}\\nA:'" in eval_line(typed) and eval_line(typed).endswith("(flags win: --prompt-template)")
    missing = grpo_core_in_process("eval", "--model", str(policy))
    assert missing.returncode == 1 and f"error: {policy} was trained on {tiny_dataset}; pass --dataset" in missing.stderr


def test_eval_cli_reports_bad_rows_clearly_or_counts_them(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(
        b'{"question": "what is 1 plus 2?"}\n{"question": "\xff"}\n{"question": " "}\n{"question": "' + b"zq!~" * 100 + b'"}\n'
    )
    args = ["eval", "--model", str(tiny_model_dir), "--dataset", str(data), "--reward", "format", "--max-completion-tokens", "4", "--json"]
    bad = grpo_core_in_process(*args)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == f"error: {data}:2: not valid UTF-8 (byte 0xff at column 15)"
    debug = grpo_core_in_process(*args, "--debug")
    assert (
        debug.returncode == 1 and "Traceback" in debug.stderr and debug.stderr.strip().endswith("not valid UTF-8 (byte 0xff at column 15)")
    )
    skipped = grpo_core_in_process(*args, "--skip-bad-rows")
    assert skipped.returncode == 1
    assert (
        skipped.stderr.strip().splitlines()[-1].startswith(f"error: {data}:4: ")
        and "+ 4 completion tokens > 256, the model's context" in skipped.stderr
    )
    assert f"skipped 2 bad rows of {data} (--skip-bad-rows); first: {data}:2: not valid UTF-8" in skipped.stderr
    counted = grpo_core_in_process(*args, "--skip-bad-rows", "--rollout-opt", "long_prompts=skip")
    assert counted.returncode == 0, counted.stderr
    result = json.loads(counted.stdout.strip().splitlines()[-1])
    assert (result["prompts"], result["data/skipped_bad_rows"], result["data/skipped_long_prompts"]) == (1.0, 2.0, 1.0)


def test_eval_refuses_rows_without_the_answer_gsm8k_needs(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "what is 1 plus 2?", "answer": "#### 3"}\n{"question": "what is 2 plus 2?"}\n')
    args = ["eval", "--model", str(tiny_model_dir), "--dataset", str(data), "--reward", "gsm8k", "--max-completion-tokens", "2", "--json"]
    bad = grpo_core_in_process(*args)
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        f"error: {data}:2: the answer field 'answer' is missing (fields: question); the gsm8k reward needs it (set --answer-field)"
    )
    counted = grpo_core_in_process(*args, "--skip-bad-rows")
    assert counted.returncode == 0, counted.stderr
    assert json.loads(counted.stdout.strip().splitlines()[-1])["data/skipped_bad_rows"] == 1.0
    # A reward that reads no answer does not need one.
    assert grpo_core_in_process(*args[:5], "--reward", "format", "--max-completion-tokens", "2").returncode == 0


@pytest.mark.slow
def test_a_trained_default_policy_is_evaluated_as_it_was_trained(tmp_path):
    run_dir = tmp_path / "run"
    run = grpo_core_in_process("run", "--max-steps", "3", "--run-dir", str(run_dir), "--threads", "1")
    assert run.returncode == 0, run.stderr
    final = run_dir / "final"
    settings = json.loads((final / PROMPT_SETTINGS_FILE).read_text())
    assert (settings["dataset"], settings["prompt_template"], settings["embedded_task"]) == ("default:train", TEMPLATE, True)
    out = grpo_core_in_process("eval", "--model", str(final), "--max-rows", "20", "--threads", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert eval_line(out) == (
        f"eval: {final} on default:test (20 prompts), template 'Question: {{prompt}}\\nAnswer:', "
        f"no chat template (the tokenizer has none), max 32 tokens, greedy; prompt settings from {final}/{PROMPT_SETTINGS_FILE}"
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 20.0 and result["reward/failed"] == 0.0
