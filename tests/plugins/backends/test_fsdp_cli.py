"""``grpo-core run --backend fsdp --backend-opt nproc=2`` end to end (gloo, CPU): it trains as the
local backend does, resumes bitwise after a SIGKILL, stops cleanly when a rank dies, and never
leaves a rank running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import SIGNAL, grpo_core, small_run_args

FSDP = ("--backend", "fsdp", "--backend-opt", "nproc=2")


def run_args(tiny_model_dir, tiny_dataset, run_dir, steps=3):
    args = small_run_args(tiny_model_dir, tiny_dataset, run_dir, *SIGNAL, "--checkpoint-every", "1", "--seed", "3")
    # A learning rate of 1e-3: AdamW's first steps move each weight by about lr whatever its
    # gradient, so the last digits of a tiny gradient (the one-pass forward here, a shared prompt
    # prefix in the local one) show up at lr scale; at 1e-3 well inside 1e-4.
    return [*args, "--max-steps", str(steps), "--loss-opt", "kl_beta=0.05", "--learning-rate", "1e-3"]


def final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def rank_pids(stderr: str) -> list[int]:
    found = re.search(r"ranks 1-\d+ are pids ([\d, ]+)\)", stderr)
    assert found, stderr
    return [int(p) for p in found.group(1).split(", ")]


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.time() + within
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.time() >= deadline:
            return False
        time.sleep(0.1)


def start(args):
    return subprocess.Popen([sys.executable, "-m", "grpo_core.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(path, proc, timeout=300.0):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)


@pytest.fixture(scope="module")
def whole_runs(tiny_model_dir, tiny_dataset, tmp_path_factory):
    """The same 3-step run on the local backend and on 2 fsdp ranks."""
    base = tmp_path_factory.mktemp("fsdp-cli")
    local = grpo_core(*run_args(tiny_model_dir, tiny_dataset, base / "local"))
    assert local.returncode == 0, local.stderr
    sharded = grpo_core(*run_args(tiny_model_dir, tiny_dataset, base / "fsdp"), *FSDP)
    assert sharded.returncode == 0, sharded.stderr
    return base, sharded


@pytest.mark.slow
def test_three_steps_end_where_the_local_backend_ends_and_no_rank_is_left(whole_runs, tiny_model_dir):
    from safetensors.torch import load_file

    base, sharded = whole_runs
    assert all(gone(pid, within=0.0) for pid in rank_pids(sharded.stderr))
    ours, theirs = final_weights(base / "fsdp"), final_weights(base / "local")
    assert set(ours) == set(theirs)
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert max(float((theirs[k] - initial[k]).abs().max()) for k in theirs) > 1e-3  # it trained
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    assert worst <= 1e-4, worst
    assert (base / "fsdp" / "checkpoints" / "step-000003" / "trainer" / "fsdp.json").is_file()


@pytest.mark.slow
def test_the_run_logs_entropy_as_the_local_one_and_says_its_rows_are_padded(whole_runs):
    import json

    from grpo_core.engine.sharded import UNPACKED

    base, _ = whole_runs
    ours, theirs = ([json.loads(line) for line in (base / run / "metrics.jsonl").read_text().splitlines()] for run in ("fsdp", "local"))
    assert len(ours) == len(theirs) == 3
    assert [m["perf/padding_free"] for m in ours] == [0.0] * 3
    for a, b in zip(ours, theirs):
        assert abs(a["policy/entropy"] - b["policy/entropy"]) <= 1e-4  # the weights drift apart within 1e-4
    info = json.loads((base / "fsdp" / "config.json").read_text())["run_info"]["trainer"]
    assert info["padding"] == f"sequences are padded ({UNPACKED})"


@pytest.mark.slow
def test_the_run_prints_its_memory_plan_and_logs_mfu_over_both_ranks_and_the_memory_peak(whole_runs):
    import json

    base, sharded = whole_runs
    plan = [line for line in sharded.stderr.splitlines() if line.startswith("memory plan:")]
    assert len(plan) == 1 and "on rank 0 (2 ranks on this host need" in plan[0], sharded.stderr
    assert sharded.stderr.index("memory plan:") < sharded.stderr.index("trainer: fsdp, 2 ranks")  # planned before the ranks start
    metrics = [json.loads(line) for line in (base / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert 0 < m["perf/mfu"] <= 1, m
        assert m["perf/peak_memory_gib"] > 0 and m["perf/train_tokens_per_s"] > 0
        # The tokens the ranks ran are every sequence whole (one pass): those core counted it was sent.
        assert m["perf/train_tokens_per_s"] == pytest.approx(m["train/forward_tokens"] / m["time/train"])


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two CUDA GPUs: one rank on each")
def test_on_two_gpus_each_rank_is_planned_for_its_gpu_and_mfu_is_over_both(tiny_model_dir, tiny_dataset, tmp_path):
    import json

    out = grpo_core(*small_run_args(tiny_model_dir, tiny_dataset, tmp_path / "r", "--device", "cuda"), *FSDP)
    assert out.returncode == 0, out.stderr
    assert "on rank 0 (one rank per GPU; the others hold the same less the sampler copy)" in out.stderr
    for m in [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]:
        assert 0 < m["perf/mfu"] <= 1 and m["perf/peak_memory_gib"] > 0, m
    info = json.loads((tmp_path / "r" / "config.json").read_text())["run_info"]["trainer"]
    assert info["mfu_peak"].startswith("2 ranks x ") and "torch.cuda.max_memory_allocated" in info["peak_memory"]


@pytest.mark.slow
def test_sigkill_of_rank0_then_resume_is_bitwise_the_unbroken_run(whole_runs, tiny_model_dir, tiny_dataset, tmp_path):
    base, _ = whole_runs
    killed = tmp_path / "killed"
    proc = start([*run_args(tiny_model_dir, tiny_dataset, killed), *FSDP])
    wait_for(killed / "checkpoints" / "step-000001" / "state.json", proc)
    proc.send_signal(signal.SIGKILL)  # rank 0 only: the rank it started must die with it
    proc.wait()
    assert not (killed / "final").exists()
    assert all(gone(pid) for pid in rank_pids(proc.stderr.read()))
    resumed = grpo_core("run", "--resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr
    ours, unbroken = final_weights(killed), final_weights(base / "fsdp")
    assert all(torch.equal(ours[k], unbroken[k]) for k in unbroken)


@pytest.mark.slow
def test_a_rank_killed_mid_run_stops_it_with_a_message_and_a_loadable_checkpoint(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*run_args(tiny_model_dir, tiny_dataset, run_dir, steps=6), *FSDP])
    # The rank's pid is said before the first step; kill it once a step is saved.
    wait_for(run_dir / "checkpoints" / "step-000001" / "state.json", proc)
    pids = []
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as children:
        pids = [int(p) for p in children.read().split()]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert f"rank 1 of 2 (pid {pids[0]}) died (killed by SIGKILL)" in stderr
    assert "the newest valid one is" in stderr or "previous checkpoint" in stderr or "are saved in" in stderr, stderr
    resumed = grpo_core("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert all(gone(pid, within=0.0) for pid in rank_pids(resumed.stderr))
    assert (run_dir / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_embedded_default_with_seed_1_ends_where_the_local_backend_ends(tmp_path):
    runs = {}
    for name, extra in (("local", ()), ("fsdp", FSDP)):
        out = grpo_core("run", "--max-steps", "3", "--seed", "1", "--run-dir", str(tmp_path / name), *extra)
        assert out.returncode == 0, out.stderr
        runs[name] = final_weights(tmp_path / name)
    worst = max(float((runs["fsdp"][k] - runs["local"][k]).abs().max()) for k in runs["local"])
    assert worst <= 1e-3, worst


@pytest.mark.slow
def test_a_run_killed_at_two_ranks_resumes_on_three_where_the_unbroken_run_ends(whole_runs, tiny_model_dir, tiny_dataset, tmp_path):
    base, _ = whole_runs
    killed = tmp_path / "killed"
    proc = start([*run_args(tiny_model_dir, tiny_dataset, killed), *FSDP])
    wait_for(killed / "checkpoints" / "step-000001" / "state.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = grpo_core("run", "--resume", str(killed), "--backend-opt", "nproc=3")
    assert resumed.returncode == 0, resumed.stderr
    assert "trainer: fsdp, 3 ranks" in resumed.stderr
    assert re.search(r"written by 2 ranks: resharded for 3", resumed.stderr), resumed.stderr
    ours, unbroken = final_weights(killed), final_weights(base / "fsdp")
    # DCP reads the shards back exactly; the steps after it sum 3 ranks' gradients instead of 2:
    # float32 rounding of the reduction, within 1e-5 after AdamW's steps of about lr = 1e-3.
    worst = max(float((ours[k] - unbroken[k]).abs().max()) for k in unbroken)
    assert worst <= 1e-5, worst
    refused = grpo_core("run", "--resume", str(killed), "--backend-opt", "attn_implementation=eager", "--max-steps", "4")
    assert refused.returncode != 0 and "fsdp.attn_implementation cannot change" in refused.stderr


@pytest.mark.slow
def test_bf16_runs_on_two_ranks_and_ends_within_bf16_rounding_of_the_local_bf16_run(tiny_model_dir, tiny_dataset, tmp_path):
    import json

    from safetensors.torch import load_file

    from tests.plugins.backends.test_fsdp_bf16 import assert_bf16_weights_close

    steps = 2
    for name, extra in (("local", ()), ("fsdp", FSDP)):
        out = grpo_core(*run_args(tiny_model_dir, tiny_dataset, tmp_path / name, steps=steps), "--dtype", "bfloat16", *extra)
        assert out.returncode == 0, out.stderr
    ours, theirs = final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "local")
    assert all(w.dtype == torch.bfloat16 for w in ours.values())
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert_bf16_weights_close(ours, theirs, initial, 1e-3, steps)
    metrics = [[json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] for name in ("fsdp", "local")]
    for a, b in zip(*metrics):  # the same samples (seed 3); bf16 logprobs within rounding
        assert a["reward/total"] == b["reward/total"]
        assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-2, abs=1e-3)


CHECKPOINTED = """
import sys, torch, tinker
from grpo_core.config import RunConfig
from grpo_core.plugins.backends import fsdp
folder, model = sys.argv[1], sys.argv[2]
backend = fsdp.FSDPBackend(nproc=2, attn_implementation="eager")
trainer = backend.make_trainer(config=RunConfig(model=model, gradient_checkpointing=True))
datums = [tinker.Datum(model_input=tinker.ModelInput.from_ints([5, 6, 7, 8 + i]),
                       loss_fn_inputs={"target_tokens": [6, 7, 8 + i, 9], "weights": [0.0, 1.0, 1.0, 1.0]}) for i in range(5)]
