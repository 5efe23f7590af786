"""The fsdp backend in this process as rank 0, with one spawned rank (gloo, 2 ranks): a step of
every loss equals the one-process local step; checkpoints and the sampler's policy."""

from __future__ import annotations

import pytest
import tinker
import torch

from grpo_core import make_plugin
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig, SFTConfig
from grpo_core.engine.sharded import shares
from grpo_core.errors import PluginError
from grpo_core.loss import AGGREGATIONS
from grpo_core.plugins.backends.fsdp import FSDPBackend
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import train_on_groups
from tests.core.off_policy import LOSS_CONFIGS, off_policy_samples

LEARNING_RATE = 1e-3


@pytest.fixture(scope="module")
def fsdp(tiny_model_dir, tmp_path_factory):
    """A 2-rank fsdp trainer and reference, and a checkpoint of their start to reset the trainer to."""
    config = RunConfig(model=str(tiny_model_dir), max_completion_tokens=8, grad_clip_norm=1.0)
    backend = FSDPBackend(nproc=2)
    trainer = backend.make_trainer(config=config)
    reference = backend.make_reference(config=config, trainer=trainer)
    start = tmp_path_factory.mktemp("fsdp") / "start"
    trainer.save_state(str(start))
    yield config, trainer, reference, str(start)
    workers = list(trainer.group.workers)
    trainer.close()
    assert all(w.poll() is not None for w in workers)  # no rank is left running


def one_step(trainer, reference, config, loss_name, options, tis):
    samples = off_policy_samples(trainer.tokenizer)
    plugins = [make_plugin(f"loss.{loss_name}", **options)] + ([make_plugin("tis", cap=1.5, icepop=3.0)] if tis else [])
    return train_on_groups(build_manager(plugins), trainer, reference, [samples], config, LEARNING_RATE)


CASES = [(name, {**options, "agg": agg}) for name, options in LOSS_CONFIGS.items() for agg in AGGREGATIONS] + [
    ("grpo", {"kl_beta": 0.0}),  # without KL (the grpo cases above have it)
]


