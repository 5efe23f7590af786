"""--router-replay: the local sampler records each token's experts, the local trainer forces them
(R3) or those of its own pi_old forward (R2), and the step reports how routing agrees (moe/*)."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_core import Sample, SamplingParams
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.engine.moe_routing import routers
from grpo_core.engine.trainer import LocalTrainer
from grpo_core.errors import PluginError
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSampler, LocalSamplerPlugin
from grpo_core.preflight import check_router_replay
from grpo_core.train import run
from tests.plugins.backends.moe_models import MOE_FAMILIES, build_tiny_moe
from tests.plugins.backends.routed_samples import loss_fn, sampled, with_routes

FAMILIES = sorted(MOE_FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_moe(request.param, path)
    return path


def make(model_dir, **config):
    cfg = RunConfig(model=str(model_dir), **config)
    trainer = LocalBackend().make_trainer(config=cfg)
    sampler = LocalSamplerPlugin().make_sampler(config=cfg, trainer=trainer)
    return trainer, sampler


def test_the_sampler_records_what_the_trainer_routes_exactly_in_fp32(moe_dir):
    trainer, sampler = make(moe_dir, dtype="float32")
    samples = sampled(trainer, sampler)
    for s in samples:
        assert s.routed_experts.dtype == torch.uint8 and s.routed_experts.shape == (len(s.tokens) - 1, 2, 2)
    _, recorded = trainer.forward_routed([sample_to_datum(s) for s in samples])
    for s, r in zip(samples, recorded):
        assert torch.equal(r, s.routed_experts)


def test_a_dense_model_samples_without_routes(tiny_model_dir):
    trainer, sampler = make(tiny_model_dir, dtype="float32")
    assert sampler.routing_problem == trainer.routing_problem == "model type 'qwen3' has no mixture-of-experts layers"
    groups = sampler.sample([[1, 2, 3]], 2, SamplingParams(max_tokens=3))
    assert all(c.routed_experts is None for c in groups[0])
    sample = Sample(None, [1, 2, 3, 4], [0.0] * 4, [0.0, 0.0, 1.0, 1.0], "", "stop", 0)
    with pytest.raises(ValueError, match="datums carry routed_experts to replay, but model type 'qwen3' has no"):
        trainer.forward(with_routes([sample], [torch.zeros(3, 2, 2, dtype=torch.uint8)]))


def test_the_trainer_forces_the_routes_a_datum_carries_and_the_router_keeps_a_gradient(moe_dir):
    trainer, sampler = make(moe_dir, dtype="float32")
    samples = sampled(trainer, sampler)
    other = [((s.routed_experts.long() + 1) % 8).to(torch.uint8) for s in samples]  # never what the routers chose
    plain = trainer.forward_backward_custom([sample_to_datum(s) for s in samples], loss_fn)
    trainer.model.zero_grad(set_to_none=True)
    forced = trainer.forward_backward_custom(with_routes(samples, other), loss_fn)
    for i, (s, o) in enumerate(zip(samples, other)):
        assert torch.equal(forced.loss_fn_outputs[i]["routed_experts"].to_torch(), o.long())
        assert torch.equal(plain.loss_fn_outputs[i]["routed_experts"].to_torch(), s.routed_experts.long())
        # The first layer's routers still choose what they chose unforced.
        chosen = forced.loss_fn_outputs[i]["routed_experts_chosen"].to_torch()
        assert torch.equal(chosen[:, 0], s.routed_experts[:, 0].long())
    assert not torch.allclose(forced.loss_fn_outputs[0]["logprobs"].to_torch(), plain.loss_fn_outputs[0]["logprobs"].to_torch())
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in routers(trainer.model))
    # The trainer's forward (pi_old) scores with the routes the datums carry, as its update does.
    scored = trainer.forward(with_routes(samples, other))
    for lp, out in zip(scored, forced.loss_fn_outputs):
        assert torch.allclose(lp, out["logprobs"].to_torch(), rtol=0, atol=1e-5)
    trainer.model.zero_grad(set_to_none=True)


def test_replaying_the_samplers_own_routes_changes_nothing_in_fp32(moe_dir):
    trainer, sampler = make(moe_dir, dtype="float32")
    samples = sampled(trainer, sampler)
    plain, _ = trainer.forward_routed([sample_to_datum(s) for s in samples])
    replayed = trainer.forward(with_routes(samples, [s.routed_experts for s in samples]))
    assert all(torch.equal(a, b) for a, b in zip(plain, replayed))


def test_load_balance_metrics_per_layer(moe_dir):
    trainer, sampler = make(moe_dir, dtype="float32")
    samples = sampled(trainer, sampler)
    out = trainer.forward_backward_custom([sample_to_datum(s) for s in samples], loss_fn)
    trainer.model.zero_grad(set_to_none=True)
    layers = [out.metrics[f"moe/load_max_over_mean/layer_{i}"] for i in range(2)]
    assert out.metrics["moe/load_max_over_mean"] == max(layers)
    # 8 experts, top-2: between even (1) and every token on the same two experts (4).
    assert all(1.0 <= v <= 4.0 for v in layers) and max(layers) > 1.0


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("shape", r"datum 0: routed_experts is \(3, 2, 2\), its input is \d+ tokens through 2 MoE layers of top-2"),
        ("partial", "some datums of one forward carry routed_experts and some do not"),
    ],
)
def test_routes_that_do_not_fit_are_refused(moe_dir, problem, message):
    trainer, sampler = make(moe_dir, dtype="float32")
    samples = sampled(trainer, sampler)[:2]
    if problem == "shape":
        datums = with_routes(samples, [torch.zeros(3, 2, 2, dtype=torch.uint8)] * 2)
    else:
        datums = [with_routes(samples[:1], [samples[0].routed_experts])[0], sample_to_datum(samples[1])]
    with pytest.raises(ValueError, match=message):
        trainer.forward(datums)


def test_a_sample_with_routes_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match=r"routed_experts has 3 rows for a sample of 3 tokens \(routes cover tokens\[:-1\]\)"):
        Sample(None, [1, 2, 3], [0.0] * 3, [1.0] * 3, "", "stop", 0, routed_experts=torch.zeros(3, 2, 2))


# --- runs ---------------------------------------------------------------------------------------


def run_moe(model_dir, tiny_dataset, run_dir, **kw):
    config = dict(
        model=str(model_dir),
        dataset=str(tiny_dataset),
        prompt_template="Question: {prompt}\nAnswer:",
        max_steps=2,
        prompt_groups_per_step=2,
        completions_per_prompt=3,
        max_completion_tokens=5,
        learning_rate=1e-2,
        reward=["gsm8k"],
        logger=["jsonl"],
        run_dir=str(run_dir),
        drop_zero_variance_groups=False,
    )
    run(RunConfig(**{**config, **kw}))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def sampler_routes_elsewhere(monkeypatch):
    """The sampler reports other experts than it used for every token (another engine would pick
    some others): what R3 must force, and what the agreement must see."""
    generate = LocalSampler._generate

    def reported_otherwise(self, *args):
        groups = generate(self, *args)
        for group in groups:
            for c in group:
                c.routed_experts = ((c.routed_experts.long() + 1) % 8).to(torch.uint8)
        return groups

    monkeypatch.setattr(LocalSampler, "_generate", reported_otherwise)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_r3_trains_on_the_samplers_experts_and_off_does_not(moe_dir, tiny_dataset, tmp_path, sampler_routes_elsewhere, loop):
    off = run_moe(moe_dir, tiny_dataset, tmp_path / "off", dtype="float32", loop=loop)
    r3 = run_moe(moe_dir, tiny_dataset, tmp_path / "r3", dtype="float32", router_replay="R3", loop=loop)
    assert [m["moe/router_agreement"] for m in off] == [0.0, 0.0]
    assert [m["moe/router_agreement"] for m in r3] == [1.0, 1.0]
    # The routers themselves still choose otherwise; R3 forces the sampler's experts over them. Not
    # exactly 0: a layer after a forced one sees forced inputs, and its router may pick the shifted
    # set itself (0.005 seen with Mixtral in the async loop).
    assert r3[0]["moe/router_agreement_chosen"] < 0.05
    # Forced onto other experts than the sampler's logprobs came from: the trainer's logprobs move away.
    assert r3[0]["mismatch/logprob_abs_mean"] > 100 * off[0]["mismatch/logprob_abs_mean"]


def test_r3_agrees_exactly_in_bf16(moe_dir, tiny_dataset, tmp_path):
    r3 = run_moe(moe_dir, tiny_dataset, tmp_path / "r3", dtype="bfloat16", router_replay="R3")
    assert [m["moe/router_agreement"] for m in r3] == [1.0, 1.0]
    assert all(0.0 < m["moe/router_agreement_chosen"] <= 1.0 for m in r3)


def test_r2_replays_the_routing_of_pi_olds_forward_in_every_update(moe_dir, tiny_dataset, tmp_path, monkeypatch):
    recorded, replayed = [], []
    forward_routed, forward_backward = LocalTrainer.forward_routed, LocalTrainer.forward_backward_custom

    def spy_routed(self, datums):
        out = forward_routed(self, datums)
        recorded.append(out[1])
        return out

    def spy_update(self, datums, fn):
        replayed.append([d.loss_fn_inputs["routed_experts"].to_torch() for d in datums])
        return forward_backward(self, datums, fn)

    monkeypatch.setattr(LocalTrainer, "forward_routed", spy_routed)
    monkeypatch.setattr(LocalTrainer, "forward_backward_custom", spy_update)
    metrics = run_moe(moe_dir, tiny_dataset, tmp_path / "r2", dtype="float32", router_replay="R2", minibatches_per_step=2, max_steps=1)
    assert metrics[0]["optim/updates"] == 2
    # One pi_old forward per step, its routes replayed by both minibatches' updates, in order.
    assert len(recorded) == 1 and len(replayed) == 2
    flat = [r for update in replayed for r in update]
    assert len(flat) == len(recorded[0]) and all(torch.equal(a, b.long()) for a, b in zip(flat, recorded[0]))


def test_off_does_not_replay(moe_dir, tiny_dataset, tmp_path, monkeypatch):
    seen = []
    forward_backward = LocalTrainer.forward_backward_custom
    monkeypatch.setattr(
        LocalTrainer,
        "forward_backward_custom",
        lambda self, datums, fn: seen.extend("routed_experts" in d.loss_fn_inputs for d in datums) or forward_backward(self, datums, fn),
    )
    metrics = run_moe(moe_dir, tiny_dataset, tmp_path / "off", dtype="float32", max_steps=1)
    assert seen and not any(seen)
    assert metrics[0]["moe/router_agreement"] == 1.0  # fp32: the trainer routes as the sampler did


@pytest.mark.parametrize("loop", ["sync", "async"])
@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_a_dense_model_is_refused_from_its_config_before_any_model_loads(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, mode, loop):
    from grpo_core.plugins.backends import local

    monkeypatch.setattr(local, "load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    expected = (
        rf"^--router-replay {mode}: model type 'qwen3' has no mixture-of-experts layers \({tiny_model_dir}/config.json names no "
        r"experts\), so there is no routing to replay: use --router-replay off$"
    )
    with pytest.raises(PluginError, match=expected):
        run_moe(tiny_model_dir, tiny_dataset, tmp_path / "run", router_replay=mode, loop=loop)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_dense_model_whose_config_is_elsewhere_is_refused_once_loaded(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    from grpo_core import stages

    monkeypatch.setattr(stages, "model_config_file", lambda model: None)  # a hub model not in the local cache
    with pytest.raises(PluginError, match=r"^--router-replay R3: model type 'qwen3' has no mixture-of-experts layers \(--backend local\)$"):
        run_moe(tiny_model_dir, tiny_dataset, tmp_path / "run", router_replay="R3")


class NoRoutingSampler:
    pass


class NoRoutingTrainer:
    """A backend's trainer that declares no routing_problem (the tinker trainer)."""


