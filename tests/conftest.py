from __future__ import annotations

from pathlib import Path

import pytest

# The shared helpers assert too: rewritten like the test modules, their failures show the values.
pytest.register_assert_rewrite("tests.helpers", "tests.plugins.backends.routed_samples")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
"""Data the tests read, shipped in the repository (each folder with its license)."""


@pytest.fixture(autouse=True)
def mfu_is_at_most_1(monkeypatch):
    """perf/mfu <= 1 in every run of the suite's own process: above the device's peak, the rate
    counts work the trainer never did (a group's shared prompt counted once per sample)."""
    from grpo_core.metrics import Metrics

    add = Metrics.add

    def checked(self, name, value, *args, **kwargs):
        assert name != "perf/mfu" or 0 <= value <= 1, f"perf/mfu {value}: above the device's peak"
        add(self, name, value, *args, **kwargs)

    monkeypatch.setattr(Metrics, "add", checked)


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (300 tokens) trained here on a few lines of additions."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"Question: what is {a} plus {b}?\nAnswer: {a} + {b} = {a + b}\n#### {a + b}" for a in range(20) for b in range(20)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random 2-layer Qwen3 with the tiny tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    rows = [{"question": f"what is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(6) for b in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_vlm_builder():
    """scripts/build_tiny_vlm.py as a module: the tiny LLaVA-style model and its image rows."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tiny_vlm", REPO / "scripts" / "build_tiny_vlm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LLaVA-style model (2-layer CLIP tower, 2-layer Llama) with its processor; image
    rows in its ``data/rows.jsonl`` (scripts/build_tiny_vlm.py)."""
    builder = tiny_vlm_builder()
    folder = builder.build_model(tmp_path_factory.mktemp("tiny_vlm") / "model")
    builder.write_rows(folder / "data")
    return folder


@pytest.fixture(scope="session")
def gsm8k_test_split() -> Path:
    """GSM8K's test split (1,319 rows, MIT, OpenAI), shipped in tests/data/gsm8k."""
    return DATA / "gsm8k" / "test.jsonl"


def pytest_configure(config):
    """Under pytest-xdist, each worker (and every process it starts) computes on one thread: two
    workers on two cores, not four threads spinning on two."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """A ``cuda`` test skips where torch sees no CUDA device (``pytest -m cuda`` runs them on a GPU)."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="a CUDA GPU (pytest -m cuda on a GPU machine)")
        for item in cuda_items:
            item.add_marker(skip)
