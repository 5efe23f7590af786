"""Checkpoints are atomic, complete, pruned, and restore every state a step consumes."""

from __future__ import annotations

import errno
import random
import re

import pytest
import torch

from grpo_core import checkpoint
from grpo_core.checkpoint import (
    CheckpointError,
    capture_rng,
    complete_checkpoints,
    load_checkpoint,
    remove_partial,
    save_checkpoint,
    save_policy,
)
from grpo_core.types import RunState


class FakeTrainer:
    """Writes and reads a small tensor file, as a trainer's save_state/load_state do."""

    def __init__(self, value: float = 1.0) -> None:
        self.weights = torch.full((3,), value)

    def save_state(self, path: str) -> None:
        torch.save({"w": self.weights}, path)

    def load_state(self, path: str) -> None:
        self.weights = torch.load(path, weights_only=True)["w"]


class FakeSampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def save(run_dir, step, trainer=None, keep=5, sampler=None):
    state = RunState(run_dir, step=step, policy_version=step, reward_failures_in_a_row=2, nonfinite_in_a_row=1, history=[0.5] * step)
    state.rng = capture_rng(sampler or FakeSampler(0))
    return save_checkpoint(state, trainer or FakeTrainer(step), lambda d: (d / "extra.json").write_text("{}"), keep)


def test_a_checkpoint_restores_weights_counters_and_every_rng(tmp_path):
    sampler = FakeSampler(seed=7)
    random.seed(3)
    torch.manual_seed(3)
    path = save(tmp_path, 4, trainer=FakeTrainer(4.0), sampler=sampler)
    expected = (random.random(), torch.rand(2), torch.rand(2, generator=sampler.generator))
    random.seed(99)
    torch.manual_seed(99)
    torch.rand(5, generator=sampler.generator)

    trainer = FakeTrainer(0.0)
    state = RunState(tmp_path)
    load_checkpoint(path, trainer, sampler, state)
    assert state == RunState(tmp_path, step=4, policy_version=4, reward_failures_in_a_row=2, nonfinite_in_a_row=1, history=[0.5] * 4)
    assert torch.equal(trainer.weights, torch.full((3,), 4.0))
    got = (random.random(), torch.rand(2), torch.rand(2, generator=sampler.generator))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
    assert sorted(p.name for p in path.iterdir()) == ["extra.json", "rng.pt", "state.json", "trainer"]


def test_only_the_newest_k_are_kept_and_a_step_saved_twice_is_written_once(tmp_path):
    for step in (2, 4, 6):
        save(tmp_path, step, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000004", "step-000006"]
    before = (tmp_path / "checkpoints" / "step-000006" / "trainer").stat().st_mtime_ns
    save(tmp_path, 6, trainer=FakeTrainer(123.0), keep=2)
    assert (tmp_path / "checkpoints" / "step-000006" / "trainer").stat().st_mtime_ns == before


def test_a_failed_write_leaves_the_previous_checkpoint_valid_and_says_so(tmp_path, monkeypatch):
    save(tmp_path, 2)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint step-000004: OSError: .*No space left.*step-000002 is intact"):
        save(tmp_path, 4)
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]  # no temporary folder left
    trainer = FakeTrainer(0.0)
    assert load_checkpoint(complete_checkpoints(tmp_path)[-1], trainer, FakeSampler(0), RunState(tmp_path)).step == 2
    assert torch.equal(trainer.weights, torch.full((3,), 2.0))


def test_a_folder_killed_mid_write_is_never_taken_for_a_checkpoint(tmp_path):
    save(tmp_path, 2)
    partial = tmp_path / "checkpoints" / ".tmp-step-000004-123"
    partial.mkdir()
    (partial / "trainer").write_bytes(b"half")
    unnamed = tmp_path / "checkpoints" / "step-000006"  # a name without its state.json
    unnamed.mkdir()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000002"]
    remove_partial(tmp_path)
    assert not partial.exists()


def test_state_json_is_written_last(tmp_path, monkeypatch):
    order = []
    real_write = checkpoint.Path.write_text

    def spy(self, *args, **kwargs):
        order.append(self.name)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint.Path, "write_text", spy)
    save(tmp_path, 1)
    assert order[-1] == "state.json" and "extra.json" in order


