"""The reward_model reward with a tiny random sequence-classification model saved to tmp."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.config import RunConfig
from tests.conftest import build_tiny_tokenizer
from tests.helpers import grpo_core_in_process, small_run_args

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def build_reward_model(path, num_labels: int = 1, chat_template: str | None = None):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = Qwen3ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores far enough apart to tell inputs apart
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def rm_reference(rm_dir):
    """The model's score of one text, computed alone (no batch, no padding) in float32."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()

    def score(text: str, label: int = 0, last: int | None = None) -> float:
        ids = tokenizer(text)["input_ids"]
        ids = ids[-last:] if last else ids
        with torch.no_grad():
            return float(model(torch.tensor([ids])).logits[0, label])

    return score


PROMPT = Prompt(id="p", text="Question: what is 2 plus 3?\nAnswer:")


def group(*texts: str, prompt: Prompt = PROMPT) -> list[Sample]:
    return [Sample(prompt, [1, 2], [0.0, 0.0], [0.0, 1.0], t, "stop", 0) for t in texts]


TEXTS = (" 5", " 2 + 3 = 5\n#### 5", " 7", " 2 + 3 = 6 and then some more words to make it long\n#### 6", " 5 5")


def test_scores_are_the_models_own_in_batches_with_padding(rm_dir, rm_reference):
    reward = make_plugin("reward_model", model=str(rm_dir), batch_size=2)
    scores = reward.reward(prompt=PROMPT, samples=group(*TEXTS))
    expected = [rm_reference(PROMPT.text + t) for t in TEXTS]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == len(TEXTS)  # the inputs are told apart


@pytest.mark.parametrize(("batch_size", "forwards"), [(1, 5), (2, 3), (8, 1)])
def test_batch_size_sets_the_forward_passes(rm_dir, batch_size, forwards):
    reward = make_plugin("reward_model", model=str(rm_dir), batch_size=batch_size)
    _, network, _ = reward._load()
    sizes = []
    network.register_forward_hook(lambda module, args, kwargs, output: sizes.append(len(kwargs["input_ids"])), with_kwargs=True)
    reward.reward(prompt=PROMPT, samples=group(*TEXTS))
    assert len(sizes) == forwards and sum(sizes) == len(TEXTS) and max(sizes) <= batch_size


def test_max_length_cuts_the_start_and_keeps_the_end(rm_dir, rm_reference):
    long = " 1 + 1 = 2 and 2 + 2 = 4 and 3 + 3 = 6\n#### 6"
    short = make_plugin("reward_model", model=str(rm_dir), max_length=6).reward(prompt=PROMPT, samples=group(long))
    full = make_plugin("reward_model", model=str(rm_dir)).reward(prompt=PROMPT, samples=group(long))
    assert short == pytest.approx([rm_reference(PROMPT.text + long, last=6)], abs=1e-5)
    assert full == pytest.approx([rm_reference(PROMPT.text + long)], abs=1e-5) and short != full