@pytest.mark.parametrize("tis", [False, True], ids=["alone", "tis"])
@pytest.mark.parametrize(("loss_name", "options"), CASES, ids=[f"{n}-{o.get('agg', 'kl0')}" for n, o in CASES])
def test_one_step_equals_the_one_process_step(fsdp, tiny_model_dir, loss_name, options, tis):
    config, trainer, reference, start = fsdp
    trainer.load_state(start)
    # fsdp pads its rows (perf/padding_free 0): the local trainer as it runs with padding_free=false.
    local = LocalBackend(padding_free=False).make_trainer(config=config)
    local_reference = LocalBackend(padding_free=False).make_reference(config=config, trainer=local)
    needs_reference = make_plugin(f"loss.{loss_name}", **options).needs_reference
    ours = one_step(trainer, reference if needs_reference else None, config, loss_name, options, tis)
    theirs = one_step(local, local_reference if needs_reference else None, config, loss_name, options, tis)
    assert set(ours) == set(theirs)
    assert ours["perf/padding_free"] == theirs["perf/padding_free"] == 0.0
    assert abs(ours["policy/entropy"] - theirs["policy/entropy"]) <= 1e-5
    differ = {k: (ours[k], theirs[k]) for k in ours if ours[k] != pytest.approx(theirs[k], rel=1e-5, abs=1e-6)}
    assert not differ, differ
    assert trainer.version == local.version == 1
    weights, expected = trainer.full_state_dict(), local.model.state_dict()
    assert set(weights) == set(expected)
    moved = max(float((expected[k] - v).abs().max()) for k, v in LocalBackend().make_trainer(config=config).model.state_dict().items())
    assert moved > 10 * 1e-5  # the step changed the weights by more than the tolerance
    worst = max(float((weights[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= 1e-5, worst


def test_forward_of_fewer_sequences_than_ranks_and_of_none(fsdp):
    config, trainer, reference, start = fsdp
    trainer.load_state(start)
    local = LocalBackend().make_trainer(config=config)
    datums = [sample_to_datum(s) for s in off_policy_samples(trainer.tokenizer)]
    assert trainer.forward([]) == []
    for part in ([datums[0]], datums):
        ours, theirs = trainer.forward(part), local.forward(part)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert torch.allclose(a, b, atol=1e-5), (a, b)
    assert shares(list(range(5)), 2) == [[0, 1], [2, 3, 4]] and shares([1], 2) == [[], [1]]


def test_entropy_of_uneven_shares_is_the_mean_over_all_trained_tokens(fsdp):
    config, trainer, reference, start = fsdp
    trainer.load_state(start)
    local = LocalBackend(padding_free=False).make_trainer(config=config)
    datums = [sample_to_datum(s) for s in off_policy_samples(trainer.tokenizer)]
    # One datum: rank 0 scores none. Three: the ranks' shares hold different numbers of trained tokens.
    per_rank = [sum(sum(d.loss_fn_inputs["weights"].data) for d in share) for share in shares(datums[:3], 2)]
    assert per_rank[0] != per_rank[1]  # a plain mean of the ranks' means would differ

    def loss(d, lps):
        return sum(lp.sum() for lp in lps), {}

    for part in ([datums[0]], datums[:3], datums):
        ours = trainer.forward_backward_custom(part, loss).metrics["policy/entropy"]
        theirs = local.forward_backward_custom(part, loss).metrics["policy/entropy"]
        assert abs(ours - theirs) <= 1e-5, (len(part), ours, theirs)
    untrained = [sample_to_datum(s) for s in off_policy_samples(trainer.tokenizer)[:3]]
    for d in untrained:
        d.loss_fn_inputs["weights"] = tinker.TensorData.from_torch(torch.zeros(len(d.loss_fn_inputs["weights"].data)))
    out = trainer.forward_backward_custom(untrained, lambda d, lps: (sum(lp.sum() for lp in lps) * 0, {}))
    assert out.metrics["policy/entropy"] != out.metrics["policy/entropy"]  # NaN: a mean of nothing


def test_a_nonfinite_loss_skips_the_step_and_a_failing_loss_leaves_the_ranks_in_step(fsdp):
    config, trainer, reference, start = fsdp
    trainer.load_state(start)
    datums = [sample_to_datum(s) for s in off_policy_samples(trainer.tokenizer)]
    before = trainer.full_state_dict()
    out = trainer.forward_backward_custom(datums, lambda d, lps: (sum(lp.sum() for lp in lps) * float("nan"), {}))
    assert out.metrics["loss"] != out.metrics["loss"]  # NaN
    metrics = trainer.optim_step(tinker.AdamParams(learning_rate=1e-2))
    assert metrics["optim/skipped_nonfinite"] == 1.0 and trainer.version == 0
    after = trainer.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    def failing(d, lps):
        raise ValueError("this loss fails")

    with pytest.raises(ValueError, match="this loss fails"):
        trainer.forward_backward_custom(datums, failing)
    assert trainer.group.broken is None
    assert len(trainer.forward(datums)) == len(datums)  # the ranks take the next command


def test_state_resumes_exactly_and_sampler_policy_loads_in_transformers(fsdp, tmp_path):
    from transformers import AutoModelForCausalLM

    config, trainer, reference, start = fsdp
    trainer.load_state(start)
    datums = [sample_to_datum(s) for s in off_policy_samples(trainer.tokenizer)]
    adam = tinker.AdamParams(learning_rate=1e-2)

    def step():
        trainer.forward_backward_custom(datums, lambda d, lps: (sum((lp * lp).sum() for lp in lps) / 100, {}))
        trainer.optim_step(adam)

    step()
    trainer.save_state(str(tmp_path / "one"))
    step()
    two = trainer.full_state_dict()
    trainer.load_state(str(tmp_path / "one"))
    assert trainer.version == 1
    step()
    again = trainer.full_state_dict()
    assert all(torch.equal(two[k], again[k]) for k in two)  # bitwise: the AdamW state came back too

    trainer.save_weights_for_sampler(str(tmp_path / "policy"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert model.dtype == torch.float32
    local = LocalBackend().make_trainer(config=RunConfig(model=str(tmp_path / "policy")))
    for a, b in zip(trainer.forward(datums), local.forward(datums)):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(PluginError, match="not a checkpoint of the fsdp trainer"):
        trainer.load_state(str(tmp_path / "policy"))


def test_the_local_sampler_samples_from_a_copy_kept_current(fsdp):
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    config, trainer, reference, start = fsdp
    trainer.load_state(start)
    sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=trainer)
    datums = [sample_to_datum(s) for s in off_policy_samples(trainer.tokenizer)]
    trainer.forward_backward_custom(datums, lambda d, lps: (sum(lp.sum() for lp in lps), {}))
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-2))
    sampler.load_weights_from(trainer)
    assert sampler.version == trainer.version == 1
    weights = trainer.full_state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in sampler.model.state_dict().items())
    trainer.sampling_copy = None  # the other tests train without one


@pytest.mark.parametrize(
    ("settings", "options", "env", "message"),
    [
        ({}, {"nproc": 1}, {}, "use --backend local"),
        ({}, {}, {}, "nproc=N"),
        ({"lora_rank": 8}, {"nproc": 2}, {}, "LoRA runs on --backend local"),
        ({}, {"nproc": 2}, {"WORLD_SIZE": "2"}, "leave nproc out"),
        ({}, {}, {"WORLD_SIZE": "1"}, "use --backend local"),
        ({"optimizer_state": "bf16"}, {"nproc": 2}, {}, "--optimizer-state bf16: the fsdp backend keeps float32 AdamW moments"),
        ({"optimizer_state": "8bit"}, {"nproc": 2}, {}, "use --backend local for them, or --backend-opt cpu_offload=true"),
        (
            {"device": "cpu"},
            {"nproc": 2, "cpu_offload": True},
            {},
            "cpu_offload=true moves the shards .* on a CPU run they are in host memory already",
        ),
    ],
)
def test_refusals_come_before_anything_loads(tiny_model_dir, monkeypatch, settings, options, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = RunConfig(model=str(tiny_model_dir), **settings)
    with pytest.raises(PluginError, match=message):
        FSDPBackend(**options).check_config(config=config)


def test_the_backends_refusals_come_in_check_config_before_the_data_loads(tiny_model_dir, tmp_path):
    from tests.helpers import grpo_core_in_process, small_run_args

    data = tmp_path / "no-such-data.jsonl"
    args = small_run_args(tiny_model_dir, data, tmp_path / "r", "--backend", "fsdp", "--no-memory-check")
    out = grpo_core_in_process(*args, "--backend-opt", "nproc=1")
    assert (out.returncode, out.stderr.strip().splitlines()) == (
        1,
        ["error: --backend fsdp with one rank shards nothing: use --backend local"],
    )
    # --no-memory-check is the fsdp plan's override too: accepted, the run stops at the missing data.
    out = grpo_core_in_process(*args, "--backend-opt", "nproc=2")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and str(data) in out.stderr, out.stderr


def test_resume_may_change_nproc_and_no_other_option_of_the_backend(tmp_path):
    from grpo_core.config import load
    from grpo_core.plugins_manager import write_config
    from grpo_core.resume import load_resumed

    opts = ["nproc=2", "attn_implementation=eager"]
    write_config(load(None, {"backend": "fsdp"}, {"backend": opts}), tmp_path / "config.json")
    resumed = load_resumed(str(tmp_path), {}, {"backend": ["nproc=3"]})
    assert resumed.plugin_options["backend"]["fsdp"] == {"nproc": 3, "attn_implementation": "eager"}
    with pytest.raises(PluginError, match="option 'nproc' of backend 'fsdp': expected an integer, got 'many'"):
        load_resumed(str(tmp_path), {}, {"backend": ["nproc=many"]})
    with pytest.raises(PluginError, match="fsdp.attn_implementation cannot change"):
        load_resumed(str(tmp_path), {}, {"backend": ["attn_implementation=sdpa"]})


def test_a_negative_nproc_is_refused():
    with pytest.raises(ValueError, match="nproc must be >= 2"):
        FSDPBackend(nproc=-1)


def test_cuda_needs_a_gpu_per_rank(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(PluginError, match="2 ranks here, 1 GPUs"):
        FSDPBackend(nproc=2).check_config(config=RunConfig(model=str(tiny_model_dir), device="cuda"))


def test_perf_counters_count_every_ranks_tokens_against_the_worlds_peak(fsdp):
    from grpo_core.engine.perf import peak_flops, peak_memory_gib

    config, trainer, reference, start = fsdp
    trainer.load_state(start)
    trainer.perf_counters()  # the tests before trained: a fresh count
    datums = [sample_to_datum(s) for s in off_policy_samples(trainer.tokenizer)]
    trainer.forward(datums)  # no gradient: not training tokens
    for part in shares(datums, 2):
        trainer.forward_backward_custom(part, lambda d, lps: (sum(lp.sum() for lp in lps), {}))
    counters = trainer.perf_counters()
    # One pass over each whole sequence, on whichever rank: a shared prompt runs once per row.
    assert counters["forward_tokens"] == sum(d.model_input.length for d in datums)
    assert trainer.perf_counters()["forward_tokens"] == 0.0  # read once
    local = LocalBackend().make_trainer(config=config)
    assert counters["parameters"] == sum(p.numel() for p in local.model.parameters())
    assert counters["peak_flops"] == 2 * peak_flops(torch.device("cpu"), torch.float32)[0]
    assert counters["peak_memory_gib"] >= peak_memory_gib(torch.device("cpu")) > 0  # rank 0's peak, or rank 1's if larger
    info = trainer.run_info
    assert info["mfu_peak"].startswith("2 ranks x this CPU's float32") and info["peak_memory"].startswith("the largest over the ranks")


def test_the_memory_peak_is_the_largest_ranks(monkeypatch):
    from grpo_core.engine.sharded import ShardedRank

    cpu = torch.device("cpu")
    rank0, rank1 = ShardedRank(0, 3, cpu, None), ShardedRank(1, 3, cpu, None)
    monkeypatch.setattr(ShardedRank, "gather", lambda self, peak: [1.5, 4.0, 2.0] if self.rank == 0 else None)
    assert rank0.largest_peak_memory_gib() == 4.0 and rank1.largest_peak_memory_gib() is None


def test_a_plan_that_cannot_fit_is_refused_before_any_rank_starts(tiny_model_dir, monkeypatch, capsys):
    from grpo_core.engine import memory_plan
    from grpo_core.plugins.backends import fsdp

    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 1000)
    monkeypatch.setattr(fsdp, "start_group", lambda *a, **k: pytest.fail("started ranks for a run that cannot fit"))
    with pytest.raises(PluginError, match=r"^memory plan: peak [\d.]+ GB in training \(.*\) on rank 0 \(2 ranks on this host need"):
        FSDPBackend(nproc=2).make_trainer(config=RunConfig(model=str(tiny_model_dir)))
    assert "trainer: fsdp" not in capsys.readouterr().err
    with pytest.raises(PluginError) as refused:
        FSDPBackend(nproc=2).make_trainer(config=SFTConfig(model=str(tiny_model_dir)), needs_reference=False)
    # sft samples nothing and has no reference: rank 0 plans no copy for a sampler, no reference's shard.
    said = str(refused.value)
    assert "sampler" not in said and "reference" not in said and "on rank 0 (2 ranks on this host need" in said, said
