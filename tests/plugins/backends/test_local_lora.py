"""LoRA on the local trainer (--lora-rank): what trains, what is saved, the reference, the sampler."""

from __future__ import annotations

import weakref

import pytest
import tinker
import torch

from grpo_core import Sample, SamplingParams
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.engine.fast_decoder import FastDecoder
from grpo_core.engine.forward import TransformersForward
from grpo_core.engine.lora import adapters_disabled
from grpo_core.engine.models import load_model
from grpo_core.engine.trainer import LocalReference, read_trainer_state
from grpo_core.errors import PluginError
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSamplerPlugin
from grpo_core.plugins.weight_sync.in_process import InProcessWeightSync

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_trainer(tiny_model_dir, fast_forward=True, seed=0, **config):
    torch.manual_seed(seed)  # peft draws A at random
    cfg = RunConfig(model=str(tiny_model_dir), **{"lora_rank": 4, **config})
    return cfg, LocalBackend(fast_forward=fast_forward).make_trainer(config=cfg)


def randomize_adapters(model, seed=1, scale=0.2):
    """B starts at zero (the adapters add nothing); give it values so that they matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def datums_of(tokenizer, completions=((11, 12, 13, 14), (15, 16, 17), (21, 22, 23, 24, 25))):
    prompts = [tokenizer("Question: what is 3 plus 4?\nAnswer:")["input_ids"], tokenizer("what is 1?")["input_ids"]]
    samples = [
        Sample(prompt=None, tokens=p + list(c), sampling_logprobs=[0.0] * (len(p) + len(c)),
               loss_mask=[0.0] * len(p) + [1.0] * len(c), text="", finish_reason="stop", policy_version=0)
        for p in prompts for c in completions
    ]  # fmt: skip
    return [sample_to_datum(s) for s in samples]


def logprob_loss(datums, logprobs):
    return -sum(lp[-3:].sum() for lp in logprobs) / len(logprobs), {}


def step(trainer, datums, lr=1e-2):
    trainer.forward_backward_custom(datums, logprob_loss)
    return trainer.optim_step(tinker.AdamParams(learning_rate=lr))


def base_named_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_only_the_adapters_train(tiny_model_dir):
    _, trainer = make_trainer(tiny_model_dir)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    # Two layers x seven projections x (A, B).
    assert len(trainable) == 2 * 7 * 2 and all("lora_A" in n or "lora_B" in n for n in trainable)
    base = base_named_weights(trainer.model)
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    datums = datums_of(trainer.tokenizer)
    before = trainer.forward(datums)
    metrics = step(trainer, datums)
    assert metrics["optim/grad_norm"] > 0 and trainer.version == 1
    assert all(torch.equal(base[n], p) for n, p in trainer.model.named_parameters() if n in base)
    assert all(not torch.equal(adapters[n], p) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    after = trainer.forward(datums)
    assert max(float((a - b).abs().max()) for a, b in zip(after, before)) > 1e-3
    assert len(trainer.optimizer.param_groups[0]["params"]) == len(trainable)


@pytest.mark.parametrize(("targets", "wrapped"), [(None, 7), (["q_proj", "v_proj"], 2), (["down_proj"], 1)])
def test_target_modules_choose_the_layers_that_get_adapters(tiny_model_dir, targets, wrapped):
    _, trainer = make_trainer(tiny_model_dir, **({} if targets is None else {"lora_target_modules": targets}))
    names = {n.rsplit(".", 1)[-1] for n, m in trainer.model.named_modules() if hasattr(m, "lora_A")}
    assert names == set(targets or ALL_PROJECTIONS) and len(names) == wrapped


def test_the_default_targets_fit_the_embedded_model():
    cfg = RunConfig(lora_rank=2)
    trainer = LocalBackend().make_trainer(config=cfg)
    wrapped = {n.rsplit(".", 1)[-1] for n, m in trainer.model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(ALL_PROJECTIONS) and cfg.lora_target_modules == ["auto"]


@pytest.mark.parametrize(("alpha", "rank"), [(32.0, 4), (8.0, 4), (16.0, 8)])
def test_rank_and_alpha_set_the_adapters_shape_and_scale(tiny_model_dir, alpha, rank):
    _, trainer = make_trainer(tiny_model_dir, lora_rank=rank, lora_alpha=alpha)
    q = trainer.model.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.shape[0] == rank and q.scaling["default"] == alpha / rank
    # The update is B·A·alpha/rank: with the same A and B, doubling alpha doubles the change of q's output.
    randomize_adapters(trainer.model)
    x = torch.randn(3, q.in_features)
    base = q.get_base_layer()(x)
    with torch.no_grad():
        delta = q(x) - base
        q.scaling["default"] *= 2
        assert torch.allclose(q(x) - base, 2 * delta, atol=1e-5)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (
            ["q_proj", "qproj"],
            "--lora-target-modules: 'qproj' matches nothing in this qwen3 model "
            "(its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; "
            "or auto, auto-no-experts, all-linear)",
        ),
        ([], "--lora-rank needs at least one --lora-target-modules (auto, auto-no-experts, all-linear or names)"),
    ],
)
def test_bad_target_modules_are_one_clear_error(tiny_model_dir, targets, message):
    with pytest.raises(PluginError) as err:
        make_trainer(tiny_model_dir, lora_target_modules=targets)
    assert str(err.value) == message


def test_config_refuses_a_negative_rank_and_alpha():
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        RunConfig(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_alpha must be positive"):
        RunConfig(lora_alpha=0.0)


def test_rank_0_is_full_fine_tuning(tiny_model_dir):
    _, trainer = make_trainer(tiny_model_dir, lora_rank=0)
    assert not any(hasattr(m, "lora_A") for m in trainer.model.modules())
    assert all(p.requires_grad for p in trainer.model.parameters())


# --- the fast forward runs the adapters --------------------------------------------------------


@pytest.mark.parametrize("targets", [ALL_PROJECTIONS, ["k_proj", "up_proj"]], ids=["all", "some_parts_of_fused"])
def test_fast_forward_with_adapters_matches_peft_logits(tiny_model_dir, targets):
    _, trainer = make_trainer(tiny_model_dir, lora_target_modules=targets)
    randomize_adapters(trainer.model)
    decoder = FastDecoder(trainer.model)
    ids_B_T = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask_B_T = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    positions_B_T = (mask_B_T.cumsum(-1) - 1).clamp(min=0)
    real = mask_B_T.bool()
    with torch.inference_mode():
        want = trainer.model(input_ids=ids_B_T, attention_mask=mask_B_T, position_ids=positions_B_T).logits
        assert torch.allclose(decoder(ids_B_T, positions_B_T, mask_B_T)[real], want[real], atol=1e-5)
        # Disabled adapters (the KL reference's base model) are left out, as peft leaves them.
        with adapters_disabled(trainer.model):
            base = trainer.model(input_ids=ids_B_T, attention_mask=mask_B_T, position_ids=positions_B_T).logits
            assert torch.allclose(decoder(ids_B_T, positions_B_T, mask_B_T)[real], base[real], atol=1e-5)
    # The adapters matter: without them the logits are another policy's.
    assert float((want[real] - base[real]).abs().max()) > 1e-2


def test_fast_forward_falls_back_for_adapters_it_does_not_run(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    from tests.conftest import build_tiny_model

    untied = build_tiny_model(tmp_path / "untied")
    config = AutoConfig.from_pretrained(untied)
    config.tie_word_embeddings = False
    config.save_pretrained(untied)
    cfg, trainer = make_trainer(untied, lora_target_modules=["q_proj", "lm_head"])
    assert type(LocalSamplerPlugin().make_sampler(config=cfg, trainer=trainer).forward_fn) is TransformersForward


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_an_adapter_on_a_tied_output_layer_is_refused(tiny_model_dir):
    # Merged for a sampler, it would change one of two layers that share one weight.
    with pytest.raises(PluginError, match="--lora-target-modules: 'lm_head' shares its weight with the embedding"):
        make_trainer(tiny_model_dir, lora_target_modules=["q_proj", "lm_head"])


# --- the KL reference: the same model, adapters off --------------------------------------------


def k3(policy, reference, datums):
    """k3 KL estimate (exp(r − p) − (r − p) − 1) averaged over the trained tokens."""
    total, count = 0.0, 0
    for p, r, d in zip(policy, reference, datums):
        mask = torch.tensor(d.loss_fn_inputs["weights"].data) > 0
        diff = (r - p)[mask]
        total += float((diff.exp() - diff - 1).sum())
        count += int(mask.sum())
    return total / count


@pytest.mark.parametrize("fast_forward", [True, False])
def test_kl_against_disabled_adapters_equals_kl_against_a_copy_of_the_base_model(tiny_model_dir, fast_forward):
    cfg, trainer = make_trainer(tiny_model_dir, fast_forward)
    reference = LocalBackend(fast_forward=fast_forward).make_reference(config=cfg, trainer=trainer)
    assert reference.model is trainer.model and reference.adapters_off  # no second copy of the weights
    datums = datums_of(trainer.tokenizer)
    for _ in range(3):
        step(trainer, datums, lr=3e-2)
    base_model, _ = load_model(str(tiny_model_dir), torch.device("cpu"), "sdpa")
    base_copy = LocalReference(base_model.requires_grad_(False), torch.device("cpu"))

    policy = trainer.forward(datums)
    against_adapters_off = reference.forward(datums)
    against_copy = base_copy.forward(datums)
    for a, b in zip(against_adapters_off, against_copy):
        assert torch.allclose(a, b, atol=1e-5)
    kl = k3(policy, against_adapters_off, datums)
    assert kl > 1e-3  # training moved the policy away from the base model
    assert kl == pytest.approx(k3(policy, against_copy, datums), rel=1e-4)
    # The adapters are back on, and train, after the reference's forward.
    assert all(torch.equal(a, b) for a, b in zip(trainer.forward(datums), policy))
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    step(trainer, datums)
    assert trainer.version == 4


# --- checkpoints: adapters and optimizer only; exact resume -------------------------------------


def test_checkpoint_holds_adapters_and_optimizer_only_and_resumes_exactly(tiny_model_dir, tmp_path):
    _, trainer = make_trainer(tiny_model_dir)
    datums = datums_of(trainer.tokenizer)
    step(trainer, datums)
    trainer.save_state(str(tmp_path / "trainer"))
    saved = read_trainer_state(tmp_path / "trainer")
    adapters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(saved) == {"adapter", "optimizer", "version"} and saved["version"] == 1
    assert set(saved["adapter"]) == set(adapters)
    assert sum(v.numel() for v in saved["adapter"].values()) == sum(p.numel() for p in adapters.values())
    # Adam's two moments per adapter tensor, nothing for the frozen base.
    moments = [s for s in saved["optimizer"]["state"].values()]
    assert sorted(m["exp_avg"].numel() for m in moments) == sorted(p.numel() for p in adapters.values())
    step(trainer, datums)
    continued = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    # Another trainer (other random A's) resumes from the checkpoint and takes the same step.
    _, resumed = make_trainer(tiny_model_dir, seed=7)
    assert not all(torch.equal(continued[n], p) for n, p in resumed.model.named_parameters())
    resumed.load_state(str(tmp_path / "trainer"))
    assert resumed.version == 1
    step(resumed, datums)
    assert all(torch.equal(continued[n], p) for n, p in resumed.model.named_parameters())


def test_a_checkpoint_of_the_other_kind_is_refused(tiny_model_dir, tmp_path):
    _, lora = make_trainer(tiny_model_dir)
    _, full = make_trainer(tiny_model_dir, lora_rank=0)
    lora.save_state(str(tmp_path / "lora.pt"))
    full.save_state(str(tmp_path / "full.pt"))
    with pytest.raises(ValueError, match="holds LoRA adapters, but this trainer trains the whole model"):
        full.load_state(str(tmp_path / "lora.pt"))
    with pytest.raises(ValueError, match="holds the whole model, but this trainer trains LoRA adapters"):
        lora.load_state(str(tmp_path / "full.pt"))
    _, other_targets = make_trainer(tiny_model_dir, lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match="the adapters do not fit this model"):
        other_targets.load_state(str(tmp_path / "lora.pt"))


# --- the policy written for samplers: a plain transformers folder, adapters merged ---------------


def test_saved_policy_is_the_merged_model_in_a_plain_folder(tiny_model_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    _, trainer = make_trainer(tiny_model_dir)
    randomize_adapters(trainer.model)
    path = trainer.save_weights_for_sampler(str(tmp_path / "final"))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert keys == set(plain.state_dict()) - {"lm_head.weight"}  # tied to the embedding
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = trainer.model(ids).logits
        assert torch.allclose(loaded(ids).logits, want, atol=1e-5)
        assert not torch.allclose(plain(ids).logits, want, atol=1e-2)
    # Saving changed nothing in the trainer (no merge into its weights).
    assert all(hasattr(m, "lora_A") and not m.merged for m in trainer.model.modules() if hasattr(m, "lora_A"))
    assert torch.equal(trainer.model(ids).logits, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_merged_policy_is_written_a_weight_at_a_time_as_the_whole_state_dict_was(tiny_model_dir, tmp_path, monkeypatch, dtype):
    from grpo_core.engine import lora as engine_lora

    _, trainer = make_trainer(tiny_model_dir, dtype=dtype)
    randomize_adapters(trainer.model)
    # What was written before: every merged weight built at once, then saved.
    trainer.model.save_pretrained(
        tmp_path / "whole", state_dict=engine_lora.merged_state_dict(trainer.model), max_shard_size=engine_lora.SHARD_SIZE
    )
    made = []

    def watched(model, base):
        for key, merged in merged_weights(model, base):
            assert all(earlier() is None for earlier in made)  # the one before is gone
            made.append(weakref.ref(merged))
            yield key, merged

    merged_weights = engine_lora.merged_weights
    monkeypatch.setattr(engine_lora, "merged_weights", watched)
    trainer.save_weights_for_sampler(str(tmp_path / "streamed"))
    assert len(made) == 2 * len(ALL_PROJECTIONS)  # every adapted layer of both blocks
    whole = sorted(f.name for f in (tmp_path / "whole").iterdir())
    assert whole == sorted(f.name for f in (tmp_path / "streamed").iterdir() if f.name in whole)
    for name in whole:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name


def test_a_layout_one_merged_weight_cannot_make_is_written_whole(tiny_model_dir, tmp_path, monkeypatch):
    from grpo_core.engine import lora as engine_lora

    _, trainer = make_trainer(tiny_model_dir)
    randomize_adapters(trainer.model)
    trainer.model.save_pretrained(
        tmp_path / "whole", state_dict=engine_lora.merged_state_dict(trainer.model), max_shard_size=engine_lora.SHARD_SIZE
    )
    # As where saving would join several of the model's weights into one stored tensor.
    monkeypatch.setattr(engine_lora, "as_saved", lambda model, key, weight: {f"{key}.joined": weight})
    trainer.save_weights_for_sampler(str(tmp_path / "written"))
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "written" / name).read_bytes(), name


# --- the in-process sampler with LoRA ------------------------------------------------------------


def sampler_matches_trainer(sampler, trainer):
    prompts = [trainer.tokenizer("what is 1?")["input_ids"]]
    completion = sampler.sample(prompts, 4, SamplingParams(max_tokens=6, temperature=1.0))[0]
    samples = [
        Sample(prompt=None, tokens=prompts[0] + c.tokens, sampling_logprobs=[0.0] * len(prompts[0]) + c.logprobs,
               loss_mask=[0.0] * len(prompts[0]) + [1.0] * len(c.tokens), text="", finish_reason=c.finish_reason, policy_version=0)
        for c in completion
    ]  # fmt: skip
    got = trainer.forward([sample_to_datum(s) for s in samples])
    n = len(prompts[0])
    return max(float((lp[n - 1 :] - torch.tensor(s.sampling_logprobs[n:])).abs().max()) for lp, s in zip(got, samples))


@pytest.mark.parametrize("fast_forward", [True, False])
@pytest.mark.parametrize("own_weights", [False, True], ids=["shared", "own_copy"])
def test_sampler_samples_the_trained_adapters(tiny_model_dir, fast_forward, own_weights):
    cfg, trainer = make_trainer(tiny_model_dir, fast_forward, weight_sync_interval=2 if own_weights else 1)
    sampler = LocalSamplerPlugin().make_sampler(config=cfg, trainer=trainer)
    assert (sampler.model is not trainer.model) == own_weights
    datums = datums_of(trainer.tokenizer)
    step(trainer, datums, lr=3e-2)
    if own_weights:
        # The copy shares the frozen base weights and has adapters of its own, behind until synced.
        base = dict(trainer.model.named_parameters())
        for name, p in sampler.model.named_parameters():
            assert (p is base[name]) == ("lora_" not in name), name
        assert sampler_matches_trainer(sampler, trainer) > 1e-3
        assert InProcessWeightSync().weight_sync(trainer=trainer, sampler=sampler, step=1) == 1
    assert sampler_matches_trainer(sampler, trainer) < 1e-4
