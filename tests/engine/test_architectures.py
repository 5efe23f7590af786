"""Every architecture family trains on defaults: LoRA target presets, attention chosen per
architecture, sampler and trainer scoring one policy (engine/architectures.py)."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch
import transformers

from grpo_core import hookimpl, selection
from grpo_core.config import RunConfig
from grpo_core.engine import architectures
from grpo_core.engine.lora import adapters_disabled
from grpo_core.engine.models import load_model
from grpo_core.errors import PluginError
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins_manager import PluginEntry
from grpo_core.train import run
from tests.conftest import build_tiny_tokenizer

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SMALL),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**SMALL, "head_dim": 16}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", SMALL),
    "mistral": ("MistralConfig", "MistralForCausalLM", SMALL),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**SMALL, "head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**SMALL, "head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", SMALL),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", SMALL),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**SMALL, **MOE, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**SMALL, **MOE, "num_local_experts": 4}),
    # Layer 0 a dense MLP, layer 1 experts (Qwen3-MoE's mlp_only_layers).
    "qwen3_moe_dense_layer": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              {**SMALL, **MOE, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [0]}),
}  # fmt: skip

LLAMA = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
EXPERT_WEIGHTS = {"experts.gate_up_proj", "experts.down_proj"}
EXPERTS = {"q_proj", "k_proj", "v_proj", "o_proj", *EXPERT_WEIGHTS}
DEFAULT_TARGETS = {
    **dict.fromkeys(("qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3", "olmo2"), LLAMA),
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},
    "qwen3_moe": EXPERTS,
    "mixtral": EXPERTS,
    "qwen3_moe_dense_layer": EXPERTS | {"gate_proj", "up_proj", "down_proj"},
}
"""What gets adapters on defaults: a module's last name, an expert weight as experts.<weight>."""


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    tokenizer = build_tiny_tokenizer()
    built = {}

    def build(family):
        if family not in built:
            config_name, model_name, sizes = FAMILIES[family]
            config = getattr(transformers, config_name)(
                vocab_size=len(tokenizer),
                max_position_embeddings=256,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **sizes,
            )
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(family)
            getattr(transformers, model_name)(config).save_pretrained(path)
            tokenizer.save_pretrained(path)
            built[family] = path
        return built[family]

    return build


SAMPLER_TRAINER_GAPS: list[float] = []


@attrs.define
class SamplerTrainerGap:
    """Records, per loss call, the largest |trainer − sampler| logprob over the trained tokens."""

    @hookimpl(wrapper=True)
    def loss(self, inputs):
        SAMPLER_TRAINER_GAPS.append(
            max(
                float((lp.detach() - s)[m > 0].abs().max())
                for lp, s, m in zip(inputs.logprobs, inputs.sampling_logprobs, inputs.mask)
                if bool((m > 0).any())
            )
        )
        return (yield)


@pytest.fixture(autouse=True)
def test_plugins(monkeypatch):
    original = selection.find
    entries = {
        (kind, name): PluginEntry(kind=kind, name=name, target=target, distribution="tests", version="0")
        for kind, name, target in (
            ("reward", "length", "tests.core.tiny_runs:LengthReward"),
            ("loss", "gap", f"{__name__}:SamplerTrainerGap"),
        )
    }
    monkeypatch.setattr(selection, "find", lambda name, kind=None: entries.get((kind, name)) or original(name, kind))
    SAMPLER_TRAINER_GAPS.clear()


