"""The local trainer's state snapshot: what a background checkpoint writes, taken between steps."""

from __future__ import annotations

import threading

import pytest
import tinker
import torch

from grpo_core import SamplingParams
from grpo_core.backend import NonFiniteWeights, sample_to_datum
from grpo_core.checkpoint import complete_checkpoints
from grpo_core.engine import trainer as engine_trainer
from grpo_core.engine.trainer import SavedState, read_trainer_state
from tests.helpers import SIGNAL, grpo_core_in_process, small_run_args
from tests.plugins.backends.local_parts import make, prompts_of, to_samples

needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU: host copies of device tensors")]


def fixed_datums(trainer, sampler):
    prompts = prompts_of(trainer.tokenizer)
    samples = to_samples(prompts, sampler.sample(prompts, 2, SamplingParams(max_tokens=6, temperature=1.0)))
    return [sample_to_datum(s) for s in samples]


def step(trainer, datums):
    trainer.forward_backward_custom(datums, lambda d, lps: (-sum(lp.sum() for lp in lps), {}))
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-2, weight_decay=0.1))


def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    "settings",
    [
        {"dtype": "float32", "optimizer_state": "fp32"},  # torch's fused AdamW: its step counts are tensors
        {"dtype": "bfloat16", "optimizer_state": "bf16"},
        {"dtype": "float32", "optimizer_state": "8bit"},
        {"dtype": "float32", "optimizer_state": "fp32", "lora_rank": 4},  # adapters only
        pytest.param({"dtype": "bfloat16", "optimizer_state": "offload", "device": "cuda"}, marks=needs_cuda),
        pytest.param({"dtype": "float32", "optimizer_state": "8bit", "device": "cuda"}, marks=needs_cuda),
    ],
    ids=["fp32", "bf16", "8bit", "lora", "cuda-offload", "cuda-8bit"],
)
def test_a_snapshot_written_after_later_steps_is_byte_identical_to_save_state_at_its_time_and_resumes_bitwise(
    tiny_model_dir, tmp_path, monkeypatch, settings
):
    monkeypatch.setattr(engine_trainer, "SHARD_SIZE", "40KB")  # several shards: their layout is compared too
    _, _, trainer, sampler = make(tiny_model_dir, seed=0, **settings)
    datums = fixed_datums(trainer, sampler)
    trainer.save_state(str(tmp_path / "saved-0"))
    write_0 = trainer.state_snapshot()  # no optimizer yet
    step(trainer, datums)
    trainer.save_state(str(tmp_path / "saved-1"))
    write_1 = trainer.state_snapshot()
    step(trainer, datums)  # changes the weights and moments in place
    after_2 = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    step(trainer, datums)
    write_1(str(tmp_path / "snapshot-1"))
    write_0(str(tmp_path / "snapshot-0"))
    for version in (0, 1):
        saved, written = files_of(tmp_path / f"saved-{version}"), files_of(tmp_path / f"snapshot-{version}")
        assert saved.keys() == written.keys()
        assert all(saved[name] == written[name] for name in saved), [name for name in saved if saved[name] != written[name]]
    assert len([name for name in written if name.startswith("optimizer") and name.endswith(".safetensors")]) > 1
    assert read_trainer_state(tmp_path / "snapshot-1")["version"] == 1
    assert not any(name.startswith("optimizer") for name in files_of(tmp_path / "snapshot-0"))
    # Resumed from the snapshot, the second step is the one the trainer took.
    _, _, resumed, _ = make(tiny_model_dir, seed=0, **settings)
    resumed.load_state(str(tmp_path / "snapshot-1"))
    step(resumed, datums)
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, after_2[name]), name


def test_a_snapshot_holds_host_copies_with_tied_weights_stored_once(tiny_model_dir, tmp_path):
    _, _, trainer, sampler = make(tiny_model_dir)
    step(trainer, fixed_datums(trainer, sampler))
    live = trainer._saved_state()
    copied = live.on_host()
    assert copied.aliases == live.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert copied.weights["lm_head.weight"] is copied.weights["model.embed_tokens.weight"]
    tensors = [*copied.weights.values(), *(v for s in copied.optimizer["state"].values() for v in s.values() if torch.is_tensor(v))]
    live_pointers = {t.data_ptr() for t in live.weights.values()} | {
        v.data_ptr() for s in live.optimizer["state"].values() for v in s.values() if torch.is_tensor(v)
    }
    assert all(t.device.type == "cpu" and t.data_ptr() not in live_pointers for t in tensors)
    assert list(copied.weights) == list(live.weights)  # the shards' layout follows the order
    # The optimizer's per-parameter dicts are its own: a later step does not reach the copy.
    assert all(copied.optimizer["state"][i] is not live.optimizer["state"][i] for i in live.optimizer["state"])
    copied.write(str(tmp_path / "twice"))
    copied.write(str(tmp_path / "twice"))  # writing does not consume it
    assert "lm_head.weight" in copied.weights


def test_a_snapshot_of_non_finite_weights_is_refused_before_anything_is_copied(tiny_model_dir, monkeypatch):
    _, _, trainer, _ = make(tiny_model_dir)
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("nan")
    copied = []
    monkeypatch.setattr(SavedState, "on_host", lambda self: copied.append(self))
    with pytest.raises(NonFiniteWeights, match="the policy's weights hold NaN or inf: the checkpoint not written"):
        trainer.state_snapshot()
    assert copied == []