def test_a_backend_or_sampler_that_cannot_is_refused_and_off_refuses_nothing(moe_dir):
    trainer, sampler = make(moe_dir, dtype="float32")
    config = RunConfig(model=str(moe_dir), router_replay="R3", sampler="openai")
    with pytest.raises(PluginError, match=r"^--router-replay R3: the sampler does not return .* \(--sampler openai\)$"):
        check_router_replay(config, trainer, NoRoutingSampler())
    # R2 records in the trainer: any sampler will do.
    check_router_replay(RunConfig(model=str(moe_dir), router_replay="R2"), trainer, NoRoutingSampler())
    with pytest.raises(PluginError, match=r"^--router-replay R2: the backend does not force .* \(--backend tinker\)$"):
        check_router_replay(RunConfig(model=str(moe_dir), router_replay="R2", backend="tinker"), NoRoutingTrainer(), sampler)
    check_router_replay(RunConfig(model=str(moe_dir)), NoRoutingTrainer(), NoRoutingSampler())
    with pytest.raises(PluginError, match=r"^--router-replay 'r3': choose off, R2 or R3$"):
        check_router_replay(RunConfig(model=str(moe_dir), router_replay="r3"), trainer, sampler)


def test_the_cli_takes_the_three_modes_only(tmp_path):
    from click.testing import CliRunner

    from grpo_core.cli import main

    result = CliRunner().invoke(main, ["run", "--router-replay", "R4", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "'R4' is not one of 'off', 'R2', 'R3'" in result.output


def test_checkpointed_layers_recompute_with_the_forced_experts(moe_dir):
    """--gradient-checkpointing recomputes each layer in backward: with the same forced experts, so
    the gradient is the one of the forward that was scored."""
    grads = []
    for checkpointing in (False, True):
        trainer, sampler = make(moe_dir, dtype="float32", gradient_checkpointing=checkpointing)
        samples = sampled(trainer, sampler)
        other = [((s.routed_experts.long() + 1) % 8).to(torch.uint8) for s in samples]
        trainer.forward_backward_custom(with_routes(samples, other), loss_fn)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys() and any("gate.weight" in n for n in plain)
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], rtol=1e-4, atol=1e-6), name