def test_a_checkpoint_that_cannot_be_read_is_a_clear_error(tmp_path):
    path = save(tmp_path, 2)
    (path / "rng.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="cannot resume from .*step-000002"):
        load_checkpoint(path, FakeTrainer(), FakeSampler(0), RunState(tmp_path))


def test_a_policy_folder_is_replaced_whole_or_not_at_all(tmp_path):
    final = tmp_path / "final"

    def write(weights: bytes):
        def fill(folder: str) -> None:
            (tmp_path / folder).mkdir(parents=True, exist_ok=True)
            (tmp_path / folder / "model.safetensors").write_bytes(weights)

        return fill

    assert save_policy(final, write(b"v1")) == str(final)
    assert (final / "model.safetensors").read_bytes() == b"v1"

    def broken(folder: str) -> None:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="could not write the policy to .*final: OSError"):
        save_policy(final, broken)
    assert (final / "model.safetensors").read_bytes() == b"v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    save_policy(final, write(b"v2"))
    assert (final / "model.safetensors").read_bytes() == b"v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def fake_free_space(monkeypatch, free: list[int]):
    """``os.statvfs`` reporting ``free[0]`` bytes available (what a test changes as its disk fills)."""
    real = checkpoint.os.statvfs

    class Stat:
        f_frsize = 1

        @property
        def f_bavail(self):
            return free[0]

    monkeypatch.setattr(checkpoint.os, "statvfs", lambda path: Stat() if real(path) else None)


def test_a_checkpoint_that_cannot_fit_is_not_begun_and_says_how_much_space_it_needs(tmp_path, monkeypatch):
    save(tmp_path, 2)
    size = sum(p.stat().st_size for p in (tmp_path / "checkpoints" / "step-000002").rglob("*") if p.is_file())
    fake_free_space(monkeypatch, [size - 1])
    with pytest.raises(CheckpointError) as raised:
        save(tmp_path, 4)
    assert str(raised.value) == (
        f"could not write checkpoint step-000004: no space left on {mount_of(tmp_path)}: needed about {checkpoint.human(size)} "
        f"(the size of step-000002), free {checkpoint.human(size - 1)}; the previous checkpoint step-000002 is intact"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]
    monkeypatch.undo()
    trainer = FakeTrainer(0.0)
    assert load_checkpoint(complete_checkpoints(tmp_path)[-1], trainer, FakeSampler(0), RunState(tmp_path)).step == 2
    assert torch.equal(trainer.weights, torch.full((3,), 2.0))


@pytest.mark.parametrize("free_after", [10, 10**9])
def test_a_writers_own_error_on_a_full_disk_is_said_as_no_space(tmp_path, monkeypatch, free_after):
    """torch.save's C++ writer fails with "unexpected pos" and no errno: the free space tells."""
    free = [10**9]
    fake_free_space(monkeypatch, free)

    class FillingTrainer(FakeTrainer):
        def save_state(self, path: str) -> None:
            with open(path, "wb") as f:
                f.write(b"x" * 3000)
            free[0] = free_after
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4416 vs 4310")

    with pytest.raises(CheckpointError) as raised:
        save(tmp_path, 1, trainer=FillingTrainer())
    if free_after == 10:
        assert str(raised.value) == (
            f"could not write checkpoint step-000001: no space left on {mount_of(tmp_path)}: needed more than 3.0 kB, "
            "free 1.0 GB; no earlier checkpoint exists"
        )
    else:  # the disk is not full: the writer's error is what happened
        assert str(raised.value) == (
            "could not write checkpoint step-000001: RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 4416 "
            "vs 4310; no earlier checkpoint exists"
        )
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def mount_of(path):
    import os

    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


class SnapshotTrainer(FakeTrainer):
    """Declares ``state_snapshot``: its weights copied now, written later (as slowly as ``hold`` lets it)."""

    def __init__(self, value: float = 1.0, write=None) -> None:
        super().__init__(value)
        self.write = write

    def state_snapshot(self):
        copied = self.weights.clone()

        def write(path: str) -> None:
            if self.write is not None:
                self.write(path)
            torch.save({"w": copied}, path)

        return write


