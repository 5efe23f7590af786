"""``grpo-core sft``: examples, the cross-entropy step, and the command on the tiny model."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

from grpo_core.config import SFTConfig
from grpo_core.plugins_manager import make_plugin
from grpo_core.sft import Example, HeldOutLoss, chat_example, encode_examples, sft_step
from grpo_core.types import Prompt
from tests.helpers import TEMPLATE, grpo_core_in_process, help_sections

CHAT_TEMPLATE = (
    "{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}"
)
"""A chat template for the tiny tokenizer: each turn opened by <|pad|> and its role, closed by <|endoftext|>."""


def sft_args(model, dataset, run_dir, *extra):
    """A short sft run of the tiny model that visibly lowers its loss."""
    return [
        "sft", "--model", str(model), "--dataset", str(dataset), "--prompt-template", TEMPLATE,
        "--completion-field", "answer", "--completion-template", " {completion}", "--examples-per-step", "4",
        "--max-steps", "6", "--learning-rate", "1e-2", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_logged(run_dir):
    return len(metrics_of(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0


def tiny_config(model, dataset, **changes):
    return SFTConfig(model=str(model), dataset=str(dataset), prompt_template=TEMPLATE, completion_field="answer", **changes)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def trainer(tiny_model_dir, tiny_dataset):
    torch.manual_seed(0)
    return make_plugin("backend.local").make_trainer(config=tiny_config(tiny_model_dir, tiny_dataset, threads=1))


def examples_of(tokenizer, prompts, config):
    return encode_examples(prompts, make_plugin("rollout.single_turn"), tokenizer, config, None).examples


def rows(n):
    return [
        Prompt(id=f"r:{i}", text=TEMPLATE.replace("{prompt}", f"what is {i} plus 1?"), metadata={"answer": f"{i} + 1 = {i + 1}"})
        for i in range(n)
    ]


def test_a_prompt_row_is_its_prompt_untrained_then_its_target_and_eos(tokenizer, tiny_model_dir, tiny_dataset):
    config = tiny_config(tiny_model_dir, tiny_dataset, completion_template=" {completion}")
    (example,) = examples_of(tokenizer, rows(1), config)
    prompt = tokenizer(TEMPLATE.replace("{prompt}", "what is 0 plus 1?"))["input_ids"]
    target = tokenizer(" 0 + 1 = 1", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example.tokens == prompt + target
    assert example.loss_mask == [0.0] * len(prompt) + [1.0] * len(target)
    datum = example.datum()
    assert datum.loss_fn_inputs["weights"].data == example.loss_mask[1:]
    assert datum.loss_fn_inputs["target_tokens"].data == example.tokens[1:]


def test_a_target_of_token_ids_is_trained_as_it_is(tokenizer, tiny_model_dir, tiny_dataset):
    from grpo_core.errors import DataError

    config = tiny_config(tiny_model_dir, tiny_dataset, completion_template=" {completion}")
    row = attrs.evolve(rows(1)[0], metadata={"answer": [17, 18, 0]})
    (example,) = examples_of(tokenizer, [row], config)
    assert example.tokens[-3:] == [17, 18, 0] and example.target_tokens == 3
    for bad, message in (([17, 9999], "token ids outside the vocabulary"), ([], "empty, or neither"), (5, "neither a string")):
        with pytest.raises(DataError, match=message):
            examples_of(tokenizer, [attrs.evolve(row, metadata={"answer": bad})], config)


def test_the_loss_is_the_mean_cross_entropy_of_target_tokens_only(tokenizer, trainer, tiny_model_dir, tiny_dataset):
    config = tiny_config(tiny_model_dir, tiny_dataset)
    examples = examples_of(tokenizer, rows(3), config)
    with torch.no_grad():
        nll, tokens, everything = 0.0, 0, 0.0
        for e in examples:
            logits = trainer.model(torch.tensor([e.tokens])).logits[0, :-1].float()
            per_token = torch.nn.functional.cross_entropy(logits, torch.tensor(e.tokens[1:]), reduction="none")
            nll += float((per_token * torch.tensor(e.loss_mask[1:])).sum())
            tokens += e.target_tokens
            everything += float(per_token.sum())
    loss = sft_step(trainer, examples, config, 0.0).as_dict()["loss/total"]
    assert loss == pytest.approx(nll / tokens, rel=1e-5)
    # Were prompt tokens trained too, the loss would be this: far from it.
    assert abs(loss - everything / sum(len(e.tokens) - 1 for e in examples)) > 0.01


def target_nll(trainer, example) -> tuple[float, int]:
    """The summed cross-entropy of ``example``'s target tokens under the model, computed directly, and their count."""
    with torch.no_grad():
        logits = trainer.model(torch.tensor([example.tokens])).logits[0, :-1].float()
        per_token = torch.nn.functional.cross_entropy(logits, torch.tensor(example.tokens[1:]), reduction="none")
    return float((per_token * torch.tensor(example.loss_mask[1:])).sum()), example.target_tokens


