"""End-to-end: the ``grpo-core`` command, in this process or (signals) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import (
    SIGNAL,
    captured_run_config,
    grpo_core_in_process,
    help_sections,
    make_plugin_package,
    safetensors_of,
    signal_after_two_steps,
    small_run_args,
)


def test_version_and_fast_help():
    out = grpo_core_in_process("--version")
    assert out.returncode == 0 and "grpo-core, version 0.1.0" in out.stdout
    help_out = grpo_core_in_process("run", "--help")
    assert help_out.returncode == 0 and "--loss-opt" in help_out.stdout and "--prompt-groups-per-step" in help_out.stdout
    # --help must not import the heavy stack.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from grpo_core.cli import main\ntry: main(['run', '--help'])\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip().endswith("False False")


def test_small_run_writes_config_metrics_and_a_loadable_policy(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--loss-opt", "kl_beta=0.01"))
    assert out.returncode == 0, out.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert config["max_steps"] == 2 and config["plugin_options"]["loss"]["grpo"]["kl_beta"] == 0.01
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        for key in (
            "reward/total",
            "reward/std",
            "groups/kept",
            "tokens/completion",
            "time/sample",
            "time/train",
            "time/step",
        ):
            assert key in m, key
        assert m["tokens/completion"] > 0 and m["groups/kept"] == 2
    # Two steps: the summary compares step 1 with step 2, not two windows that overlap.
    assert f"reward: first step {lines[0]['reward/total']:.3f} -> last step {lines[1]['reward/total']:.3f}" in out.stdout
    assert "run directory" in out.stdout
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "final").config.model_type == "qwen3"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--loss", "cispoo"], "unknown loss 'cispoo'; did you mean 'cispo'?"),
        (["--loss-opt", "eps_low=abc"], "option 'eps_low' of loss.grpo: expected a number, got 'abc'"),
        (["--loss-opt", "eps_lo=0.1"], "unknown option 'eps_lo' for loss.grpo"),
        (["--max-steps", "zero"], "'zero' is not a valid integer"),
        # --trainer and --trainer-opt are the same flags as --backend and --backend-opt
        (["--trainer", "locall"], "unknown backend 'locall'; did you mean 'local'?"),
        (["--trainer-opt", "fast_forwardd=true"], "unknown option 'fast_forwardd' for backend.local"),
    ],
)
def test_bad_plugin_input_is_one_clear_line(tiny_model_dir, tiny_dataset, tmp_path, extra, message):
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / "r", *extra))
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (None, "dataset file not found"),
        (['{"question": "a", "answer": "1"}', '{"question": '], "data.jsonl:2: malformed JSON"),
        (['{"question": "a", "answer": "1"}', '{"prompt": "b"}'], "data.jsonl:2: missing field 'question'"),
    ],
)
def test_bad_dataset_is_one_clear_line(tiny_model_dir, tmp_path, lines, message):
    dataset = tmp_path / "data.jsonl"
    if lines is not None:
        dataset.write_text("\n".join(lines) + "\n")
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, dataset, tmp_path / "r"))
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_plugins_lists_builtins_with_options_and_json():
    out = grpo_core_in_process("plugins")
    assert out.returncode == 0
    assert "loss grpo  (grpo-core 0.1.0)  hooks: loss" in out.stdout
    assert "eps_low=0.2" in out.stdout
    infos = json.loads(grpo_core_in_process("plugins", "--json").stdout)
    grpo = next(i for i in infos if (i["kind"], i["name"]) == ("loss", "grpo"))
    assert grpo["distribution"] == "grpo-core" and grpo["hooks"] == ["loss"]
    options = {o["name"]: o for o in grpo["options"]}
    assert set(options) == {"eps_low", "eps_high", "ratio_log_cap", "kl_beta", "kl_estimator", "agg"}
    assert options["kl_beta"]["type"] == "float" and options["kl_beta"]["default"] == 0.001
    assert "KL penalty" in options["kl_beta"]["help"]
    assert options["kl_estimator"]["type"] == "Literal['k1', 'k2', 'k3']" and options["kl_estimator"]["default"] == "k3"


@pytest.mark.slow
def test_a_separately_installed_plugin_is_listed_and_selectable_and_a_broken_one_is_reported(tiny_model_dir, tiny_dataset, tmp_path):
    good = make_plugin_package(
        tmp_path,
        "grpo-reward-length",
        '''
        import attrs
        from grpo_core import hookimpl, option

        @attrs.define
        class LengthReward:
            """Reward = completion length in characters times scale."""
            scale: float = option(1.0, help="multiplier")

            @hookimpl
            def reward(self, prompt, samples):
                return [self.scale * len(s.text) for s in samples]
        ''',
        {"reward.length": "grpo_reward_length:LengthReward"},
    )
    broken = make_plugin_package(tmp_path, "grpo-broken", "import no_such_module_xyz\n", {"loss.broken": "grpo_broken:Broken"})
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(good), str(broken)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {"PYTHONPATH": str(target)}
    listing = grpo_core_in_process("plugins", env=env)
    assert listing.returncode == 0, listing.stderr
    assert "reward length  (grpo-reward-length 1.2.3)  hooks: reward" in listing.stdout
    assert "loss broken  (grpo-broken 1.2.3)  BROKEN" in listing.stdout
    assert "No module named 'no_such_module_xyz'" in listing.stdout
    assert "loss grpo  (grpo-core 0.1.0)" in listing.stdout

    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", "length", "--reward-opt", "scale=0.5"), env=env
    )
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reward/total"] > 0 for m in metrics)

    failed = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / "r2", "--loss", "broken"), env=env)
    assert failed.returncode != 0
    assert "loss plugin 'broken' from grpo-broken 1.2.3 failed to import" in failed.stderr


LOSSES = ["grpo", "importance_sampling", "reinforce", "dapo", "dro", "gspo", "cispo"]


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains_end_to_end(tiny_model_dir, tiny_dataset, tmp_path, loss):
    run_dir = tmp_path / "run"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--loss", loss, "--loss", "tis", "--loss-opt", "tis.cap=1.5")
    args += ["--no-drop-zero-variance-groups", "--reward", "gsm8k:1", "--reward-opt", "gsm8k.format_penalty=0.5"]
    out = grpo_core_in_process(*args)
    assert out.returncode == 0, out.stderr
    config = json.loads((run_dir / "config.json").read_text())
    # config.json may store the option as typed (1.5) or as given on the command line ("1.5").
    assert config["loss"] == [loss, "tis"] and {k: float(v) for k, v in config["plugin_options"]["loss"]["tis"].items()} == {"cap": 1.5}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("loss/total" in m and "tis/weight_mean" in m for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_ends_the_run_with_a_checkpoint_the_policy_and_its_exit_code(tiny_model_dir, tiny_dataset, tmp_path, signum, code):
    run_dir = tmp_path / "run"
    steps = signal_after_two_steps(small_run_args(tiny_model_dir, tiny_dataset, run_dir), run_dir, signum, code)
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert json.loads((run_dir / "checkpoints" / f"step-{steps:06d}" / "state.json").read_text())["step"] == steps


# --- LoRA and `grpo-core export` --------------------------------------------------------------

LORA_LEARNING_RATE = "1e-3"
"""For rank 8 on the embedded task; measured: 2e-3 gained less (+0.18), 5e-3 collapsed the reward to 0, rank 32 at 2e-3 gained +0.19."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    # The async loop resumes exactly when it trains on-policy (docs/async.md); its sampler keeps a copy.
    [(), ("--weight-sync-interval", "2"), ("--loop", "async", "--synchronous-training")],
    ids=["shared_weights", "sampler_copy", "async"],
)
def test_lora_run_checkpoints_adapters_only_and_resumes_exactly(tiny_model_dir, tiny_dataset, tmp_path, extra):
    import torch

    args = ("--lora-rank", "4", "--max-steps", "4", "--checkpoint-every", "2", "--loss-opt", "kl_beta=0.05", *SIGNAL, *extra)
    whole = tmp_path / "whole"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, whole, *args))
    assert out.returncode == 0, out.stderr
    from grpo_core.engine.trainer import read_trainer_state

    state = read_trainer_state(whole / "checkpoints" / "step-000004" / "trainer")
    assert set(state) == {"adapter", "optimizer", "version"} and all("lora_" in k for k in state["adapter"])
    metrics = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    # The reference is the base model (the adapters off): the KL grows from 0 as the adapters train.
    assert metrics[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6) and metrics[-1]["kl/mean"] > 1e-6

    stopped = tmp_path / "stopped"
    first = small_run_args(tiny_model_dir, tiny_dataset, stopped, *args)
    first[first.index("--max-steps", first.index("--lora-rank")) + 1] = "2"
    assert grpo_core_in_process(*first).returncode == 0
    out = grpo_core_in_process("run", "--resume", str(stopped), "--max-steps", "4")
    assert out.returncode == 0, out.stderr
    want, got = safetensors_of(whole / "final"), safetensors_of(stopped / "final")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    resumed = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/total"] for m in resumed] == [m["reward/total"] for m in metrics]