def test_a_background_write_holds_the_state_of_its_step_and_the_next_checkpoint_waits_for_it(tmp_path):
    import threading

    go = threading.Event()
    trainer = SnapshotTrainer(2.0, write=lambda path: go.wait(10))
    state = RunState(tmp_path, step=2)
    state.rng = capture_rng(FakeSampler(0))
    path = save_checkpoint(state, trainer, lambda d: None, keep=2, background=True)
    trainer.weights += 1  # the next step trains on while the checkpoint is written
    assert complete_checkpoints(tmp_path) == []  # not complete before its thread is done
    go.set()
    save(tmp_path, 4, trainer=trainer)  # waits for step 2's write first
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000002", "step-000004"]
    restored = FakeTrainer(0.0)
    load_checkpoint(path, restored, FakeSampler(0), RunState(tmp_path))
    assert torch.equal(restored.weights, torch.full((3,), 2.0))


def test_a_background_write_that_fails_is_said_at_the_next_wait_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def disk_full(path: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    save_checkpoint(RunState(tmp_path, step=2), SnapshotTrainer(write=disk_full), lambda d: None, keep=1, background=True)
    with pytest.raises(CheckpointError) as raised:
        checkpoint.wait_for_checkpoint(tmp_path)
    assert re.fullmatch(
        rf"could not write checkpoint step-000002: OSError: \[Errno 28\] No space left on device; no space left on {mount_of(tmp_path)}: "
        r"needed about [\d.]+ kB \(the size of step-000001\), free [\d.]+ [kMG]B; the previous checkpoint step-000001 is intact",
        str(raised.value),
    )
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000001"]
    checkpoint.wait_for_checkpoint(tmp_path)  # reported once


def test_without_a_snapshot_a_background_checkpoint_is_written_before_it_returns(tmp_path):
    state = RunState(tmp_path, step=3)
    save_checkpoint(state, FakeTrainer(3.0), lambda d: None, keep=2, background=True)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003"]
    assert tmp_path not in checkpoint.WRITING


@pytest.mark.parametrize(
    ("existing", "writes", "keep", "expected"),
    [
        (0, 5, 2, 3 * 100),  # keep + 1 at once while the newest is written
        (0, 1, 2, 100 + 40),  # one checkpoint, then final/ beside it
        (0, 0, 2, 40),
        (2, 3, 2, 100),  # a resumed run: its two checkpoints are on disk already
        (3, 1, 1, 0),  # fewer kept than there are: pruned, nothing more at once
    ],
)
def test_the_peak_counts_one_checkpoint_more_than_kept_and_final_beside_the_kept(existing, writes, keep, expected):
    assert checkpoint.peak_bytes(100, 40, existing, writes, keep) == expected


def test_the_estimate_counts_weights_moments_and_lora_adapters_only(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"model.embed_tokens.weight": torch.zeros(10, 4), "model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4)},
        tmp_path / "m.safetensors",
    )
    shapes = checkpoint.tensor_shapes(tmp_path)
    assert shapes == {"model.embed_tokens.weight": [10, 4], "model.layers.0.mlp.up_proj.weight": [6, 4]}
    assert checkpoint.estimated_bytes(shapes, 2, 0)[:2] == (64 * 2 + 64 * 8, 64 * 2)
    assert checkpoint.estimated_bytes(shapes, 4, 8)[:2] == (8 * (6 + 4) * (4 + 8), 64 * 4)
    # --optimizer-state 8bit: a byte per moment and a float32 absmax per 256; fsdp saves float32 master weights of a bf16 run.
    assert checkpoint.estimated_bytes(shapes, 2, 0, "8bit", 4) == (64 * 4 + 130, 64 * 2, "weights 0.3 kB + 8bit AdamW moments")
    assert checkpoint.estimated_bytes(shapes, 2, 0, "bf16")[0] == 64 * 2 + 64 * 4
    # auto (the default) chooses after the disk plan: counted as the largest it may choose.
    assert checkpoint.estimated_bytes(shapes, 2, 0, "auto") == checkpoint.estimated_bytes(shapes, 2, 0, "fp32")
    (tmp_path / "m.safetensors").write_bytes(b"\x08")
    assert checkpoint.tensor_shapes(tmp_path) is None
