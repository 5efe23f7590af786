"""The tinker backend without a server: a fake training client at the SDK boundary.

The real service is exercised in tests/integration/test_tinker.py (skyrl, marker ``tinker``).
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import attrs
import pytest
import tinker
import torch

from grpo_core import Prompt, Sample, make_plugin
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.errors import PluginError
from grpo_core.loss import aggregate
from grpo_core.plugins.backends.tinker import BuiltinLoss, TinkerBackend, TinkerTrainer, builtin_loss, token_weights
from grpo_core.plugins_manager import build_manager, redact_plugin_options
from grpo_core.remote import tinker_sdk
from tests.plugins.backends.tinker_losses import step_loss


class FakeFuture:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class FakeTraining:
    """Records every call; forward logprobs are fixed per datum (-0.1·position)."""

    def __init__(self):
        self.calls = []

    def _logprobs(self, data):
        return [
            {
                "logprobs": tinker.TensorData.from_torch(
                    -0.1 * torch.arange(len(d.loss_fn_inputs["target_tokens"].data), dtype=torch.float32)
                )
            }
            for d in data
        ]

    def forward(self, data, loss_fn):
        self.calls.append(("forward", loss_fn, None, data))
        return FakeFuture(SimpleNamespace(loss_fn_outputs=self._logprobs(data)))

    def forward_backward(self, data, loss_fn, config=None):
        self.calls.append(("forward_backward", loss_fn, config, data))
        return FakeFuture(SimpleNamespace(loss_fn_outputs=self._logprobs(data)))

    def optim_step(self, adam_params):
        self.calls.append(("optim_step", adam_params, None, None))
        return FakeFuture(SimpleNamespace(metrics={"grad_norm": 0.5}))

    def save_state(self, name):
        self.calls.append(("save_state", name, None, None))
        return FakeFuture(SimpleNamespace(path=f"tinker://model/weights/{name}"))

    def load_state_with_optimizer(self, path):
        self.calls.append(("load_state_with_optimizer", path, None, None))
        return FakeFuture(None)

    def save_weights_for_sampler(self, name):
        self.calls.append(("save_weights_for_sampler", name, None, None))
        return FakeFuture(SimpleNamespace(path=f"tinker://model/sampler_weights/{name}"))


class FakeService:
    def __init__(self, training):
        self.training = training
        self.opened = []

    def create_training_client_from_state_with_optimizer(self, path):
        self.opened.append(path)
        return FakeFuture(self.training)

    def create_sampling_client(self, model_path=None, base_model=None):
        self.opened.append(model_path or base_model)
        return SimpleNamespace(model_path=model_path, base_model=base_model)


def pairs(n=3):
    out = []
    for i in range(n):
        tokens = list(range(2, 8 + i))
        mask = [0.0, 0.0] + [1.0] * (len(tokens) - 2)
        sample = Sample(Prompt(id=str(i), text=""), tokens, [-0.5] * len(tokens), mask, "", "length", 0)
        out.append((sample, sample_to_datum(sample)))
    return out


def make_trainer(builtin=None):
    training = FakeTraining()
    return TinkerTrainer(service=FakeService(training), training=training, tokenizer=None, base_model="m", builtin=builtin), training


ADAM = tinker.AdamParams(learning_rate=1e-3)


# -- options, key, mapping ------------------------------------------------------------------------


def test_backend_and_sampler_are_in_the_catalog_with_the_tinker_defaults():
    backend = make_plugin("tinker", kind="backend")
    assert isinstance(backend, TinkerBackend)
    assert (backend.default_sampler, backend.default_weight_sync) == ("tinker", "in_process")
    assert backend.rank == 0 and backend.builtin_losses and backend.api_key_env == "TINKER_API_KEY"
    with pytest.raises(PluginError, match="rank must be >= 0"):
        make_plugin("tinker", kind="backend", rank=-1)


def test_api_key_comes_from_the_named_variable_and_is_never_written(monkeypatch):
    monkeypatch.setenv("MY_TINKER_KEY", "tml-secret-value")
    assert tinker_sdk.api_key_from("", "MY_TINKER_KEY") == "tml-secret-value"
    assert tinker_sdk.api_key_from("tml-given", "MY_TINKER_KEY") == "tml-given"
    monkeypatch.delenv("MY_TINKER_KEY")
    with pytest.raises(PluginError, match="no Tinker API key: set MY_TINKER_KEY"):
        tinker_sdk.api_key_from("", "MY_TINKER_KEY")
    redacted = redact_plugin_options({"backend": {"tinker": {"api_key": "tml-secret-value", "rank": 8}}})
    assert redacted == {"backend": {"tinker": {"api_key": "***", "rank": 8}}}
    assert "tml-secret-value" not in repr(make_plugin("tinker", kind="backend", api_key="tml-secret-value"))


def test_a_key_the_sdk_refuses_is_one_line_without_the_key():
    backend = make_plugin("tinker", kind="backend", base_url="http://127.0.0.1:9", api_key="not-a-tml-key-secret")
    with pytest.raises(PluginError, match="cannot open a training client on the Tinker service at http://127.0.0.1:9: .*tml-") as info:
        backend.make_trainer(config=RunConfig())
    assert "not-a-tml-key-secret" not in str(info.value)


def test_a_subclass_of_a_builtin_loss_is_not_mapped(monkeypatch):
    """A loss subclass may compute something else: the service computes only the built-in class itself."""
    from grpo_core.plugins.losses.cispo import CISPOLoss

    @attrs.define
    class Sharper(CISPOLoss):
        pass

    assert CISPOLoss().service_loss["loss_fn"] == "cispo" and Sharper().service_loss is None
    config = RunConfig(loss=["sharper"])
    monkeypatch.setattr("grpo_core.plugins.backends.tinker.make_plugin", lambda name, kind, **options: Sharper())
    assert builtin_loss(config) is None
    monkeypatch.setattr("grpo_core.plugins.backends.tinker.make_plugin", lambda name, kind, **options: CISPOLoss())
    assert builtin_loss(config).name == "cispo"


@pytest.mark.parametrize(
    "loss, options, expected",
    [
        (["importance_sampling"], {}, BuiltinLoss("importance_sampling", "seq-mean-token-sum")),
        (["importance_sampling"], {"clip_rho": 2.0}, None),
        (
            ["cispo"],
            {"eps_low": 0.1, "eps_high": 0.3},
            BuiltinLoss("cispo", "token-mean", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}),
        ),
        (["dapo"], {}, BuiltinLoss("ppo", "token-mean", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})),
        (["dapo"], {"dual_clip": 3.0}, None),
        (["grpo"], {"kl_beta": 0.0}, BuiltinLoss("ppo", "seq-mean-token-sum", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})),
        (["grpo"], {}, None),  # its default KL term needs the reference
        (["cispo", "tis"], {}, None),  # a wrapper needs the custom path
        (["reinforce"], {}, None),
        (["gspo"], {}, None),
        (["dro"], {}, None),
    ],
)
def test_builtin_loss_maps_only_what_the_service_computes_alike(loss, options, expected):
    config = RunConfig(loss=loss, plugin_options={"loss": {loss[0]: options}} if options else {})
    mapped = builtin_loss(config)
    if expected is None or mapped is None:
        assert mapped == expected
    else:
        assert (mapped.name, mapped.agg) == (expected.name, expected.agg)
        assert (mapped.config or {}).keys() == (expected.config or {}).keys()
        for key, value in (expected.config or {}).items():
            assert mapped.config[key] == pytest.approx(value)


@pytest.mark.parametrize("agg", ["token-sum", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_weights_are_the_aggregation_derivative(agg):
    step = step_loss(["importance_sampling"], {}, pairs(), [torch.ones(len(s.tokens) - 1) for s, _ in pairs()], None)
    inputs = step.inputs([torch.zeros(len(m)) for m in step.mask])
    weights = token_weights(inputs, agg)
    generator = torch.Generator().manual_seed(0)
    terms = [torch.randn(len(m), generator=generator) for m in step.mask]
    padded = attrs.evolve(inputs, logprobs=terms).padded()
    expected = aggregate(padded.logprobs_B_T, padded, agg)
    assert float(sum((w * t * m).sum() for w, t, m in zip(weights, terms, step.mask))) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    if agg == "token-mean":
        assert float(weights[0][-1]) == pytest.approx(1 / step.num_tokens)


# -- the custom path ----------------------------------------------------------------------------


def test_custom_path_sends_minus_the_loss_gradient_with_the_optimizer_step():
    trainer, training = make_trainer()
    data = pairs()
    datums = [d for _, d in data]
    advantages = [torch.full((len(s.tokens) - 1,), 2.0) for s, _ in data]
    step = step_loss(["reinforce"], {}, data, advantages, None)
    output = trainer.forward_backward_custom(datums, step)
    assert [c[0] for c in training.calls] == ["forward"]  # nothing accumulates on the service yet
    # reinforce, seq-mean-token-sum: loss = −Σ A·π / N over trained tokens.
    expected = sum(-2.0 * float((-0.1 * torch.arange(len(d.loss_fn_inputs["target_tokens"].data)))[2 - 1 :].sum()) for d in datums) / 3
    assert output.metrics["loss"] == pytest.approx(expected, rel=1e-6)
    metrics = trainer.optim_step(ADAM)
    kinds = [c[0] for c in training.calls]
    assert kinds == ["forward", "forward_backward", "optim_step"]
    _, loss_fn, _, sent = training.calls[1]
    assert loss_fn == "cross_entropy"
    for datum, (sample, _) in zip(sent, data):
        weights = datum.loss_fn_inputs["weights"].data
        # −∂loss/∂π = A·m/N: 2/3 on trained tokens, 0 on the prompt.
        assert weights == pytest.approx([w * 2.0 / 3 for w in sample.loss_mask[1:]])
    assert metrics == {"optim/grad_norm": 0.5, "optim/lr": 1e-3, "optim/skipped_nonfinite": 0.0}
    assert trainer.version == 1


def test_a_nonfinite_loss_sends_nothing_and_skips_the_step():
    trainer, training = make_trainer()
    data = pairs()
    datums = [d for _, d in data]
    finite = step_loss(["reinforce"], {}, data, [torch.ones(len(s.tokens) - 1) for s, _ in data], None)
    broken = step_loss(["reinforce"], {}, data, [torch.full((len(s.tokens) - 1,), math.nan) for s, _ in data], None)
    trainer.forward_backward_custom(datums, finite)
    out = trainer.forward_backward_custom(datums, broken)  # a second call of the same step
    assert math.isnan(out.metrics["loss"])
    metrics = trainer.optim_step(ADAM)
    assert metrics["optim/skipped_nonfinite"] == 1.0
    assert [c[0] for c in training.calls] == ["forward", "forward"]  # no gradient ever reached the service
    assert trainer.version == 0 and trainer.pending == []
    trainer.forward_backward_custom(datums, finite)
    trainer.optim_step(ADAM)
    assert len(training.calls[-2][3]) == 3  # the next step sends only its own gradients
    assert trainer.version == 1


def test_a_plain_loss_function_takes_the_custom_path_even_with_a_builtin():
    trainer, training = make_trainer(BuiltinLoss("importance_sampling", "token-sum"))
    datums = [d for _, d in pairs()]
    trainer.forward_backward_custom(datums, lambda ds, lps: (sum(lp.sum() for lp in lps), {}))
    assert [c[0] for c in training.calls] == ["forward"]


# -- the built-in path ------------------------------------------------------------------------------


def test_builtin_path_on_policy_is_one_cross_entropy_call_with_weighted_advantages():
    trainer, training = make_trainer(BuiltinLoss("cispo", "token-mean", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}))
    data = pairs()
    advantages = [torch.full((len(s.tokens) - 1,), 1.5) for s, _ in data]
    step = step_loss(["cispo"], {}, data, advantages, None)
    output = trainer.forward_backward_custom([d for _, d in data], step)
    ((kind, loss_fn, config, sent),) = training.calls
    assert (kind, loss_fn, config) == ("forward_backward", "cross_entropy", None)
    for datum, (sample, _) in zip(sent, data):
        assert datum.loss_fn_inputs["weights"].data == pytest.approx([m * 1.5 / step.num_tokens for m in sample.loss_mask[1:]])
    # The loss value is the run's own loss on the logprobs of that forward.
    logprobs = [torch.tensor(r["logprobs"].data) for r in training._logprobs(sent)]
    assert output.metrics["loss"] == pytest.approx(float(step(None, logprobs)[0]))
    assert "loss/clip_frac_high" in output.metrics


def test_builtin_path_off_policy_sends_the_anchor_and_the_clip_range():
    builtin = BuiltinLoss("ppo", "seq-mean-token-sum", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    trainer, training = make_trainer(builtin)
    data = pairs()
    advantages = [torch.full((len(s.tokens) - 1,), -1.0) for s, _ in data]
    old = [torch.full((len(s.tokens) - 1,), -0.7) for s, _ in data]
    step = step_loss(["grpo"], {"loss": {"grpo": {"kl_beta": 0.0}}}, data, advantages, old)
    trainer.forward_backward_custom([d for _, d in data], step)
    ((_, loss_fn, config, sent),) = training.calls
    assert (loss_fn, config) == ("ppo", builtin.config)
    first = sent[0].loss_fn_inputs
    assert first["logprobs"].data == pytest.approx([-0.7] * len(old[0]))
    assert first["weights"].data == data[0][0].loss_mask[1:]
    assert first["advantages"].data == pytest.approx([-m / 3 for m in data[0][0].loss_mask[1:]])


@pytest.mark.parametrize("builtin", [None, BuiltinLoss("cispo", "token-sum")], ids=["custom", "builtin"])
def test_both_paths_record_the_sampler_trainer_mismatch(builtin):
    from grpo_core.metrics import scope

    trainer, _ = make_trainer(builtin)
    data = pairs()
    step = step_loss(["cispo"], {}, data, [torch.ones(len(s.tokens) - 1) for s, _ in data], None)
    with scope() as metrics:
        trainer.forward_backward_custom([d for _, d in data], step)
    # The service's logprob at target t is −0.1·t, the sampler's −0.5; targets 1.. are trained.
    diffs = torch.cat([-0.1 * torch.arange(1, len(s.tokens) - 1) + 0.5 for s, _ in data])
    assert metrics["mismatch/logprob_abs_max"] == pytest.approx(0.4)
    assert metrics["mismatch/logprob_abs_mean"] == pytest.approx(float(diffs.abs().mean()))
    assert metrics["mismatch/kl_k3"] == pytest.approx(float((diffs.exp() - 1 - diffs).mean()), rel=1e-5)


def test_the_cores_train_step_reaches_the_builtin_path(tiny_model_dir):
    """stages.train_on_groups hands the trainer a StepLoss: an off-policy cispo step is one
    forward_backward with the service's cispo, then the optimizer step; no extra forward."""
    from grpo_core.config import RunConfig
    from grpo_core.stages import train_on_groups

    trainer, training = make_trainer(BuiltinLoss("cispo", "token-sum", {"clip_low_threshold": 0.0, "clip_high_threshold": 5.0}))
    data = pairs()
    for sample, _ in data:
        sample.advantages = [1.0] * len(sample.tokens)
    pm = build_manager([make_plugin("cispo", kind="loss")])
    metrics = train_on_groups(pm, trainer, None, [[s for s, _ in data]], RunConfig(model=str(tiny_model_dir), anchor="sampling"), 1e-3)
    assert [c[0] for c in training.calls] == ["forward_backward", "optim_step"]
    assert training.calls[0][1] == "cispo"
    assert training.calls[0][3][0].loss_fn_inputs["logprobs"].data == [-0.5] * (len(data[0][0].tokens) - 1)  # the sampler's, as anchor
    assert metrics["train/samples"] == 3.0