def test_export_writes_a_plain_folder_from_final_or_a_step_and_explains_errors(tiny_model_dir, tiny_dataset, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    assert (
        grpo_core_in_process(
            *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--lora-rank", "4", "--checkpoint-every", "1", *SIGNAL)
        ).returncode
        == 0
    )
    out = grpo_core_in_process("export", str(run_dir), str(tmp_path / "final"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"exported {run_dir / 'final'} to {tmp_path / 'final'}"
    out = grpo_core_in_process("export", str(run_dir), "--step", "1", str(tmp_path / "one"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"exported {run_dir / 'checkpoints' / 'step-000001'} to {tmp_path / 'one'}"
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        final, one = (AutoModelForCausalLM.from_pretrained(tmp_path / name)(ids).logits for name in ("final", "one"))
    assert not torch.allclose(final, one, atol=1e-3)
    assert (tmp_path / "one" / "tokenizer.json").is_file() and (tmp_path / "one" / "grpo_core_prompt.json").is_file()

    # The exported policy is prompted as it was trained.
    out = grpo_core_in_process(
        "eval", "--model", str(tmp_path / "one"), "--dataset", str(tiny_dataset), "--max-rows", "2", "--reward", "format"
    )
    assert out.returncode == 0, out.stderr
    assert f"prompt settings from {tmp_path / 'one'}/grpo_core_prompt.json" in out.stderr + out.stdout

    for args, message in [
        (
            (str(run_dir), str(tmp_path / "final")),
            f"error: {tmp_path / 'final'} already exists and is not an empty folder; choose another OUT_DIR",
        ),
        ((str(run_dir), "--step", "9", str(tmp_path / "x")), f"error: {run_dir} has no checkpoint of step 9 (checkpoints of steps 1, 2)"),
        (
            (str(tmp_path / "nothing"), str(tmp_path / "x")),
            f"error: {tmp_path / 'nothing'}: not a grpo-core run directory (no config.json there)",
        ),
    ]:
        out = grpo_core_in_process("export", *args)
        assert out.returncode == 1 and out.stderr.strip() == message, out.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_lora_run_on_the_embedded_task_learns(tmp_path):
    out = grpo_core_in_process("run", "--lora-rank", "8", "--learning-rate", LORA_LEARNING_RATE, "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"LoRA run: first 10 steps {summary['reward_first']:.3f}, last 10 steps {summary['reward_last']:.3f}")
    # Measured +0.26 (0.31 -> 0.57); full fine-tuning's default run gained +0.40 (0.29 -> 0.70) on the same machine.
    assert summary["steps"] == 100 and summary["reward_last"] - summary["reward_first"] >= 0.15

    checkpoint = max((tmp_path / "run" / "checkpoints").iterdir())
    from grpo_core.engine.trainer import read_trainer_state

    assert set(read_trainer_state(checkpoint / "trainer")) == {"adapter", "optimizer", "version"}


def test_run_help_lists_every_option_in_its_section_in_order():
    from grpo_core.config import PLUGINS, SECTIONS, SFT, cli_fields

    text, flags = help_sections("run")
    assert list(flags) == [*(s for s in SECTIONS if s != SFT), "Other"] and flags["Other"] == ["-h"]
    for field in cli_fields():
        assert f"--{field.name.replace('_', '-')}" in flags[field.metadata["section"]], field.name
    assert flags[PLUGINS][-2:] == ["--loss-opt", "--logger-opt"] and "  --reward NAME[:WEIGHT] " in text
    assert flags["Run directory, checkpoints, resume"][-3:] == ["--config", "--resume", "--overwrite"]
    assert flags["Machine"][-1] == "--debug"


def test_reward_weights_from_flags_and_from_a_toml_table_reach_the_run_as_the_same_value(monkeypatch, tmp_path):
    code, _, from_flags = captured_run_config(monkeypatch, "--reward", "gsm8k", "--reward", "format:0.1")
    assert code == 0 and from_flags.reward == {"gsm8k": 1.0, "format": 0.1}
    path = tmp_path / "run.toml"
    path.write_text("[reward.gsm8k]\n[reward.format]\nweight = 0.1\n")
    code, _, from_toml = captured_run_config(monkeypatch, "--config", str(path))
    assert code == 0 and from_toml.reward == from_flags.reward
    code, output, _ = captured_run_config(monkeypatch, "--reward", "format:x")
    assert code == 1 and "error: reward 'format:x': weight 'x' is not a number (use NAME[:WEIGHT])" in output
    code, output, _ = captured_run_config(monkeypatch, "--reward", "gsm8k", "--reward", "gsm8k:2")
    assert code == 1 and "error: reward 'gsm8k' is selected twice" in output


def test_a_template_typed_on_the_command_line_has_its_escapes_read_once(monkeypatch):
    code, _, config = captured_run_config(monkeypatch, "--prompt-template", r'Q: {prompt}\n"A\\n":')
    assert code == 0 and config.prompt_template == 'Q: {prompt}\n"A\\n":'


@pytest.mark.parametrize(
    ("extra", "message", "vllm"),
    [
        (["--sampler-opt", "decode=graphs"], "decode=graphs captures the decode step in a CUDA graph, and the model is on cpu", True),
        (["--sampler", "vllm"], "--sampler vllm needs vLLM in this environment", False),
        # vLLM's process group would wait forever for fsdp's other ranks: refused in one line, vLLM there or not.
        (
            ["--sampler", "vllm", "--backend", "fsdp", "--backend-opt", "nproc=2"],
            "error: --sampler vllm runs a vLLM engine in the trainer's process, and the FSDPBackend trains in several processes",
            False,
        ),
    ],
)
def test_a_sampler_setting_the_device_cannot_take_is_refused_before_the_trainer_loads(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, extra, message, vllm
):
    import sys

    from grpo_core.plugins.backends import local

    if not vllm:
        monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(local, "load_model", lambda *a, **k: pytest.fail("the trainer loaded before the refusal"))
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / "r", *extra))
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("model", ["./nomodel", "nomodel/", "{tmp}/nomodel", "../a/b/c"])
@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_missing_model_folder_is_one_line_and_exit_1_in_run_and_eval(tiny_dataset, tmp_path, model, command):
    model = model.format(tmp=tmp_path)
    args = ["--model", model, "--dataset", str(tiny_dataset), "--run-dir", str(tmp_path / "r")]
    out = grpo_core_in_process(command, *(args if command == "run" else args[:4]), cwd=tmp_path)
    assert (out.returncode, out.stderr.strip().splitlines()) == (
        1,
        [f"error: --model {model}: no such folder (a model is a local folder or a hub name such as Qwen/Qwen3-0.6B)"],
    )
    assert not (tmp_path / "r").exists()