def test_each_sources_loss_is_its_cross_entropy_per_target_token_across_the_steps_calls(tokenizer, trainer, tiny_model_dir, tiny_dataset):
    # Two calls of the step ([0, 1] and [2, 3, 4]) each hold both sources: their records merge per source.
    config = tiny_config(tiny_model_dir, tiny_dataset, max_samples_per_fwd_bwd=2, min_samples_per_fwd_bwd=2)
    sources = ["a", "b", "a", "a", "b"]
    examples = [attrs.evolve(e, source=s) for e, s in zip(examples_of(tokenizer, rows(5), config), sources)]
    expected = {}
    for name in ("a", "b"):
        nll, tokens = map(sum, zip(*(target_nll(trainer, e) for e in examples if e.source == name)))
        expected[name] = (nll / tokens, tokens)
    metrics = sft_step(trainer, examples, config, 0.0).as_dict()
    assert metrics["data/a/examples"] == 3 and metrics["data/b/examples"] == 2
    for name, (loss, _) in expected.items():
        assert metrics[f"data/{name}/loss"] == pytest.approx(loss, rel=1e-5)
    (loss_a, tokens_a), (loss_b, tokens_b) = expected["a"], expected["b"]
    assert tokens_a + tokens_b == metrics["train/tokens"] and loss_a != pytest.approx(loss_b, rel=1e-3)
    weighted = (tokens_a * metrics["data/a/loss"] + tokens_b * metrics["data/b/loss"]) / (tokens_a + tokens_b)
    assert weighted == pytest.approx(metrics["loss/total"], rel=1e-6)


def test_a_step_outside_a_mixture_records_no_source(tokenizer, trainer, tiny_model_dir, tiny_dataset):
    config = tiny_config(tiny_model_dir, tiny_dataset)
    metrics = sft_step(trainer, examples_of(tokenizer, rows(2), config), config, 0.0).as_dict()
    assert not [name for name in metrics if name.startswith("data/")]


class GradientsAtStep:
    """A trainer that keeps the gradients its optimizer step applies."""

    def __init__(self, trainer):
        self.trainer, self.grads = trainer, {}

    def forward_backward_custom(self, datums, loss_fn):
        return self.trainer.forward_backward_custom(datums, loss_fn)

    def optim_step(self, params):
        self.grads = {name: p.grad.clone() for name, p in self.trainer.model.named_parameters()}
        return self.trainer.optim_step(params)


def test_a_step_split_into_calls_takes_the_step_of_one_call(tokenizer, tiny_model_dir, tiny_dataset):
    """Gradient accumulation: --max-samples-per-fwd-bwd N gives the step the loss and gradient of one call."""
    results = []
    for split in (None, 2):
        torch.manual_seed(0)
        config = tiny_config(tiny_model_dir, tiny_dataset, threads=1, max_samples_per_fwd_bwd=split)
        trainer = make_plugin("backend.local").make_trainer(config=config)
        recording = GradientsAtStep(trainer)
        metrics = sft_step(recording, examples_of(tokenizer, rows(5), config), config, 1e-2).as_dict()
        results.append((metrics["loss/total"], metrics["train/tokens"], recording.grads))
    (loss, tokens, grads), *others = results
    assert tokens > 5 and any(float(g.abs().max()) > 1e-3 for g in grads.values())
    for other_loss, other_tokens, other_grads in others:
        assert other_loss == pytest.approx(loss, rel=1e-6) and other_tokens == tokens
        assert all(torch.allclose(grads[k], other_grads[k], rtol=1e-4, atol=1e-7) for k in grads)