def test_a_nonfinite_loss_after_a_builtin_backward_stops_with_what_to_do():
    trainer, _ = make_trainer(BuiltinLoss("importance_sampling", "token-sum"))
    data = pairs()
    step = step_loss(["importance_sampling"], {}, data, [torch.full((len(s.tokens) - 1,), math.inf) for s, _ in data], None)
    with pytest.raises(PluginError, match="builtin_losses=false"):
        trainer.forward_backward_custom([d for _, d in data], step)


# -- checkpoints and sampler weights ----------------------------------------------------------------


def test_save_and_load_state_keep_the_remote_path_and_the_version(tmp_path):
    trainer, _ = make_trainer()
    trainer.version = 7
    trainer.save_state(str(tmp_path / "ckpt" / "trainer.pt"))
    state = json.loads((tmp_path / "ckpt" / "trainer.pt").read_text())
    assert state["tinker_path"].startswith("tinker://model/weights/grpo-core-v7-") and state["version"] == 7
    resumed, _ = make_trainer()
    resumed.load_state(str(tmp_path / "ckpt" / "trainer.pt"))
    assert resumed.version == 7
    opened = resumed.service.opened + [c[1] for c in resumed.training.calls if c[0] == "load_state_with_optimizer"]
    assert opened == [state["tinker_path"]]
    (tmp_path / "other.pt").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(PluginError, match="not a tinker trainer's checkpoint"):
        resumed.load_state(str(tmp_path / "other.pt"))


