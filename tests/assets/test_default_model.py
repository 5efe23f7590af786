"""The shipped default model and task (core/assets/default, built by scripts/build_default_model.py)."""

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ASSET = Path(__file__).parents[2] / "core/assets/default"
ANSWER_RE = re.compile(r"####\s*(-?\d+)\s*$")

# Measured at build time (build_info.json): greedy 0.90 on 200 test prompts (0.95 on these 20),
# T=1 sampling 0.22. Bounds leave room for the noise of 20 prompts.
ACC_THRESHOLD = 0.7
T1_RANGE = (0.05, 0.5)


def prompt_of(question: str) -> str:
    return "Question: " + question + "\nAnswer:"


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def train_rows():
    return read_jsonl(ASSET / "task" / "train.jsonl")


@pytest.fixture(scope="module")
def test_rows():
    return read_jsonl(ASSET / "task" / "test.jsonl")


def test_folder_is_small():
    size = sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file())
    assert size < 10 * 1024 * 1024, f"{size} bytes"


def test_architecture(model):
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert cfg.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_special_tokens(tokenizer, model):
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token_id is not None and tokenizer.eos_token_id != tokenizer.pad_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert len(tokenizer) <= model.config.vocab_size
    assert not getattr(tokenizer, "chat_template", None)


def test_tokenizer_round_trip(tokenizer, test_rows):
    row = test_rows[0]
    prompt, completion = prompt_of(row["question"]), " " + row["answer"]
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(p) == prompt
    assert tokenizer.decode(c) == completion
    # Separate tokenization concatenates to the joint one (what SFT trained on).
    assert tokenizer(prompt + completion, add_special_tokens=False)["input_ids"] == p + c
    # No BOS/EOS added implicitly, and digits are single tokens.
    assert tokenizer(prompt)["input_ids"] == p
    assert all(len(tokenizer.decode([i]).strip()) <= 1 for i in tokenizer("1234567890")["input_ids"])


def test_task_files(train_rows, test_rows):
    assert len(train_rows) == 5000 and len(test_rows) == 500
    for row in train_rows + test_rows:
        assert set(row) == {"question", "answer"}
        assert isinstance(row["question"], str) and row["question"].endswith("?")
        m = ANSWER_RE.search(row["answer"].splitlines()[-1])
        assert m, row
        assert 0 <= int(m.group(1)) <= 100
    train_q = {r["question"] for r in train_rows}
    assert not any(r["question"] in train_q for r in test_rows)


@torch.no_grad()
def test_greedy_accuracy(model, tokenizer, test_rows):
    rows = test_rows[:20]
    enc = tokenizer([prompt_of(r["question"]) for r in rows], padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(
        **enc, do_sample=False, max_new_tokens=40, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    correct = 0
    for row, seq in zip(rows, out[:, enc["input_ids"].shape[1] :]):
        got = re.findall(r"####\s*(-?\d+)", tokenizer.decode(seq, skip_special_tokens=True))
        correct += bool(got) and got[-1] == ANSWER_RE.search(row["answer"]).group(1)
    print(f"greedy accuracy: {correct}/{len(rows)}")
    assert correct / len(rows) >= ACC_THRESHOLD, f"greedy accuracy {correct}/{len(rows)}"


@torch.no_grad()
def test_temperature_one_is_calibrated_for_rl(model, tokenizer, test_rows):
    """GRPO needs mixed rewards in a group: T=1 samples must be right sometimes, not mostly."""
    rows, samples = test_rows[:20], 4
    prompts = [tokenizer(prompt_of(r["question"]))["input_ids"] for r in rows for _ in range(samples)]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    gen = torch.Generator().manual_seed(0)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    last = mask.sum(-1) - 1
    for _ in range(40):
        nxt = torch.multinomial(torch.softmax(out.logits[:, -1], -1), 1, generator=gen)[:, 0]
        nxt = torch.where(done, torch.full_like(nxt, tokenizer.pad_token_id), nxt)
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, (~done).long()[:, None]], 1)
        done |= nxt == tokenizer.eos_token_id
        if done.all():
            break
        last = last + 1
        out = model(
            input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None], past_key_values=out.past_key_values, use_cache=True
        )
    correct = 0
    for k in range(len(prompts)):
        text = tokenizer.decode(ids[k, width:][mask[k, width:].bool()], skip_special_tokens=True)
        got = re.findall(r"####\s*(-?\d+)", text)
        correct += bool(got) and got[-1] == ANSWER_RE.search(rows[k // samples]["answer"]).group(1)
    acc = correct / len(prompts)
    print(f"T=1 accuracy on {len(prompts)} samples: {acc:.3f}")
    assert T1_RANGE[0] <= acc <= T1_RANGE[1], f"T=1 accuracy {acc}"