def test_packed_examples_do_not_attend_to_each_other(tokenizer, trainer, tiny_model_dir, tiny_dataset):
    from grpo_core.engine.logprobs import packed_layout

    examples = examples_of(tokenizer, rows(6), tiny_config(tiny_model_dir, tiny_dataset))
    assert trainer.forward_fn.packs
    lengths = [len(e.tokens) - 1 for e in examples]
    assert any(len(row) > 1 for row in packed_layout(lengths, 1.0, 0.0))  # several examples share a row
    together = trainer.forward([e.datum() for e in examples])
    for example, packed in zip(examples, together):
        (alone,) = trainer.forward([example.datum()])
        start = example.loss_mask.index(1.0) - 1
        assert torch.allclose(packed[start:], alone[start:], atol=1e-5)


def test_a_chat_row_trains_every_assistant_turn_and_nothing_else(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        messages = [
            {"role": "user", "content": "what is 1 plus 2?"},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "and 2 plus 2?"},
            {"role": "assistant", "content": "4"},
        ]
        example = chat_example(tokenizer, Prompt(id="c:1", messages=messages))
    finally:
        tokenizer.chat_template = None
    trained = [t for t, m in zip(example.tokens, example.loss_mask) if m]
    expected = []
    for answer in ("3", "4"):
        expected += tokenizer(f"{answer}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert trained == expected
    assert tokenizer.decode(example.tokens).count("<|endoftext|>") == 4


@pytest.mark.parametrize("chat_template", [True, False])
def test_a_prompt_in_the_chat_template_is_taught_its_assistant_turn_as_the_rollout_encodes_it(
    tokenizer, tiny_model_dir, tiny_dataset, chat_template
):
    prompt = Prompt(id="p:1", text="what is 1 plus 2?", metadata={"completion": "3"})
    rollout = make_plugin("rollout.single_turn", chat_template=chat_template)
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        config = SFTConfig(model=str(tiny_model_dir), dataset=str(tiny_dataset))
        (example,) = encode_examples([prompt], rollout, tokenizer, config, None).examples
        prompt_tokens = rollout.encode(tokenizer, prompt)
    finally:
        tokenizer.chat_template = None
    context = example.loss_mask.index(1.0)
    assert example.tokens[:context] == prompt_tokens and not any(example.loss_mask[:context])
    target = tokenizer.decode(example.tokens[context:])
    # In the template the target is the assistant turn it renders, closed by it; without, the text and eos.
    assert target == "3<|endoftext|>"
    assert tokenizer.decode(prompt_tokens).endswith("assistant\n" if chat_template else "plus 2?")


def test_messages_rows_train_through_the_command(tiny_model_dir, tiny_dataset, tmp_path):
    import shutil

    model = tmp_path / "chat_model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    rows = tmp_path / "chats.jsonl"
    chats = [[{"role": "user", "content": f"what is {a} plus 1?"}, {"role": "assistant", "content": f"{a + 1}"}] for a in range(8)]
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    out = grpo_core_in_process(
        "sft", "--model", str(model), "--dataset", str(rows), "--examples-per-step", "4", "--run-dir", str(tmp_path / "sft")
    )
    assert out.returncode == 0, out.stderr
    records = metrics_of(tmp_path / "sft")
    assert len(records) == 2 and records[0]["data/examples"] == 8
    assert records[0]["train/tokens"] == 4 * 2  # each answer's one digit and the turn's closing token


def test_a_chat_row_without_an_assistant_turn_or_template_is_refused(tokenizer):
    from grpo_core.errors import DataError

    with pytest.raises(DataError, match="no chat template"):
        chat_example(tokenizer, Prompt(id="c:1", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]))
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        with pytest.raises(DataError, match="c:2: 'messages' has no assistant turn"):
            chat_example(tokenizer, Prompt(id="c:2", messages=[{"role": "user", "content": "hi"}]))
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize(
    ("mode", "kept", "truncated", "skipped"),
    [("truncate", 3, 2, 0), ("skip", 1, 0, 2)],
)
def test_examples_over_the_length_limit_are_cut_or_left_out_and_counted(
    tokenizer, tiny_model_dir, tiny_dataset, mode, kept, truncated, skipped
):
    prompts = [
        *rows(1),
        attrs.evolve(rows(1)[0], id="long:1", metadata={"answer": "1 + 1 = 2 " * 20}),
        attrs.evolve(rows(1)[0], id="long:2", metadata={"answer": "9 " * 40}),
    ]
    config = tiny_config(tiny_model_dir, tiny_dataset, long_examples=mode)
    limit = len(examples_of(tokenizer, prompts[:1], config)[0].tokens)
    result = encode_examples(prompts, make_plugin("rollout.single_turn"), tokenizer, config, limit)
    assert len(result.examples) == kept and len(result.truncated) == truncated and len(result.skipped) == skipped
    assert all(len(e.tokens) <= limit and e.target_tokens for e in result.examples)
    assert result.counts["data/truncated_examples"] == truncated and result.counts["data/skipped_long_examples"] == skipped