def test_one_sampling_client_per_version():
    trainer, training = make_trainer()
    first = trainer.sampling_client()
    assert trainer.sampling_client() is first
    trainer.version = 1
    second = trainer.sampling_client()
    assert second is not first and second.model_path.startswith("tinker://model/sampler_weights/grpo-core-v1-")
    assert [c[0] for c in training.calls] == ["save_weights_for_sampler", "save_weights_for_sampler"]


def test_adapter_resolves_futures_and_maps_sampling_settings():
    assert tinker_sdk.resolved(FakeFuture(3)) == 3
    assert tinker_sdk.resolved("client") == "client"
    params = tinker_sdk.sampling_params(16, 0.7, 0.9, 0, ["\n\n"], [0], seed=5)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, list(params.stop), params.seed) == (
        16,
        0.7,
        0.9,
        -1,
        ["\n\n"],
        5,
    )
    assert list(tinker_sdk.sampling_params(16, 1.0, 1.0, 20, [], [0, 2], seed=1).stop) == [0, 2]
    assert tinker_sdk.sampling_params(16, 1.0, 1.0, 20, [], [], seed=1).top_k == 20


# -- options reach the trainer; skyrl's reduction ------------------------------------------------------


def test_make_trainer_passes_the_options_to_the_service(monkeypatch):
    opened = {}

    def training_client(base_url, api_key, base_model, rank, seed):
        opened.update(base_url=base_url, api_key=api_key, base_model=base_model, rank=rank, seed=seed)
        return FakeService(FakeTraining()), FakeTraining()

    monkeypatch.setattr(tinker_sdk, "training_client", training_client)
    monkeypatch.setenv("TINKER_API_KEY", "tml-from-env")
    config = RunConfig(loss=["cispo"], seed=11)
    backend = make_plugin("tinker", kind="backend", base_url="http://svc", rank=4, base_model="Qwen/X", loss_reduction="sequence_mean")
    trainer = backend.make_trainer(config=config)
    assert opened == {"base_url": "http://svc", "api_key": "tml-from-env", "base_model": "Qwen/X", "rank": 4, "seed": 11}
    assert trainer.builtin.name == "cispo" and trainer.reduction == "sequence_mean" and trainer.base_model == "Qwen/X"
    assert make_plugin("tinker", kind="backend", builtin_losses=False).make_trainer(config=config).builtin is None
    with pytest.raises(PluginError, match="loss_reduction"):
        make_plugin("tinker", kind="backend", loss_reduction="mean")