def run_config(model_dir, tiny_dataset, run_dir, **kw):
    return RunConfig(
        model=str(model_dir),
        dataset=str(tiny_dataset),
        prompt_template="Question: {prompt}\nAnswer:",
        max_steps=3,
        prompt_groups_per_step=2,
        completions_per_prompt=4,
        max_completion_tokens=6,
        learning_rate=1e-2,
        reward=["length"],
        loss=["grpo", "gap"],
        logger=["jsonl"],
        run_dir=str(run_dir),
        drop_zero_variance_groups=False,
        **kw,
    )


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights_in(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def adapted_targets(model):
    """The default-target names (as in DEFAULT_TARGETS) that carry adapters in ``model``."""
    names = set()
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            base = name.replace(".base_layer", "")
            names.add(f"experts.{module.parameter_name}" if hasattr(module, "parameter_name") else base.rsplit(".", 1)[-1])
    return names


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trains_3_steps_in_fp32_with_sampler_and_trainer_agreeing(family_dirs, tiny_dataset, tmp_path, family, lora_rank):
    model_dir = family_dirs(family)
    summary = run(run_config(model_dir, tiny_dataset, tmp_path / "run", dtype="float32", lora_rank=lora_rank))
    metrics = metrics_of(tmp_path / "run")
    assert summary["steps"] == 3 and [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss/total"]) and m["optim/skipped_nonfinite"] == 0 for m in metrics)
    # Every step's trained tokens: the sampler's logprobs are the trainer's (the policy changes each step).
    assert len(SAMPLER_TRAINER_GAPS) == 3 and max(SAMPLER_TRAINER_GAPS) <= 1e-4
    before, after = weights_in(model_dir), weights_in(tmp_path / "run" / "final")
    assert after.keys() == before.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    if lora_rank:
        # The merged adapters change exactly the default targets' weights, every expert's included
        # (saved one tensor per expert and projection, as the model's checkpoints hold them).
        modules = [t for t in DEFAULT_TARGETS[family] if not t.startswith("experts.")]
        experts = len(modules) < len(DEFAULT_TARGETS[family])
        expected = {k for k in before if any(k.endswith(f".{t}.weight") for t in modules) or (experts and ".experts." in k)}
        assert changed == expected
    else:
        assert changed
    saved = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert saved["attn_implementation"] == ("eager" if family == "gemma2" else "sdpa")


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trains_3_steps_in_bf16(family_dirs, tiny_dataset, tmp_path, family, lora_rank):
    run(run_config(family_dirs(family), tiny_dataset, tmp_path / "run", dtype="bfloat16", lora_rank=lora_rank))
    metrics = metrics_of(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss/total"]) and math.isfinite(m["optim/grad_norm"]) for m in metrics)
    assert len(SAMPLER_TRAINER_GAPS) == 3 and all(math.isfinite(g) for g in SAMPLER_TRAINER_GAPS)


def make_trainer(model_dir, **config):
    torch.manual_seed(0)
    return LocalBackend().make_trainer(config=RunConfig(model=str(model_dir), **{"lora_rank": 4, **config}))


@pytest.mark.parametrize("family", FAMILIES)
def test_default_targets_are_the_familys_projections(family_dirs, family):
    trainer = make_trainer(family_dirs(family))
    assert adapted_targets(trainer.model) == DEFAULT_TARGETS[family]
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)


@pytest.mark.parametrize(
    ("family", "targets"),
    [("phi3", "auto"), ("gpt2", "auto"), ("qwen3_moe", "auto"), ("mixtral", "auto"), ("qwen3_moe_dense_layer", "auto"),
     ("mixtral", "auto-no-experts")],
)  # fmt: skip
def test_the_policy_written_for_a_sampler_is_the_adapted_model(family_dirs, tmp_path, family, targets):
    trainer = make_trainer(family_dirs(family), lora_target_modules=[targets])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    input_ids = torch.randint(0, 290, (2, 9), generator=gen)
    with torch.no_grad():
        adapted = trainer.model(input_ids=input_ids).logits
        trainer.save_weights_for_sampler(str(tmp_path / "policy"))
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()(input_ids=input_ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(family_dirs(family)).eval()(input_ids=input_ids).logits
        with adapters_disabled(trainer.model):  # a LoRA run's KL reference
            reference = trainer.model(input_ids=input_ids).logits
    assert float((adapted - base).abs().max()) > 1e-2
    assert torch.allclose(merged, adapted, atol=1e-4)
    assert torch.allclose(reference, base, atol=1e-5)


def test_all_linear_adapts_every_linear_layer_and_the_experts(family_dirs):
    trainer = make_trainer(family_dirs("qwen3_moe"), lora_target_modules=["all-linear"])
    assert adapted_targets(trainer.model) == EXPERTS
    trainer = make_trainer(family_dirs("gpt2"), lora_target_modules=["all-linear"])
    assert adapted_targets(trainer.model) == {"c_attn", "c_proj", "c_fc"}
    # The output head is never adapted (its weight is the embedding's here).
    assert not hasattr(trainer.model.lm_head, "lora_A")


def test_names_pick_modules_and_expert_weights(family_dirs):
    trainer = make_trainer(family_dirs("mixtral"), lora_target_modules=["o_proj", "mlp.experts.down_proj"])
    assert adapted_targets(trainer.model) == {"o_proj", "experts.down_proj"}


def test_a_dense_layers_projection_is_that_layer_not_the_experts(family_dirs):
    # peft would read up_proj as transformers 4's expert projection, fused into gate_up_proj in 5, and refuse it alone.
    trainer = make_trainer(family_dirs("qwen3_moe_dense_layer"), lora_target_modules=["up_proj"])
    assert [n for n, m in trainer.model.named_modules() if hasattr(m, "lora_A")] == ["model.layers.0.mlp.up_proj"]


def test_an_architecture_without_a_preset_gets_all_linear(family_dirs, monkeypatch):
    monkeypatch.delitem(architectures.LORA_PRESETS, "olmo2")
    trainer = make_trainer(family_dirs("olmo2"))
    assert adapted_targets(trainer.model) == LLAMA


def test_experts_without_a_preset_are_refused_not_skipped(family_dirs, monkeypatch):
    monkeypatch.delitem(architectures.LORA_PRESETS, "mixtral")
    with pytest.raises(PluginError) as err:
        make_trainer(family_dirs("mixtral"))
    assert str(err.value) == (
        "--lora-target-modules auto: this mixtral model's expert weights ('model.layers.0.mlp.experts.gate_up_proj', ...) "
        "are not linear layers and would get no adapters; name the targets instead, the experts by their weights "
        "(e.g. mlp.experts.gate_up_proj), or leave the experts out with auto-no-experts"
    )
    # Left out by choice, they are: every linear layer but the router and the head gets adapters.
    trainer = make_trainer(family_dirs("mixtral"), lora_target_modules=["auto-no-experts"])
    assert adapted_targets(trainer.model) == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_moe_dense_layer"])
def test_auto_no_experts_adapts_the_defaults_but_the_experts(family_dirs, family):
    trainer = make_trainer(family_dirs(family), lora_target_modules=["auto-no-experts"])
    assert adapted_targets(trainer.model) == DEFAULT_TARGETS[family] - EXPERT_WEIGHTS
    experts = [p for n, p in trainer.model.named_parameters() if ".experts." in n]
    assert experts and not any(p.requires_grad for p in experts)


def test_auto_no_experts_on_a_model_without_experts_is_refused(family_dirs):
    with pytest.raises(PluginError) as err:
        make_trainer(family_dirs("llama"), lora_target_modules=["auto-no-experts"])
    assert str(err.value) == "--lora-target-modules auto-no-experts: this llama model has no experts; use auto"


def test_a_preset_that_matches_nothing_is_one_clear_error(family_dirs, monkeypatch):
    # A preset written for other module names (another transformers version's) adapts nothing: refused.
    monkeypatch.setitem(architectures.LORA_PRESETS, "llama", architectures.LoraTargets(("qkv_proj", "w1")))
    with pytest.raises(PluginError) as err:
        make_trainer(family_dirs("llama"))
    assert str(err.value) == (
        "--lora-target-modules auto: nothing in this llama model would get adapters (its linear layers: down_proj, gate_proj, "
        "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; or auto, auto-no-experts, all-linear)"
    )


def test_a_linear_router_gets_no_adapters(family_dirs):
    model, _ = load_model(str(family_dirs("mixtral")), torch.device("cpu"), "auto")
    for layer in model.model.layers:
        # The router as an nn.Linear, as some MoE types hold it (AFMoE).
        layer.mlp.gate = torch.nn.Linear(64, 4, bias=False)
    assert architectures.router_names(model) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    targets = architectures.lora_targets(model, ["all-linear"])
    assert {t.rsplit(".", 1)[-1] for t in targets.modules} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert targets.parameters == architectures.EXPERT_PROJECTIONS
    with pytest.raises(PluginError, match=r"^--lora-target-modules: 'gate' is in a router \(model.layers.0.mlp.gate, "):
        architectures.lora_targets(model, ["q_proj", "gate"])


@pytest.mark.parametrize(
    ("family", "targets", "message"),
    [
        (
            "mixtral",
            ["q_proj", "gate_proj"],
            "--lora-target-modules: 'gate_proj' matches nothing in this mixtral model (its linear layers: k_proj, lm_head, o_proj, "
            "q_proj, v_proj; its expert weights: mlp.experts.down_proj, mlp.experts.gate_up_proj; or auto, auto-no-experts, "
            "all-linear)",
        ),
        (
            "mixtral",
            ["q_proj", "gate"],
            "--lora-target-modules: 'gate' is in a router (model.layers.0.mlp.gate, which picks the experts each token reaches); "
            "routers get no adapters (docs/performance.md, LoRA)",
        ),
        (
            "qwen3_moe",
            ["mlp.gate.weight"],
            "--lora-target-modules: 'mlp.gate.weight' is in a router (model.layers.0.mlp.gate.weight, which picks the experts "
            "each token reaches); routers get no adapters (docs/performance.md, LoRA)",
        ),
        (
            "gpt2",
            ["q_proj"],
            "--lora-target-modules: 'q_proj' matches nothing in this gpt2 model (its linear layers: c_attn, c_fc, c_proj, lm_head; "
            "or auto, auto-no-experts, all-linear)",
        ),
        (
            "llama",
            ["q_proj", "self_attn"],
            "--lora-target-modules: 'self_attn' is a LlamaAttention, not a linear layer (its linear layers: down_proj, gate_proj, "
            "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; or auto, auto-no-experts, all-linear)",
        ),
        ("llama", ["auto", "q_proj"], "--lora-target-modules: 'auto' stands alone, not beside other names (auto q_proj)"),
        ("llama", [], "--lora-rank needs at least one --lora-target-modules (auto, auto-no-experts, all-linear or names)"),
    ],
)
def test_targets_that_match_nothing_are_one_clear_error(family_dirs, family, targets, message):
    with pytest.raises(PluginError) as err:
        make_trainer(family_dirs(family), lora_target_modules=targets)
    assert str(err.value) == message


@pytest.mark.parametrize(("family", "expected"), [("gemma2", "eager"), ("llama", "sdpa"), ("qwen3_moe", "sdpa")])
def test_auto_attention_is_one_the_architecture_supports(family_dirs, family, expected):
    model, _ = load_model(str(family_dirs(family)), torch.device("cpu"), "auto")
    assert model.config._attn_implementation == expected


def test_sdpa_where_the_architecture_has_none_is_refused(family_dirs):
    with pytest.raises(PluginError) as err:
        load_model(str(family_dirs("gemma2")), torch.device("cpu"), "sdpa")
    assert str(err.value) == "--backend-opt attn_implementation=sdpa: Gemma2ForCausalLM has no sdpa attention; use auto (eager here)"


def test_the_saved_policy_carries_its_attention_to_eval_and_export(family_dirs, tmp_path):
    trainer = LocalBackend(attn_implementation="eager").make_trainer(config=RunConfig(model=str(family_dirs("llama"))))
    assert trainer.model.config._attn_implementation == "eager"
    trainer.save_weights_for_sampler(str(tmp_path / "policy"))
    # What eval and export do with a saved policy: load it with the backend's defaults.
    reloaded, _ = load_model(str(tmp_path / "policy"), torch.device("cpu"), "auto")
    assert reloaded.config._attn_implementation == "eager"
    # A plain from_pretrained reads it too; an explicit choice still wins.
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy").config._attn_implementation == "eager"
    explicit, _ = load_model(str(tmp_path / "policy"), torch.device("cpu"), "sdpa")
    assert explicit.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_packs_sequences_exactly(family_dirs, family):
    from grpo_core.engine.forward import TransformersForward
    from grpo_core.engine.logprobs import first_trained, target_logprobs
    from tests.engine.ragged_datums import ragged_datums

    model, _ = load_model(str(family_dirs(family)), torch.device("cpu"), "auto")
    forward = TransformersForward(model, padding_free=True)
    assert forward.packing_problem is None
    datums = ragged_datums()
    with torch.no_grad():
        packed, padded = (target_logprobs(forward, datums, torch.device("cpu"), one_pass=True, packed=p)[0] for p in (True, False))
    for d, got, want in zip(datums, packed, padded):
        first = first_trained(d.loss_fn_inputs["weights"].data)
        assert torch.allclose(got[first:], want[first:], rtol=0, atol=1e-6), float((got - want)[first:].abs().max())


@pytest.mark.parametrize(
    ("family", "targets"),
    [("qwen3_moe", "auto"), ("mixtral", "auto"), ("qwen3_moe_dense_layer", "auto"), ("mixtral", "auto-no-experts")],
)
def test_lora_rank_8_trains_a_moe_model_from_the_command_line(family_dirs, tiny_dataset, tmp_path, family, targets):
    """`grpo-core run --lora-rank 8` on a MoE model: adapters where the targets say (every expert's
    own trained on auto, none on auto-no-experts, never the router), and final/ (the merged policy,
    also what `grpo-core export` writes from the last checkpoint) is the adapted model."""
    from tests.helpers import SIGNAL, grpo_core_in_process, small_run_args

    model_dir, run_dir = family_dirs(family), tmp_path / "run"
    choice = [] if targets == "auto" else ["--lora-target-modules", targets]
    args = ("--max-steps", "3", "--lora-rank", "8", "--loss-opt", "kl_beta=0.05", *SIGNAL, *choice)
    out = grpo_core_in_process(*small_run_args(model_dir, tiny_dataset, run_dir, *args))
    assert out.returncode == 0, out.stderr
    metrics = metrics_of(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # The reference is the base model (the adapters off, the experts' included): the KL grows from 0.
    assert metrics[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6) and metrics[-1]["kl/mean"] > 1e-6

    trainer = make_trainer(model_dir, lora_rank=8, lora_target_modules=[targets])
    trainer.load_state(str(run_dir / "checkpoints" / "step-000003" / "trainer"))
    expected = DEFAULT_TARGETS[family] - (EXPERT_WEIGHTS if targets == "auto-no-experts" else set())
    assert adapted_targets(trainer.model) == expected
    assert not any(".mlp.gate." in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    experts = 0
    for name, module in trainer.model.named_modules():
        if hasattr(module, "lora_B"):
            # B starts at zero: every adapter moved, each expert's slice of an expert weight's own.
            lora_B = module.lora_B["default"].weight
            per_expert = lora_B.reshape(lora_B.shape[0], -1, getattr(module, "num_experts", 1))
            assert bool((per_expert.abs().amax(dim=(0, 1)) > 0).all()), name
            experts += getattr(module, "num_experts", 1) > 1
    assert experts == (0 if targets == "auto-no-experts" else 2 * len(trainer.model.model.layers) - (family == "qwen3_moe_dense_layer") * 2)

    # The merged weights differ from the base exactly where adapters are: experts included or not.
    before, after = weights_in(model_dir), weights_in(run_dir / "final")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    modules = [t for t in expected if not t.startswith("experts.")]
    assert changed == {
        k for k in before if any(k.endswith(f".{t}.weight") for t in modules) or (".experts." in k and expected & EXPERT_WEIGHTS)
    }
    assert grpo_core_in_process("export", str(run_dir), str(tmp_path / "export"), "--step", "3").returncode == 0
    exported = weights_in(tmp_path / "export")
    assert exported.keys() == after.keys() and all(torch.equal(exported[k], after[k]) for k in after)
    input_ids = torch.randint(0, 290, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = trainer.model(input_ids=input_ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()(input_ids=input_ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5), float((merged - adapted).abs().max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_moe_policy_is_written_a_weight_at_a_time_as_the_whole_state_dict_was(family_dirs, tmp_path, monkeypatch, family, dtype):
    """Saving writes a MoE layer's fused experts one tensor per expert (Mixtral's as w1, w2, w3):
    each merged expert weight goes into those places, not through the whole merged state dict."""
    import weakref

    from grpo_core.engine import lora as engine_lora

    trainer = make_trainer(family_dirs(family), dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    trainer.model.save_pretrained(
        tmp_path / "whole", state_dict=engine_lora.merged_state_dict(trainer.model), max_shard_size=engine_lora.SHARD_SIZE
    )
    made = []
    merged_weights = engine_lora.merged_weights

    def watched(model, base):
        for key, merged in merged_weights(model, base):
            assert all(earlier() is None for earlier in made)  # the one before is gone
            made.append(weakref.ref(merged))
            yield key, merged

    def refused(model):
        raise AssertionError("the merged state dict was built whole")

    monkeypatch.setattr(engine_lora, "merged_weights", watched)
    monkeypatch.setattr(engine_lora, "merged_state_dict", refused)
    trainer.save_weights_for_sampler(str(tmp_path / "streamed"))
    assert len(made) == 2 * (4 + 2)  # both layers' attention projections and expert weights
    whole = sorted(f.name for f in (tmp_path / "whole").iterdir())
    assert any(".experts.3." in k for k in weights_in(tmp_path / "whole"))
    assert whole == sorted(f.name for f in (tmp_path / "streamed").iterdir() if f.name in whole)
    for name in whole:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name
