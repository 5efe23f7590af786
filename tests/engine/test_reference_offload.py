from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import tinker
import torch

from grpo_core import Sample
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.engine.host_memory import malloc_trim
from grpo_core.engine.lora import frozen_copy
from grpo_core.engine.reference_offload import HostTensors, OffloadedWeights
from grpo_core.engine.trainer import LocalReference
from grpo_core.errors import PluginError
from grpo_core.options import instantiate
from grpo_core.plugins.backends.local import LocalBackend


def datums_of(tokenizer):
    prompt = tokenizer("Question: what is 3 plus 4?\nAnswer:")["input_ids"]
    samples = [
        Sample(
            prompt=None,
            tokens=prompt + completion,
            sampling_logprobs=[0.0] * (len(prompt) + len(completion)),
            loss_mask=[0.0] * len(prompt) + [1.0] * len(completion),
            text="",
            finish_reason="stop",
            policy_version=0,
        )
        for completion in ([5, 6, 7], [8, 9], [10, 11, 12, 13])
    ]
    return [sample_to_datum(s) for s in samples]


def trainer_and_references(model_dir, dtype="float32", before_references=lambda: None):
    cfg = RunConfig(model=str(model_dir), dtype=dtype)
    trainer = LocalBackend().make_trainer(config=cfg)
    before_references()
    resident = LocalBackend(reference="memory").make_reference(config=cfg, trainer=trainer)
    offloaded = LocalBackend(reference="offload").make_reference(config=cfg, trainer=trainer)
    return trainer, resident, offloaded