def test_a_runs_periodic_checkpoints_are_written_by_a_thread_while_training_goes_on(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    """Step 1's checkpoint is written only once step 2 has trained: it holds step 1's weights."""
    from grpo_core.engine.trainer import LocalTrainer

    stepped_twice, writers = threading.Event(), []
    optim_step, write = LocalTrainer.optim_step, SavedState.write

    def counting_step(self, adam_params):
        metrics = optim_step(self, adam_params)
        if self.version == 2:
            stepped_twice.set()
        return metrics

    def late_write(self, path):
        writers.append((threading.current_thread().name, self.version))
        if self.version == 1:
            assert stepped_twice.wait(60), "step 1's checkpoint was written before step 2 trained"
        write(self, path)

    monkeypatch.setattr(LocalTrainer, "optim_step", counting_step)
    monkeypatch.setattr(SavedState, "write", late_write)
    run_dir = tmp_path / "run"
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, *SIGNAL, "--checkpoint-every", "1", "--keep-checkpoints", "2")
    out = grpo_core_in_process(*args)
    assert out.returncode == 0, out.stderr
    # Periodic ones in the background; the last step's in place (its end would wait for a copy at once).
    assert writers == [("checkpoint-write", 1), ("MainThread", 2)]
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step-000001", "step-000002"]
    first, second = (read_trainer_state(c / "trainer") for c in complete_checkpoints(run_dir))
    assert (first["version"], second["version"]) == (1, 2)
    assert any(not torch.equal(first["model"][k], second["model"][k]) for k in first["model"])


@pytest.mark.slow
def test_a_run_that_fails_while_a_checkpoint_is_written_waits_for_it_and_resumes_from_it(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch
):
    from grpo_core import lifecycle
    from grpo_core.lifecycle import RunFailed
    from grpo_core.train import run
    from tests.core import test_resume
    from tests.core.test_resume import BROKEN_AT_STEP, config

    test_resume.test_plugins.__wrapped__(monkeypatch)  # its ``length`` reward, broken at a chosen step
    failing, write, save_after_failure = threading.Event(), SavedState.write, lifecycle.save_after_failure

    def write_once_failing(self, path):
        if self.version == 2:
            assert failing.wait(60), "step 2's checkpoint was written before step 3 failed"
        write(self, path)

    def saving_after_failure(*args):
        failing.set()
        return save_after_failure(*args)

    monkeypatch.setattr(SavedState, "write", write_once_failing)
    monkeypatch.setattr(lifecycle, "save_after_failure", saving_after_failure)
    run_dir = tmp_path / "r"
    BROKEN_AT_STEP["step"] = 3
    with pytest.raises(RunFailed) as caught:
        run(config(tiny_model_dir, tiny_dataset, run_dir, checkpoint_every=1, max_steps=4))
    assert "returned 1 scores for 4 samples" in str(caught.value.cause)
    saved = f"steps 1-2 are saved in {run_dir}/checkpoints/step-000002; continue with: grpo-core run --resume {run_dir}"
    assert caught.value.saved == saved
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step-000001", "step-000002"]
    assert read_trainer_state(run_dir / "checkpoints" / "step-000002" / "trainer")["version"] == 2
    BROKEN_AT_STEP.clear()
    assert run(config(tiny_model_dir, tiny_dataset, run_dir, checkpoint_every=1, max_steps=4), resume=True)["steps"] == 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU")
def test_a_gpu_snapshot_is_copied_into_pinned_host_memory_and_complete_on_return():
    tensors = [torch.randn(1000, device="cuda"), torch.randn(3, 5, device="cuda").bfloat16(), torch.randn(4)]
    copies = engine_trainer.host_copies(tensors)
    assert [c.device.type for c in copies] == ["cpu"] * 3
    assert copies[0].is_pinned() and copies[1].is_pinned()  # non-blocking device copies land in pinned memory
    assert all(torch.equal(c, t.cpu()) for c, t in zip(copies, tensors))
    tensors[0].add_(1)  # a later in-place step leaves the snapshot as it was
    assert not torch.equal(copies[0], tensors[0].cpu())


def test_moments_auto_chose_resume_in_the_checkpoints_form_and_an_explicit_other_form_is_refused(tiny_model_dir, tmp_path, capsys):
    """A run auto put in 8-bit moments (a tighter device) resumes where auto would choose fp32."""
    _, _, first, sampler = make(tiny_model_dir, seed=0, dtype="float32", optimizer_state="8bit")
    datums = fixed_datums(first, sampler)
    step(first, datums)
    first.save_state(str(tmp_path / "saved"))
    step(first, datums)  # the uninterrupted run's next step
    _, _, resumed, _ = make(tiny_model_dir, seed=0, dtype="float32")
    assert (resumed.optimizer_state, resumed.optimizer_state_chosen) == ("fp32", True)
    capsys.readouterr()
    resumed.load_state(str(tmp_path / "saved"))
    assert resumed.optimizer_state == "8bit"
    assert "optimizer state: 8bit moments, as the checkpoint keeps them (auto chose fp32 for this device" in capsys.readouterr().err
    step(resumed, datums)
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), resumed.model.parameters()))
    _, _, explicit, _ = make(tiny_model_dir, seed=0, dtype="float32", optimizer_state="bf16")
    with pytest.raises(ValueError, match="resume with the --optimizer-state it was saved with"):
        explicit.load_state(str(tmp_path / "saved"))
    assert engine_trainer.saved_moments({"state": {}}) is None