def test_the_held_out_loss_is_the_mean_over_target_tokens(tokenizer, trainer, tiny_model_dir, tiny_dataset):
    examples = examples_of(tokenizer, rows(3), tiny_config(tiny_model_dir, tiny_dataset))
    logprobs = trainer.forward([e.datum() for e in examples])
    expected = -sum(float((lp * torch.tensor(e.loss_mask[1:])).sum()) for lp, e in zip(logprobs, examples)) / sum(
        e.target_tokens for e in examples
    )
    held_out = HeldOutLoss(examples, every=2, total_steps=5, per_call=2, trainer=trainer)
    assert held_out(None)["eval/loss"] == pytest.approx(expected, rel=1e-6)
    assert [s for s in range(6) if held_out.due(s)] == [0, 2, 4, 5]


def test_the_held_out_loss_of_each_eval_mix_source_is_its_own_and_eval_loss_weighs_them_by_tokens(
    tokenizer, trainer, tiny_model_dir, tiny_dataset
):
    plain = examples_of(tokenizer, rows(5), tiny_config(tiny_model_dir, tiny_dataset))
    examples = [attrs.evolve(e, source=s) for e, s in zip(plain, "xyxyy")]
    measured = HeldOutLoss(examples, every=1, total_steps=1, per_call=2, trainer=trainer)(None)
    tokens = {}
    for name in "xy":
        nll, tokens[name] = map(sum, zip(*(target_nll(trainer, e) for e in examples if e.source == name)))
        assert measured[f"eval/data/{name}/loss"] == pytest.approx(nll / tokens[name], rel=1e-5)
    assert measured["eval/data/x/examples"] == 2 and measured["eval/data/y/examples"] == 3 and measured["eval/examples"] == 5
    weighted = sum(tokens[name] * measured[f"eval/data/{name}/loss"] for name in "xy") / sum(tokens.values())
    assert measured["eval/loss"] == pytest.approx(weighted, rel=1e-6)