def mappings_of(path: Path) -> int:
    return sum(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_an_offloaded_reference_scores_bitwise_as_a_resident_one_and_holds_nothing_between_forwards(tiny_model_dir, capsys):
    weights_file = tiny_model_dir / "model.safetensors"
    maps = []  # transformers may keep the file it loaded the trainer from mapped
    trainer, resident, offloaded = trainer_and_references(tiny_model_dir, before_references=lambda: maps.append(mappings_of(weights_file)))
    # float32 from a float32 folder: the folder's own file serves, nothing is written.
    assert f"reference: offloaded to the model's own weight files ({tiny_model_dir})" in capsys.readouterr().err
    datums = datums_of(trainer.tokenizer)
    resident_bytes_during = []
    offloaded.model.base_model.register_forward_pre_hook(lambda *_: resident_bytes_during.append(offloaded.offloaded.resident_bytes()))
    weights = sum(p.numel() * 4 for p in trainer.model.parameters())
    for _ in range(2):
        got = offloaded.forward(datums)
        assert all(torch.equal(a, b) for a, b in zip(got, resident.forward(datums)))
        assert resident_bytes_during[-1] == weights
        # Between forwards: every parameter empty, the file mapped nowhere.
        assert offloaded.offloaded.resident_bytes() == 0
        assert all(p.numel() == 0 for p in offloaded.model.parameters())
        assert mappings_of(weights_file) == maps[0]
        # The reference stays the initial policy while the trainer moves away from it.
        trainer.forward_backward_custom(datums, lambda d, lps: (-sum(lp.sum() for lp in lps), {}))
        trainer.optim_step(tinker.AdamParams(learning_rate=1e-2))
    assert not all(torch.equal(a, b) for a, b in zip(trainer.forward(datums), got))


def test_a_bf16_run_from_a_float32_folder_offloads_a_snapshot_that_leaves_no_file(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    trainer, resident, offloaded = trainer_and_references(tiny_model_dir, dtype="bfloat16")
    assert "reference: offloaded to a snapshot of the initial weights in the temporary directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # unlinked at once: a killed run leaves nothing behind
    assert {e.dtype for e in offloaded.offloaded.store.entries} == {torch.bfloat16}
    datums = datums_of(trainer.tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(offloaded.forward(datums), resident.forward(datums)))
    assert offloaded.offloaded.resident_bytes() == 0


def test_a_folder_whose_weights_are_not_the_initial_policy_is_not_used(tiny_model_dir, capsys):
    cfg = RunConfig(model=str(tiny_model_dir))
    trainer = LocalBackend().make_trainer(config=cfg)
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(0.5)  # the policy no longer equals the folder's file
    offloaded = LocalBackend(reference="offload").make_reference(config=cfg, trainer=trainer)
    assert "offloaded to a snapshot" in capsys.readouterr().err
    resident = LocalBackend(reference="memory").make_reference(config=cfg, trainer=trainer)
    datums = datums_of(trainer.tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(offloaded.forward(datums), resident.forward(datums)))


def test_host_memory_offload_copies_the_weights_in_for_each_forward(tiny_model_dir):
    """What CUDA runs (host tensors copied to the device per forward), here with the CPU as the device."""
    cfg = RunConfig(model=str(tiny_model_dir))
    trainer = LocalBackend().make_trainer(config=cfg)
    resident = LocalBackend(reference="memory").make_reference(config=cfg, trainer=trainer)
    model = frozen_copy(trainer.model, weights=False)
    host = HostTensors([p.detach().clone() for p in trainer.model.parameters()], torch.device("cpu"))
    offloaded = LocalReference(model, torch.device("cpu"), offloaded=OffloadedWeights(list(model.parameters()), host, "host"))
    datums = datums_of(trainer.tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(offloaded.forward(datums), resident.forward(datums)))
    assert offloaded.offloaded.resident_bytes() == 0


def test_reference_auto_offloads_a_full_fine_tune_on_a_cpu_and_memory_keeps_a_copy(tiny_model_dir):
    cfg = RunConfig(model=str(tiny_model_dir))
    trainer = LocalBackend().make_trainer(config=cfg)
    auto = LocalBackend().make_reference(config=cfg, trainer=trainer)
    assert auto.offloaded is not None and auto.offloaded.resident_bytes() == 0
    memory = LocalBackend(reference="memory").make_reference(config=cfg, trainer=trainer)
    assert memory.offloaded is None
    assert all(torch.equal(a, b) for a, b in zip(memory.model.parameters(), trainer.model.parameters()))


def test_reference_place_is_checked(tiny_model_dir):
    with pytest.raises(PluginError, match="'reference' must be in"):
        instantiate(LocalBackend, "backend 'local'", {"reference": "disk"})
    lora = RunConfig(model=str(tiny_model_dir), lora_rank=4)
    with pytest.raises(PluginError) as err:
        LocalBackend(reference="offload").make_trainer(config=lora)
    assert str(err.value) == (
        "--backend-opt reference=offload: a LoRA run's reference is the trainer's own model with its adapters off; "
        "there is no copy to offload"
    )
    # auto: a LoRA run's reference is its own model, adapters off, whatever the device.
    trainer = LocalBackend().make_trainer(config=lora)
    reference = LocalBackend().make_reference(config=lora, trainer=trainer)
    assert reference.model is trainer.model and reference.adapters_off and reference.offloaded is None


RELEASE_CHECK = """
import ctypes, torch
from pathlib import Path
from grpo_core.engine.host_memory import release_freed_memory

def resident():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
# What glibc's dynamic threshold comes to once large blocks have been freed: 4 MiB blocks from the heap.
libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
blocks = [libc.malloc(4 << 20) for _ in range(64)]
for block in blocks:
    ctypes.memset(block, 1, 4 << 20)
keep = libc.malloc(4 << 20)  # above them (no free block that size below): the top cannot shrink past it
for block in blocks:
    libc.free(block)
before = resident()
release_freed_memory(torch.device("meta"))  # not a CPU device: nothing to do
unchanged = resident()
release_freed_memory(torch.device("cpu"))
print(before >> 20, unchanged >> 20, resident() >> 20)
"""


@pytest.mark.skipif(malloc_trim() is None, reason="the C library has no malloc_trim (not glibc): the call is a no-op there")
def test_released_memory_leaves_the_process():
    # In a fresh interpreter: what this one freed before would blur the measurement.
    before, unchanged, after = map(
        int, subprocess.run([sys.executable, "-c", RELEASE_CHECK], capture_output=True, text=True, check=True).stdout.split()
    )
    assert before - unchanged < 16
    assert before - after > 200  # MiB: the 256 MiB freed, gone


@pytest.mark.parametrize(
    ("return_freed_memory", "available_gb", "fixed", "line"),
    [
        (True, 100.0, True, "tensors of 1 MiB or more go back to the OS when freed, the heap's free pages after each phase (--"),
        (False, 0.001, False, "glibc keeps freed tensors for reuse (--backend-opt"),
        ("auto", 100.0, False, "glibc keeps freed tensors for reuse (planned peak"),
        ("auto", 0.5, True, "tensors of 1 MiB or more go back to the OS when freed, the heap's free pages after each phase (planned"),
    ],
)
def test_return_freed_memory_fixes_glibcs_mmap_threshold_where_memory_is_tight(
    tiny_model_dir, monkeypatch, capsys, return_freed_memory, available_gb, fixed, line
):
    from grpo_core.engine import trainer as trainer_module
    from grpo_core.plugins.backends import local

    thresholds, trims = [], []
    monkeypatch.setattr(local, "set_mmap_threshold", thresholds.append)
    monkeypatch.setattr(local, "free_memory", lambda device: int(available_gb * 1e9))
    monkeypatch.setattr(trainer_module, "release_freed_memory", trims.append)
    backend = LocalBackend(return_freed_memory=return_freed_memory)
    config = RunConfig(model=str(tiny_model_dir), memory_check=False)
    trainer = backend.make_trainer(config=config)
    assert thresholds == ([1 << 20] if fixed else [])
    assert f"host memory: {line}" in capsys.readouterr().err
    # The heap's free pages too, by the trainer and its reference, where a phase has freed memory.
    reference = backend.make_reference(config=config, trainer=trainer)
    datums = datums_of(trainer.tokenizer)
    trainer.forward(datums)
    reference.forward(datums)
    assert trims == ([torch.device("cpu")] * 2 if fixed else [])
