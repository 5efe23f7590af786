"""Each backend refuses a setting it cannot train with in ``check_config``: the run stops with one
line before the data, the tokenizer or a model loads (or a service is opened)."""

from __future__ import annotations

import pytest

from tests.helpers import grpo_core_in_process


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--backend", "local", "--lora-rank", "4", "--backend-opt", "reference=offload"),
            "--backend-opt reference=offload: a LoRA run's reference is the trainer's own model with its adapters off",
        ),
        (("--backend", "local", "--device", "cpu", "--optimizer-state", "offload"), "--optimizer-state offload streams Adam's moments"),
        (("--backend", "fsdp", "--backend-opt", "nproc=1"), "--backend fsdp with one rank shards nothing: use --backend local"),
        (("--backend", "fsdp", "--backend-opt", "nproc=2", "--lora-rank", "4"), "LoRA runs on --backend local"),
        (("--backend", "tinker", "--dtype", "bfloat16"), "--dtype bfloat16 applies to the local trainer only"),
        (("--backend", "tinker", "--lora-rank", "8", "--lora-alpha", "8"), "--lora-alpha apply to the local trainer only"),
    ],
    ids=["local_reference", "local_offload", "fsdp_one_rank", "fsdp_lora", "tinker_dtype", "tinker_lora_alpha"],
)
def test_a_refused_backend_setting_is_refused_before_the_data_and_the_tokenizer_load(args, message, tiny_model_dir, monkeypatch):
    import transformers

    from grpo_core import lifecycle

    loaded = []
    monkeypatch.setattr(lifecycle, "load_dataset", lambda *a, **k: loaded.append("data") or pytest.fail("loaded the data"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: loaded.append("tokenizer"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = grpo_core_in_process("run", "--model", str(tiny_model_dir), *args, "--max-steps", "1")
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert loaded == []