def test_sft_trains_its_loss_falls_and_its_final_policy_is_a_model_run_eval_and_export_load(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "sft"
    out = grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, run_dir, "--warmup-steps", "2", "--lr-schedule", "linear"))
    assert out.returncode == 0, out.stderr
    records = metrics_of(run_dir)
    assert [m["step"] for m in records] == list(range(1, 7))
    losses = [m["loss/total"] for m in records]
    assert losses[-1] < losses[0] - 0.5, losses
    assert [m["optim/lr"] for m in records] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2 * 3 / 4, 1e-2 / 2, 1e-2 / 4])
    assert all(m["train/examples"] == 4 for m in records) and records[0]["data/examples"] == 36
    assert "step 6/6  loss" in out.stdout and "loss: first 3 steps" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["loss_last"] < summary["loss_first"] and summary["steps"] == 6
    settings = json.loads((run_dir / "final" / "grpo_core_prompt.json").read_text())
    assert settings["prompt_template"] == TEMPLATE and settings["rollout"] == "single_turn"
    assert json.loads((run_dir / "config.json").read_text())["command"] == "sft"

    evaluated = grpo_core_in_process("eval", "--model", str(run_dir / "final"), "--dataset", str(tiny_dataset), "--max-rows", "2", "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout.splitlines()[-1])["prompts"] == 2
    rl = tmp_path / "rl"
    trained = grpo_core_in_process(
        "run", "--model", str(run_dir / "final"), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE, "--max-steps", "1",
        "--prompt-groups-per-step", "2", "--completions-per-prompt", "2", "--max-completion-tokens", "4",
        "--no-drop-zero-variance-groups", "--run-dir", str(rl),
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert json.loads((rl / "config.json").read_text())["model"] == str(run_dir / "final")
    exported = grpo_core_in_process("export", str(run_dir), str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_stopped_sft_run_resumes_to_the_weights_of_one_that_never_stopped(tiny_model_dir, tiny_dataset, tmp_path):
    from tests.helpers import safetensors_of

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, whole, "--checkpoint-every", "2")).returncode == 0
    first = grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, stopped, "--checkpoint-every", "2"), "--max-steps", "3")
    assert first.returncode == 0, first.stderr
    resumed = grpo_core_in_process("sft", "--resume", str(stopped), "--max-steps", "6")
    assert resumed.returncode == 0, resumed.stderr
    a, b = safetensors_of(whole / "final"), safetensors_of(stopped / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss/total"] for m in metrics_of(stopped)] == [m["loss/total"] for m in metrics_of(whole)]

    changed = grpo_core_in_process("sft", "--resume", str(stopped), "--completion-template", "{completion}!")
    assert changed.returncode == 1 and "--completion-template cannot change" in changed.stderr, changed.stderr
    refused = grpo_core_in_process("run", "--resume", str(stopped))
    assert refused.returncode == 1
    assert f"it is a grpo-core sft run; continue it with grpo-core sft --resume {stopped}" in refused.stderr


def test_an_sft_run_folder_is_locked_and_replaced_only_with_overwrite(tiny_model_dir, tiny_dataset, tmp_path):
    from grpo_core.run_dir import locked

    run_dir = tmp_path / "sft"
    args = sft_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "1")
    assert grpo_core_in_process(*args).returncode == 0
    again = grpo_core_in_process(*args)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    with locked(run_dir):
        busy = grpo_core_in_process(*args, "--overwrite")
    assert busy.returncode == 1 and "is in use" in busy.stderr, busy.stderr
    assert grpo_core_in_process(*args, "--overwrite").returncode == 0  # every file of an sft run is one grpo-core wrote
    (run_dir / "notes.txt").write_text("mine")
    kept = grpo_core_in_process(*args, "--overwrite")
    assert kept.returncode == 1 and "also holds notes.txt, which it did not write" in kept.stderr, kept.stderr
    assert (run_dir / "notes.txt").read_text() == "mine" and (run_dir / "final").is_dir()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--max-seq-len", "8"), "add.jsonl:1: 26 tokens (13 before the first target token) > --max-seq-len 8; raise"),
        (("--completion-field", "nope"), "missing field 'nope'"),
        (("--completion-template", "A:"), "must hold {completion} once"),
        (("--examples-per-step", "100"), "the dataset has 36 examples, fewer than --examples-per-step 100"),
        (("--eval-dataset", "x.jsonl"), "--eval-dataset would do nothing: the held-out loss is measured with --eval-every N"),
        (("--eval-every", "2"), "pass --eval-dataset with the held-out rows"),
        (("--eval-mix", "a=x.jsonl"), "--eval-mix would do nothing: the held-out loss is measured with --eval-every N"),
        (("--eval-every", "2", "--eval-mix", "a:2=x.jsonl"), "--eval-mix a:2=x.jsonl: a weight does nothing there"),
        (
            ("--eval-every", "2", "--eval-mix", "a=x.jsonl", "--eval-dataset", "y.jsonl"),
            "--eval-dataset and --eval-mix both name the held-out prompts; make the dataset one more --eval-mix source",
        ),
        (("--max-seq-len", "1000"), "--max-seq-len 1000 is over the model's context of 256 tokens"),
    ],
)
def test_bad_sft_settings_are_refused_with_one_line(tiny_model_dir, tiny_dataset, tmp_path, extra, message):
    out = grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, tmp_path / "sft"), *extra)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "sft" / "config.json").exists()