@pytest.mark.parametrize(
    "lora_rank, option, expected",
    [(0, 0, 32), (8, 0, 8), (0, 4, 4), (8, 8, 8), (8, 4, "two LoRA ranks: --lora-rank 8 and --trainer-opt rank=4")],
)
def test_the_adapter_rank_is_the_option_else_lora_rank_else_32(monkeypatch, lora_rank, option, expected):
    opened = {}

    def training_client(base_url, api_key, base_model, rank, seed):
        opened["rank"] = rank
        return FakeService(FakeTraining()), FakeTraining()

    monkeypatch.setattr(tinker_sdk, "training_client", training_client)
    monkeypatch.setenv("TINKER_API_KEY", "tml-from-env")
    backend = make_plugin("tinker", kind="backend", rank=option)
    config = RunConfig(lora_rank=lora_rank)
    if isinstance(expected, str):
        with pytest.raises(PluginError, match=expected):
            backend.make_trainer(config=config)
        assert opened == {}  # refused before opening anything on the service
    else:
        backend.make_trainer(config=config)
        assert opened == {"rank": expected}


@pytest.mark.parametrize(
    "fields, message",
    [({"lora_alpha": 16.0}, "--lora-alpha apply"), ({"lora_target_modules": ["q_proj"]}, "--lora-target-modules apply")],
)
def test_lora_settings_the_service_does_not_take_are_refused(fields, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("tinker", kind="backend").make_trainer(config=RunConfig(lora_rank=8, **fields))


def test_lora_rank_reaches_the_service_through_the_cli(monkeypatch, tmp_path):
    """--lora-rank with --trainer tinker, parsed as a user types it."""
    from click.testing import CliRunner

    from grpo_core.cli import main

    opened = {}

    def training_client(base_url, api_key, base_model, rank, seed):
        opened["rank"] = rank
        raise PluginError("stop here: the rank was read")

    monkeypatch.setattr(tinker_sdk, "training_client", training_client)
    monkeypatch.setenv("TINKER_API_KEY", "tml-from-env")
    result = CliRunner().invoke(
        main, ["run", "--trainer", "tinker", "--lora-rank", "16", "--max-steps", "1", "--run-dir", str(tmp_path / "r")]
    )
    assert "stop here: the rank was read" in result.output and opened == {"rank": 16}


def test_sequence_mean_custom_path_carries_the_gradient_on_importance_sampling():
    trainer, training = make_trainer()
    trainer.reduction = "sequence_mean"
    data = pairs()
    datums = [d for _, d in data]
    step = step_loss(["reinforce"], {}, data, [torch.full((len(s.tokens) - 1,), 2.0) for s, _ in data], None)
    trainer.forward_backward_custom(datums, step)
    trainer.optim_step(ADAM)
    _, loss_fn, _, sent = training.calls[1]
    assert loss_fn == "importance_sampling"
    for datum, (sample, _) in zip(sent, data):
        T = len(sample.tokens) - 1
        inputs = datum.loss_fn_inputs
        assert inputs["weights"].data == [1.0] * T
        assert inputs["logprobs"].data == pytest.approx([-0.1 * t for t in range(T)])
        # skyrl divides each sequence by its weights' sum (T) and the step by its sequences (3).
        assert inputs["advantages"].data == pytest.approx([w * 2.0 / 3 * T * 3 for w in sample.loss_mask[1:]])


def test_sequence_mean_builtin_path_scales_advantages_and_leaves_on_policy_to_the_custom_path():
    builtin = BuiltinLoss("importance_sampling", "token-sum")
    trainer, training = make_trainer(builtin)
    trainer.reduction = "sequence_mean"
    data = pairs()
    old = [torch.full((len(s.tokens) - 1,), -0.7) for s, _ in data]
    advantages = [torch.full((len(s.tokens) - 1,), 1.0) for s, _ in data]
    trainer.forward_backward_custom([d for _, d in data], step_loss(["importance_sampling"], {}, data, advantages, old))
    ((_, loss_fn, _, sent),) = training.calls
    assert loss_fn == "importance_sampling"
    for datum, (sample, _) in zip(sent, data):
        trained = sum(sample.loss_mask[1:])
        assert datum.loss_fn_inputs["advantages"].data == pytest.approx([m * trained * 3 for m in sample.loss_mask[1:]])
    training.calls.clear()
    trainer.forward_backward_custom([d for _, d in data], step_loss(["importance_sampling"], {}, data, advantages, None))
    assert [c[0] for c in training.calls] == ["forward"]


# -- the policy as a model: the service's adapter downloaded and merged into --model -------------------


RANK, ALPHA = 4, 8.0


def lora_factors(model, layout):
    """Random LoRA factors (as the service would save them) for some modules of ``model``, by layout:
    linear (PEFT: A rank × in, B out × rank), embedding_peft, embedding_skyrl, lm_head."""
    generator = torch.Generator().manual_seed(1)
    vocab, hidden = model.get_input_embeddings().weight.shape
    factors = {}
    if layout == "linear":
        for name in ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]:
            out_features, in_features = model.get_submodule(name).weight.shape
            factors[name] = (
                0.1 * torch.randn(RANK, in_features, generator=generator),
                0.1 * torch.randn(out_features, RANK, generator=generator),
            )
    elif layout == "embedding_peft":
        factors["model.embed_tokens"] = (
            torch.randn(RANK, vocab, generator=generator),
            0.1 * torch.randn(hidden, RANK, generator=generator),
        )
    elif layout == "embedding_skyrl":
        factors["model.embed_tokens"] = (
            torch.randn(vocab, RANK, generator=generator),
            0.1 * torch.randn(RANK, hidden, generator=generator),
        )
    else:
        factors["lm_head"] = (0.1 * torch.randn(RANK, hidden, generator=generator), 0.1 * torch.randn(vocab, RANK, generator=generator))
    return factors