def test_label_picks_the_output(tmp_path, rm_reference):
    path = build_reward_model(tmp_path / "two", num_labels=2)
    first = make_plugin("reward_model", model=str(path)).reward(prompt=PROMPT, samples=group(" 5"))
    second = make_plugin("reward_model", model=str(path), label=1).reward(prompt=PROMPT, samples=group(" 5"))
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)(PROMPT.text + " 5", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = AutoModelForSequenceClassification.from_pretrained(path).eval()(ids).logits[0]
    assert first == pytest.approx([float(logits[0])], abs=1e-5) and second == pytest.approx([float(logits[1])], abs=1e-5)
    with pytest.raises(PluginError, match=r"label 2 is out of range: .* has 2 output\(s\)"):
        make_plugin("reward_model", model=str(path), label=2).reward(prompt=PROMPT, samples=group(" 5"))


def test_dtype_is_the_reward_models_own(rm_dir):
    fp32 = make_plugin("reward_model", model=str(rm_dir))
    bf16 = make_plugin("reward_model", model=str(rm_dir), dtype="bfloat16")
    assert fp32._load()[1].dtype == torch.float32 and bf16._load()[1].dtype == torch.bfloat16  # auto on CPU: float32
    a, b = fp32.reward(prompt=PROMPT, samples=group(*TEXTS)), bf16.reward(prompt=PROMPT, samples=group(*TEXTS))
    assert a != b and b == pytest.approx(a, abs=0.2)


def test_it_runs_on_the_runs_device(rm_dir):
    reward = make_plugin("reward_model", model=str(rm_dir))
    reward.on_run_start(config=RunConfig(device="cpu"), run_dir=None, total_steps=None, start_step=0)
    assert reward._load()[2].type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(PluginError, match="--device cuda was asked for, but no CUDA device is available"):
            make_plugin("reward_model", model=str(rm_dir)).on_run_start(
                config=RunConfig(device="cuda"), run_dir=None, total_steps=None, start_step=0
            )


def test_format_chat_uses_the_models_template(tmp_path):
    path = build_reward_model(tmp_path / "chat", chat_template=CHAT_TEMPLATE)
    chat = Prompt(id="c", messages=[{"role": "user", "content": "2 plus 3?"}])
    auto = make_plugin("reward_model", model=str(path))
    tokenizer = auto._load()[0]
    assert auto._input(tokenizer, chat, " 5") == "<user>2 plus 3?<assistant> 5"
    assert auto._input(tokenizer, PROMPT, " 5") == f"<user>{PROMPT.text}<assistant> 5"
    text = make_plugin("reward_model", model=str(path), format="text")
    assert text._input(tokenizer, chat, " 5") == "2 plus 3? 5"
    scores = [p.reward(prompt=chat, samples=group(" 5", prompt=chat))[0] for p in (auto, text)]
    assert scores[0] != scores[1]


def test_a_pre_tokenized_prompt_is_read_as_its_decoded_text(tmp_path):
    path = build_reward_model(tmp_path / "chat", chat_template=CHAT_TEMPLATE)
    chat, text = make_plugin("reward_model", model=str(path)), make_plugin("reward_model", model=str(path), format="text")
    tokenizer = chat._load()[0]
    ids = Prompt(id="t", tokens=[1, 2, 3], decoded="Question: 2 plus 3?\nAnswer:")
    assert text._input(tokenizer, ids, " 5") == "Question: 2 plus 3?\nAnswer: 5"
    assert chat._input(tokenizer, ids, " 5") == "<user>Question: 2 plus 3?\nAnswer:<assistant> 5"


def test_format_chat_without_a_template_is_refused(rm_dir):
    reward = make_plugin("reward_model", model=str(rm_dir), format="chat")
    with pytest.raises(PluginError, match="has no chat template; use format=text"):
        reward.reward(prompt=PROMPT, samples=group(" 5"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "model: name the reward model"),
        ({"model": "x", "batch_size": 0}, "batch_size must be > 0"),
        ({"model": "x", "max_length": 0}, "max_length must be > 0"),
        ({"model": "x", "label": -1}, "label must be >= 0"),
        ({"model": "x", "dtype": "float16"}, "expected one of 'auto', 'float32', 'bfloat16'"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("reward_model", **options)


def test_a_model_that_is_not_a_classifier_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PluginError, match="cannot load .* as a sequence-classification model"):
        make_plugin("reward_model", model=str(tmp_path / "empty")).reward(prompt=PROMPT, samples=group(" 5"))


def test_a_run_trains_on_the_reward_models_scores(rm_dir, rm_reference, tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", "reward_model", "--reward-opt", f"model={rm_dir}",
                        "--logger", "jsonl", "--logger-opt", "jsonl.samples_every=1")
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    for row in rows:
        assert row["reward/reward_model"] == pytest.approx(rm_reference(row["prompt"] + row["completion"]), abs=1e-4)


@pytest.mark.parametrize("model", ["./nope", "/nope/rm", "rm/"])
def test_a_missing_model_folder_is_refused_when_the_plugin_is_made(model):
    with pytest.raises(PluginError) as refused:
        make_plugin("reward_model", model=model)
    assert str(refused.value) == f"reward.reward_model: model={model}: no such folder (a reward model is a local folder or a hub name)"