def test_rl_settings_are_not_sft_settings(tiny_model_dir, tiny_dataset, tmp_path):
    toml = tmp_path / "sft.toml"
    toml.write_text("temperature = 0.7\n")
    out = grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, tmp_path / "sft"), "--config", str(toml))
    assert out.returncode == 1 and "unknown config key 'temperature'" in out.stderr
    flag = grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, tmp_path / "sft"), "--completions-per-prompt", "4")
    assert flag.returncode == 2 and "No such option" in flag.stderr


def test_the_held_out_loss_is_logged_at_step_0_every_n_steps_and_at_the_end(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "sft"
    out = grpo_core_in_process(
        *sft_args(tiny_model_dir, tiny_dataset, run_dir, "--eval-every", "4", "--eval-dataset", str(tiny_dataset), "--eval-prompts", "8")
    )
    assert out.returncode == 0, out.stderr
    evals = {m["step"]: m["eval/loss"] for m in metrics_of(run_dir) if "eval/loss" in m}
    assert sorted(evals) == [0, 4, 6] and evals[6] < evals[0]
    assert all(math.isfinite(v) for v in evals.values())


@pytest.mark.parametrize("flags", [("--dtype", "bfloat16"), ("--lora-rank", "4", "--learning-rate", "5e-2")])
def test_sft_trains_in_bf16_and_with_lora(tiny_model_dir, tiny_dataset, tmp_path, flags):
    run_dir = tmp_path / "sft"
    out = grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, run_dir), *flags)
    assert out.returncode == 0, out.stderr
    losses = [m["loss/total"] for m in metrics_of(run_dir)]
    assert losses[-1] < losses[0], losses
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_example_datum_weights_follow_its_mask():
    example = Example("x", [5, 6, 7, 8], [0.0, 0.0, 1.0, 1.0])
    assert example.target_tokens == 2
    assert example.datum().model_input.to_ints() == [5, 6, 7]


def test_sft_help_lists_its_settings_in_their_sections_and_no_rl_setting():
    from grpo_core.config import MODEL_AND_DATA, OPTIMIZER, PLUGINS, SFT, cli_fields

    text, flags = help_sections("sft")
    for field in cli_fields(SFTConfig):
        assert f"--{field.name.replace('_', '-')}" in flags[field.metadata["section"]], field.name
    assert flags[SFT][:2] == ["--completion-field", "--completion-template"] and "--dataset" in flags[MODEL_AND_DATA]
    assert flags[PLUGINS] == ["--backend", "--rollout", "--logger", "--backend-opt", "--rollout-opt", "--logger-opt"]
    assert "--learning-rate" in flags[OPTIMIZER]
    for rl in ("--temperature", "--loss", "--reward", "--completions-per-prompt", "--loop", "--sampler"):
        assert f"  {rl} " not in text, rl


STYLE = "reward/mean "
"""What `grpo-core eval` prints before the share of answers the format reward passes."""


def reward_mean(out) -> float:
    return float(out.stdout.split(STYLE)[1].split()[0])