calls = []
mlp = trainer.group.local.models["policy"].lm.model.layers[0].mlp
mlp.forward = lambda *a, _f=mlp.forward, **k: calls.append(1) or _f(*a, **k)
trainer.forward_backward_custom(datums, lambda ds, lps: (sum((lp * lp).sum() for lp in lps) / 10, {}))
trainer.optim_step(tinker.AdamParams(learning_rate=1e-2))
lm = trainer.group.local.models["policy"].lm
torch.save({"calls": len(calls), "weights": trainer.full_state_dict(), "attention": lm.config._attn_implementation}, folder + "/out.pt")
"""


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_each_layer_and_trains_as_without_and_attention_is_the_option(tiny_model_dir, tmp_path):
    import tinker

    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend

    out = subprocess.run([sys.executable, "-c", CHECKPOINTED, str(tmp_path), str(tiny_model_dir)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = torch.load(tmp_path / "out.pt")
    assert result["calls"] == 2  # the forward, then its recomputation in backward
    assert result["attention"] == "eager"  # the attn_implementation option (auto: sdpa for Qwen3)
    local = LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir)))
    datums = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints([5, 6, 7, 8 + i]),
            loss_fn_inputs={"target_tokens": [6, 7, 8 + i, 9], "weights": [0.0, 1.0, 1.0, 1.0]},
        )
        for i in range(5)
    ]
    local.forward_backward_custom(datums, lambda ds, lps: (sum((lp * lp).sum() for lp in lps) / 10, {}))
    local.optim_step(tinker.AdamParams(learning_rate=1e-2))
    expected = local.model.state_dict()
    assert max(float((result["weights"][k] - expected[k]).abs().max()) for k in expected) <= 1e-5


@pytest.mark.slow
def test_sigterm_to_the_process_group_ends_after_the_step_with_a_checkpoint(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_core.cli", *run_args(tiny_model_dir, tiny_dataset, run_dir, steps=20), *FSDP],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    wait_for(run_dir / "checkpoints" / "step-000001" / "state.json", proc)
    os.killpg(proc.pid, signal.SIGTERM)  # every rank gets it, as from a job scheduler
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    assert (run_dir / "final" / "model.safetensors").is_file()
    steps = [p.name for p in (run_dir / "checkpoints").glob("step-*")]
    assert steps and max(steps) < "step-000020"
    assert all(gone(pid) for pid in rank_pids(stderr))


@pytest.mark.slow
def test_torchrun_starts_the_same_run(whole_runs, tiny_model_dir, tiny_dataset, tmp_path):
    base, _ = whole_runs
    args = run_args(tiny_model_dir, tiny_dataset, tmp_path / "torchrun")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "grpo_core.cli"]
    out = subprocess.run([*torchrun, *args, "--backend", "fsdp"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    ours, spawned = final_weights(tmp_path / "torchrun"), final_weights(base / "fsdp")
    assert all(torch.equal(ours[k], spawned[k]) for k in spawned)
    refused = subprocess.run([*torchrun, *args, "--backend", "local", "--overwrite"], capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "--backend local trains in one" in refused.stderr