def write_adapter(folder, factors, embedding_keys="lora", **config):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = ("lora_embedding_A", "lora_embedding_B") if embedding_keys == "peft" else ("lora_A", "lora_B")
    tensors = {}
    for module, (a, b) in factors.items():
        a_name, b_name = names if module.endswith("embed_tokens") else ("lora_A", "lora_B")
        tensors[f"base_model.model.{module}.{a_name}.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.{b_name}.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": ALPHA, "target_modules": None, **config}))
    return folder


def adapted_logits(base_dir, factors, layout, scale, tokens):
    """The base model's logits with the adapter applied as LoRA applies it (x·Aᵀ·Bᵀ·scale added to a
    layer's output), not merged: what the service computes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for name, (a, b) in factors.items():
        module = model.get_submodule(name)
        if name.endswith("embed_tokens"):
            table = a if layout == "embedding_skyrl" else a.T  # vocab × rank
            up = b if layout == "embedding_skyrl" else b.T  # rank × hidden
            module.register_forward_hook(lambda m, args, out, t=table, u=up: out + scale * (t[args[0]] @ u))
        else:
            module.register_forward_hook(lambda m, args, out, a=a, b=b: out + scale * (args[0] @ a.T @ b.T))
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("layout", ["linear", "embedding_peft", "embedding_skyrl", "lm_head"])
def test_merged_model_computes_what_the_adapter_computes(tiny_model_dir, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    from grpo_core.plugins.backends.tinker import write_merged_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    factors = lora_factors(base, layout)
    adapter = write_adapter(tmp_path / "adapter", factors, embedding_keys="peft" if layout == "embedding_peft" else "lora")
    write_merged_model(str(tiny_model_dir), adapter, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    tokens = list(range(5, 40))
    with torch.no_grad():
        ours = merged(torch.tensor([tokens])).logits[0]
        before = base(torch.tensor([tokens])).logits[0]
    expected = adapted_logits(tiny_model_dir, factors, layout, ALPHA / RANK, tokens)
    assert (expected - before).abs().max() > 0.05  # the adapter changes the model
    assert (ours - expected).abs().max() < 1e-4
    # A change of the embedding or of the output layer alone unties them; otherwise the model stays tied.
    assert merged.config.tie_word_embeddings is (layout == "linear")


def test_merge_scales_by_alpha_over_rank_or_its_root_with_rslora(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from grpo_core.plugins.backends.tinker import write_merged_model

    name = "model.layers.0.self_attn.q_proj"
    base = load_file(str(tiny_model_dir / "model.safetensors"))[f"{name}.weight"]
    a, b = torch.ones(RANK, base.shape[1]), torch.full((base.shape[0], RANK), 0.01)
    for rslora, scale in [(False, ALPHA / RANK), (True, ALPHA / math.sqrt(RANK))]:
        adapter = write_adapter(tmp_path / f"adapter-{rslora}", {name: (a, b)}, use_rslora=rslora)
        write_merged_model(str(tiny_model_dir), adapter, tmp_path / f"merged-{rslora}")
        merged = load_file(str(tmp_path / f"merged-{rslora}" / "model.safetensors"))[f"{name}.weight"]
        assert torch.allclose(merged - base, torch.full_like(base, scale * RANK * 0.01), atol=1e-6)


def test_merge_refuses_what_it_cannot_read(tiny_model_dir, tmp_path):
    from grpo_core.plugins.backends.tinker import write_merged_model

    name = "model.layers.0.self_attn.q_proj"
    cases = {
        "do not fit its weight": ({name: (torch.zeros(RANK, 3), torch.zeros(5, RANK))}, {}),
        "does not have": ({"model.layers.9.self_attn.q_proj": (torch.zeros(RANK, 64), torch.zeros(64, RANK))}, {}),
        "per module": ({name: (torch.zeros(RANK, 64), torch.zeros(64, RANK))}, {"rank_pattern": {"q_proj": 2}}),
    }
    for i, (message, (factors, config)) in enumerate(cases.items()):
        adapter = write_adapter(tmp_path / f"adapter-{i}", factors, **config)
        with pytest.raises(PluginError, match=message):
            write_merged_model(str(tiny_model_dir), adapter, tmp_path / f"out-{i}")
    from safetensors.torch import save_file

    only_a = tmp_path / "only-a"
    write_adapter(only_a, {})
    save_file({f"base_model.model.{name}.lora_A.weight": torch.zeros(RANK, 64)}, str(only_a / "adapter_model.safetensors"))
    with pytest.raises(PluginError, match="has lora_A of model.layers.0.self_attn.q_proj, not a pair"):
        write_merged_model(str(tiny_model_dir), only_a, tmp_path / "out-a")
    save_file({f"base_model.model.{name}.magnitude": torch.zeros(64)}, str(only_a / "adapter_model.safetensors"))
    with pytest.raises(PluginError, match="not a LoRA factor"):
        write_merged_model(str(tiny_model_dir), only_a, tmp_path / "out-b")
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "notes.txt").write_text("")
    with pytest.raises(PluginError, match="neither a LoRA adapter nor a model"):
        write_merged_model(str(tiny_model_dir), tmp_path / "neither", tmp_path / "out-c")


def test_a_service_that_exports_a_model_has_it_taken_as_it_is(tiny_model_dir, tmp_path):
    from grpo_core.plugins.backends.tinker import write_merged_model

    write_merged_model(str(tiny_model_dir), tiny_model_dir, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


class FakeRest:
    """The REST client: an archive URL per sampler checkpoint (tinker<0.38), or an export's files (0.38)."""

    def __init__(self, urls):
        self.urls = urls
        self.calls = []

    def get_checkpoint_archive_url(self, run, checkpoint):
        self.calls.append(("archive", f"tinker://{run}/sampler_weights/{checkpoint}"))
        return FakeFuture(SimpleNamespace(url=self.urls["archive"]))

    def get_external_weights_urls(self, path):
        self.calls.append(("external", path))
        return FakeFuture(SimpleNamespace(urls=self.urls["files"]))

    def delete_checkpoint_from_tinker_path(self, path):
        self.calls.append(("delete", path))
        return FakeFuture(None)