@pytest.mark.slow
def test_the_sft_page_runs_and_its_recipe_changes_the_answer_style(tmp_path):
    """docs/sft.md's commands in order (the GRPO run cut to 2 steps): the acceptance run's loss falls and its
    final/ is a model eval and run load; SFT on restyled answers makes the greedy answers end in 'Answer: N'."""
    from tests.conftest import REPO
    from tests.test_docs import documented_commands, run_command

    for entry in REPO.iterdir():
        if entry.name not in ("runs", ".git", ".venv"):
            (tmp_path / entry.name).symlink_to(entry)
    printed = []
    for page, command in documented_commands():
        if page != "docs/sft.md":
            continue
        out = run_command(command.replace("--max-steps 30 --run-dir runs/rl", "--max-steps 2 --run-dir runs/rl"), tmp_path)
        assert out.returncode == 0, f"{command}\n{out.stderr[-3000:]}"
        printed.append((command, out))
    assert len(printed) == 10
    summary = json.loads((tmp_path / "runs" / "sft-answers" / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["loss_last"] < 0.8 * summary["loss_first"], summary
    for extra in (
        ("eval", "--model", "runs/sft-answers/final", "--max-rows", "10"),
        ("run", "--model", "runs/sft-answers/final", "--max-steps", "1"),
    ):
        assert (
            run_command(
                " ".join(("grpo-core", *extra, "--run-dir", "runs/rl-answers") if extra[0] == "run" else ("grpo-core", *extra)), tmp_path
            ).returncode
            == 0
        )
    styles = [reward_mean(out) for command, out in printed if "pattern=" in command]
    assert styles[0] == 0.0 and styles[1] >= 0.9 and styles[2] >= 0.8, styles  # base, after SFT, after the 2 GRPO steps
    correct = [reward_mean(out) for command, out in printed if command.startswith("grpo-core eval") and "pattern=" not in command]
    assert correct[0] >= 0.5, correct  # the SFT policy still solves most problems, in its new style


@pytest.mark.slow
def test_an_sft_run_killed_with_sigkill_resumes_bitwise_equal(tiny_model_dir, tiny_dataset, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from grpo_core.metrics import computed_only
    from tests.helpers import safetensors_of

    def args(run_dir):
        return [*sft_args(tiny_model_dir, tiny_dataset, run_dir, "--checkpoint-every", "1", "--epochs", "2"), "--max-steps", "12"]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert grpo_core_in_process(*args(whole)).returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_core.cli", *args(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and steps_logged(killed) < 3:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()
    assert steps_logged(killed) < 12
    resumed = grpo_core_in_process("sft", "--resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr
    a, b = safetensors_of(whole / "final"), safetensors_of(killed / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [computed_only(m) for m in metrics_of(killed)] == [computed_only(m) for m in metrics_of(whole)]


@pytest.mark.slow
def test_sft_on_two_fsdp_ranks_ends_where_the_local_backend_ends(tiny_model_dir, tiny_dataset, tmp_path):
    from tests.helpers import grpo_core, safetensors_of

    def args(run_dir):
        return [*sft_args(tiny_model_dir, tiny_dataset, run_dir), "--max-steps", "3", "--learning-rate", "1e-3"]

    local = grpo_core_in_process(*args(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    sharded = grpo_core(*args(tmp_path / "fsdp"), "--backend", "fsdp", "--backend-opt", "nproc=2")
    assert sharded.returncode == 0, sharded.stderr
    ours, theirs = safetensors_of(tmp_path / "fsdp" / "final"), safetensors_of(tmp_path / "local" / "final")
    initial = safetensors_of(tiny_model_dir)
    assert max(float((theirs[k] - initial[k]).abs().max()) for k in theirs) > 1e-4  # it trained
    # AdamW's first steps move each weight by about lr whatever its gradient: 1e-3 keeps summation-order digits well inside 1e-4.
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in theirs) <= 1e-4
    losses = [[m["loss/total"] for m in metrics_of(tmp_path / run)] for run in ("fsdp", "local")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)


def test_the_trainer_plans_an_sft_step_as_its_examples_not_as_rl_groups(tiny_model_dir, tiny_dataset, tmp_path):
    from grpo_core.config import RunConfig

    assert SFTConfig(examples_per_step=3).sequences_per_update == 3 and not SFTConfig().shares_prompts
    assert RunConfig(prompt_groups_per_step=4, completions_per_prompt=8, minibatches_per_step=2).sequences_per_update == 16
    out = grpo_core_in_process(*sft_args(tiny_model_dir, tiny_dataset, tmp_path / "sft", "--max-steps", "1"))
    assert out.returncode == 0, out.stderr
    compile_line = next(line for line in out.stderr.splitlines() if line.startswith("compile:"))
    assert "share their prompt" not in compile_line, compile_line


def test_pre_tokenized_rows_and_a_mixture_train_through_the_command(tiny_model_dir, tiny_dataset, tmp_path):
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"question": [284, 27, 200 + a], "completion": [17 + a, 0]}) + "\n" for a in range(8)))
    out = grpo_core_in_process(
        "sft", "--model", str(tiny_model_dir), "--dataset", str(ids), "--examples-per-step", "4", "--run-dir", str(tmp_path / "ids")
    )
    assert out.returncode == 0, out.stderr
    first = metrics_of(tmp_path / "ids")[0]
    assert first["data/examples"] == 8 and first["train/tokens"] == 4 * 2 and first["train/forward_tokens"] == 4 * 4

    sources = []
    for name, offset in (("small", 0), ("large", 10)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({"question": f"what is {a} plus 1?", "completion": f"{a + 1}"}) + "\n" for a in range(offset, offset + 8))
        )
        sources.append(path)
    mixed = grpo_core_in_process(
        "sft", "--model", str(tiny_model_dir), "--mix", f"small:3={sources[0]}", "--mix", f"large={sources[1]}",
        "--prompt-template", TEMPLATE, "--examples-per-step", "4", "--max-steps", "2", "--run-dir", str(tmp_path / "mix"),
    )  # fmt: skip
    assert mixed.returncode == 0, mixed.stderr
    records = metrics_of(tmp_path / "mix")
    assert [m["train/examples"] for m in records] == [4, 4] and records[0]["data/examples"] == 16
    # 3 of every 4 rows from small (one digit and eos: 2 target tokens), 1 from large (two digits and eos: 3).
    assert [m["train/tokens"] for m in records] == [3 * 2 + 3, 3 * 2 + 3]


def test_a_mixture_logs_each_sources_share_count_and_loss_and_an_eval_mix_each_held_out_source(tiny_model_dir, tmp_path):
    def source(name, offset, count):
        path = tmp_path / f"{name}.jsonl"
        rows = [{"question": f"what is {a} plus 1?", "completion": f"{a + 1}"} for a in range(offset, offset + count)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    run_dir = tmp_path / "mix"
    out = grpo_core_in_process(
        "sft", "--model", str(tiny_model_dir), "--mix", f"small:7={source('small', 0, 8)}", "--mix", f"large={source('large', 10, 8)}",
        "--prompt-template", TEMPLATE, "--examples-per-step", "4", "--max-steps", "2", "--run-dir", str(run_dir),
        "--eval-every", "2", "--eval-mix", f"one={source('one', 0, 5)}", "--eval-mix", f"two={source('two', 10, 5)}",
        "--eval-prompts", "3",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = {m["step"]: m for m in metrics_of(run_dir)}
    first, second = steps[1], steps[2]
    # 7:1 by 4: the first step draws small only, the second 3 of small (2 target tokens each) and 1 of large (3).
    assert (first["data/small/share"], first["data/large/share"]) == (1.0, 0.0)
    assert first["data/small/examples"] == 4 and "data/large/examples" not in first and "data/large/loss" not in first
    assert first["data/small/loss"] == pytest.approx(first["loss/total"], rel=1e-6)
    assert (second["data/small/share"], second["data/large/share"]) == (0.75, 0.25)
    assert second["data/small/examples"] == 3 and second["data/large/examples"] == 1
    weighted = (3 * 2 * second["data/small/loss"] + 3 * second["data/large/loss"]) / (3 * 2 + 3)
    assert weighted == pytest.approx(second["loss/total"], rel=1e-6)

    # --eval-prompts counts in each source: 3 of each; one's targets are 2 tokens, two's 3.
    for step in (0, 2):
        evaluated = steps[step]
        assert evaluated["eval/examples"] == 6 and evaluated["eval/data/one/examples"] == 3 and evaluated["eval/data/two/examples"] == 3
        weighted = (3 * 2 * evaluated["eval/data/one/loss"] + 3 * 3 * evaluated["eval/data/two/loss"]) / (3 * 2 + 3 * 3)
        assert weighted == pytest.approx(evaluated["eval/loss"], rel=1e-6)