def archived(folder, tmp_path):
    import tarfile

    archive = tmp_path / "archive.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for file in folder.iterdir():
            tar.add(file, arcname=file.name)
    return archive.as_uri()


@pytest.mark.parametrize("sdk_version", [(0, 24), (0, 38)])
def test_save_weights_for_sampler_writes_the_merged_model_and_the_remote_path(tiny_model_dir, tmp_path, monkeypatch, sdk_version):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    factors = lora_factors(base, "linear")
    adapter = write_adapter(tmp_path / "adapter", factors)
    rest = FakeRest({"archive": archived(adapter, tmp_path), "files": {p.name: p.as_uri() for p in adapter.iterdir()}})
    monkeypatch.setattr(tinker_sdk, "SDK_VERSION", sdk_version)
    trainer, training = make_trainer()
    trainer.service.create_rest_client = lambda: rest
    training.save_weights_external = lambda name, ttl_seconds=None: (
        training.calls.append(("save_weights_external", name, ttl_seconds, None))
        or FakeFuture(SimpleNamespace(path=f"tinker://model/external_weights/{name}"))
    )
    trainer.tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer.version = 2
    with pytest.raises(PluginError, match="needs --model's weights"):
        trainer.save_weights_for_sampler(str(tmp_path / "nowhere"))
    trainer.model = str(tiny_model_dir)
    trainer.save_weights_for_sampler(str(tmp_path / "final"))

    pointer = json.loads((tmp_path / "final" / "tinker_weights.json").read_text())
    assert pointer["tinker_path"].startswith("tinker://model/sampler_weights/grpo-core-v2-") and pointer["version"] == 2
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    tokens = list(range(5, 30))
    with torch.no_grad():
        ours = merged(torch.tensor([tokens])).logits[0]
    assert (ours - adapted_logits(tiny_model_dir, factors, "linear", ALPHA / RANK, tokens)).abs().max() < 1e-4
    assert AutoTokenizer.from_pretrained(tmp_path / "final").encode("1 + 2") == trainer.tokenizer.encode("1 + 2")
    saved = [c for c in training.calls if c[0].startswith("save_weights")]
    if sdk_version < (0, 38):
        assert [c[0] for c in saved] == ["save_weights_for_sampler"]
        assert rest.calls == [("archive", pointer["tinker_path"])]
    else:
        # 0.38 downloads a temporary export of the weights, deleted after.
        (_, exported_name, ttl, _) = saved[1]
        export = f"tinker://model/external_weights/{exported_name}"
        assert [c[0] for c in saved] == ["save_weights_for_sampler", "save_weights_external"]
        assert ttl == tinker_sdk.EXPORT_TTL_SECONDS
        assert rest.calls == [("external", export), ("delete", export)]
    # The same version's sampler weights are saved on the service once (a sampling client reuses them).
    trainer.sampling_client()
    assert len([c for c in training.calls if c[0] == "save_weights_for_sampler"]) == 1


def test_the_adapter_written_for_a_sampler_is_the_services_adapter_as_vllm_loads_it(tiny_model_dir, tmp_path, monkeypatch):
    """save_adapter_for_sampler (weight sync vllm's method=adapter) downloads the service's adapter
    and writes it in PEFT's file names, whatever the service named its file: peft applies it as the
    service does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    factors = lora_factors(base, "linear")
    adapter = write_adapter(tmp_path / "adapter", factors)  # no peft_type, target_modules None: filled in
    (adapter / "adapter_model.safetensors").rename(adapter / "weights.safetensors")
    monkeypatch.setattr(tinker_sdk, "SDK_VERSION", (0, 24))  # the archive download (0.38's export is the other test's)
    trainer, training = make_trainer()
    trainer.service.create_rest_client = lambda: FakeRest({"archive": archived(adapter, tmp_path)})
    trainer.version = 1
    trainer.save_adapter_for_sampler(str(tmp_path / "served"))
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    served = PeftModel.from_pretrained(base, str(tmp_path / "served"))
    tokens = list(range(5, 30))
    with torch.no_grad():
        ours = served(torch.tensor([tokens])).logits[0]
    assert (ours - adapted_logits(tiny_model_dir, factors, "linear", ALPHA / RANK, tokens)).abs().max() < 1e-4


@pytest.mark.parametrize("layout", ["embedding_peft", "lm_head", "full model"])
def test_weights_that_a_vllm_adapter_cannot_carry_are_refused_naming_the_full_sync(tiny_model_dir, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    from grpo_core.plugins.backends.tinker import write_servable_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if layout == "full model":
        base.save_pretrained(tmp_path / "weights")
        match = r"the service's weights are no LoRA adapter \(\['config.json'"
    else:
        write_adapter(tmp_path / "weights", lora_factors(base, layout), embedding_keys="peft")
        match = "holds base_model.model.(model.embed_tokens|lm_head).lora_(embedding_)?A.weight, not a factor of a linear layer"
    with pytest.raises(PluginError, match=match + ".*method=full or method=delta"):
        write_servable_adapter(tmp_path / "weights", tmp_path / "served")
    assert not (tmp_path / "served").exists()


def test_an_export_naming_a_file_outside_its_folder_is_refused_and_deleted(tmp_path, monkeypatch):
    (tmp_path / "x").write_text("")
    rest = FakeRest({"files": {"../../escape.txt": (tmp_path / "x").as_uri()}})
    monkeypatch.setattr(tinker_sdk, "SDK_VERSION", (0, 38))
    training = SimpleNamespace(
        save_weights_external=lambda name, ttl_seconds=None: FakeFuture(SimpleNamespace(path="tinker://m/external_weights/e"))
    )
    service = SimpleNamespace(create_rest_client=lambda: rest)
    with pytest.raises(PluginError, match="outside its folder"):
        tinker_sdk.download_weights(service, training, "e", "tinker://m/sampler_weights/s", tmp_path / "dl")
    assert rest.calls[-1] == ("delete", "tinker://m/external_weights/e")
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"gradient_checkpointing": True}, "--gradient-checkpointing applies to the local trainer only"),
        ({"dtype": "bfloat16"}, "--dtype bfloat16 applies to the local trainer only"),
        ({"dtype": "float32"}, "--dtype float32 applies to the local trainer only"),
    ],
)
def test_settings_of_the_local_trainer_are_refused_before_the_service_is_opened(setting, message):
    from grpo_core.config import RunConfig
    from grpo_core.errors import PluginError
    from grpo_core.plugins.backends.tinker import TinkerBackend

    with pytest.raises(PluginError, match=re.escape(message)):
        TinkerBackend(base_url="http://127.0.0.1:9").make_trainer(config=RunConfig(**setting))
