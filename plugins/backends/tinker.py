"""The ``tinker`` backend: train a LoRA adapter on a remote Tinker-API service through the ``tinker`` SDK."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import tinker
import torch

from grpo_core import hookimpl, option
from grpo_core.backend import CustomLossFn
from grpo_core.config import RunConfig
from grpo_core.engine.models import model_path
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.loss import LossInputs, aggregate, validate_positive
from grpo_core.plugins_manager import make_plugin
from grpo_core.remote import tinker_sdk as sdk

STATE_FORMAT = "grpo-core-tinker-state-1"
POINTER_FILE = "tinker_weights.json"
"""What ``save_weights_for_sampler`` writes beside the tokenizer: where the service keeps the policy."""


DEFAULT_RANK = 32
"""The LoRA rank when neither --lora-rank nor the rank option gives one (the SDK's default)."""


def _validate_rank(instance: Any, attribute: Any, value: int) -> None:
    if value < 0:
        raise ValueError(f"rank must be >= 0 (0 = --lora-rank, else {DEFAULT_RANK}), got {value}")


@attrs.define
class TinkerBackend:
    """Train on a remote Tinker-API service (the hosted Tinker, or an open server such as skyrl).

    A LoRA training client on the service trains --model; losses run unchanged: the service
    computes the sampled tokens' logprobs, the loss and its gradient with respect to them are
    computed here, and the service backpropagates that gradient (forward_backward_custom: a
    forward, then a forward/backward). Where the selected loss has a built-in equivalent on the
    service (importance_sampling; cispo; dapo without dual_clip and grpo without KL as ppo) and
    no wrapper is selected, the service computes it in one forward/backward (builtin_losses).
    Checkpoints are kept on the service; the run's checkpoint folder holds their tinker:// path.
    The policy written for a sampler (final/, the vllm weight sync's folder, grpo-core export) is a
    transformers model: the service's LoRA adapter, downloaded and merged into --model's weights.
    The adapter's rank is the rank option, else --lora-rank, else 32.
    The API key is read from the variable named by api_key_env unless api_key is given; it is
    never written or logged.
    """

    base_url: str = option("", help="the service's address (empty = TINKER_BASE_URL, else the hosted Tinker service)")
    api_key: str = option("", help="API key (empty = the variable named by api_key_env); give it as env:NAME", secret=True, repr=False)
    api_key_env: str = option("TINKER_API_KEY", help="environment variable holding the API key when api_key is empty")
    base_model: str = option("", help="the model's name on the service (empty = --model; the embedded model: its folder)")
    rank: int = option(
        0, help=f"LoRA rank of the trained adapter (0 = --lora-rank when given, else {DEFAULT_RANK})", validator=_validate_rank
    )
    connect_deadline: float = option(
        30.0, help="seconds opening the training client on the service may take before the run stops", validator=validate_positive
    )
    builtin_losses: bool = option(
        True, help="run a loss on the service when it has the same built-in (one forward/backward instead of two)"
    )
    loss_reduction: Literal["sum", "sequence_mean"] = option(
        "sum",
        help="how the service reduces a loss over tokens: sum (Tinker's contract) or sequence_mean "
        "(skyrl 0.3.0: each sequence over its weights' sum, then the mean over the step's sequences)",
    )

    default_sampler = "tinker"
    local_checkpoints = False  # the service keeps the trainer's state: the disk plan counts final/ only
    # A weight sync hands the sampler a sampling client of the new weights, as in_process hands weights.
    default_weight_sync = "in_process"

    @hookimpl
    def load_tokenizer(self, config: RunConfig) -> tuple[Any, int | None]:
        from grpo_core.plugins.backends.local import LocalBackend

        return LocalBackend().load_tokenizer(config=config)

    @hookimpl
    def check_config(self, config: RunConfig) -> None:
        if config.gradient_checkpointing:
            raise PluginError("--gradient-checkpointing applies to the local trainer only: a Tinker service manages its own memory")
        if config.train_vision:
            raise PluginError("--train-vision applies to the local trainer only: image prompts do not reach a Tinker service")
        if config.optimizer_state not in ("auto", "fp32"):
            raise PluginError(
                f"--optimizer-state {config.optimizer_state} applies to the local trainer only: "
                "a Tinker service keeps its own optimizer state"
            )
        if config.dtype != "auto":
            raise PluginError(f"--dtype {config.dtype} applies to the local trainer only: a Tinker service chooses its own precision")
        self.lora_rank(config)

    @hookimpl
    def make_trainer(self, config: RunConfig) -> TinkerTrainer:
        from transformers import AutoTokenizer

        self.check_config(config)
        rank = self.lora_rank(config)
        base_model = self.base_model or model_path(config.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path(config.model))
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        key = sdk.api_key_from(self.api_key, self.api_key_env)
        service, training = sdk.call_within(
            self.connect_deadline,
            f"the Tinker service at {self.base_url or 'the SDK default (TINKER_BASE_URL, else the hosted service)'}",
            lambda: sdk.training_client(self.base_url, key, base_model, rank, config.seed),
        )
        builtin = builtin_loss(config) if self.builtin_losses else None
        return TinkerTrainer(
            service=service,
            training=training,
            tokenizer=tokenizer,
            base_model=base_model,
            builtin=builtin,
            reduction=self.loss_reduction,
            model=model_path(config.model),
        )

    def lora_rank(self, config: RunConfig) -> int:
        """The adapter's rank: the rank option, else --lora-rank, else the SDK's default."""
        default = RunConfig()
        changed = [flag for flag, field in (("--lora-alpha", "lora_alpha"), ("--lora-target-modules", "lora_target_modules"))
                   if getattr(config, field) != getattr(default, field)]  # fmt: skip
        if changed:
            # The service's API takes a rank only; its alpha and modules are its own (written in the adapter it serves).
            raise PluginError(f"{' and '.join(changed)} apply to the local trainer only: a Tinker service takes a LoRA rank alone")
        if self.rank and config.lora_rank and self.rank != config.lora_rank:
            raise PluginError(f"two LoRA ranks: --lora-rank {config.lora_rank} and --trainer-opt rank={self.rank}; give one of them")
        return self.rank or config.lora_rank or DEFAULT_RANK

    @hookimpl
    def make_reference(self, config: RunConfig, trainer: TinkerTrainer) -> TinkerReference:
        # The base model's sampling client scores tokens: the reference is the untrained policy
        # (a LoRA adapter starts at zero) without a second training client.
        return TinkerReference(sdk.sampling_client(trainer.service, base_model=trainer.base_model))


@attrs.frozen
class BuiltinLoss:
    """A loss of the service's that computes what a grpo-core loss computes."""

    name: str
    """The service's loss: importance_sampling, ppo or cispo."""
    agg: str
    config: dict[str, float] | None = None


def builtin_loss(config: RunConfig) -> BuiltinLoss | None:
    """The service's equivalent of the run's loss, or None when only the custom path computes it:
    a wrapper (TIS) is selected, a KL term needs the reference, or an option has no built-in."""
    if len(config.loss) != 1:
        return None
    name = config.loss[0]
    loss = make_plugin(name, kind="loss", **config.plugin_options.get("loss", {}).get(name, {}))
    if declared(loss, "loss", "needs_reference"):
        return None
    service = declared(loss, "loss", "service_loss")
    if service is None:
        return None
    return BuiltinLoss(service["loss_fn"], service["agg"], service.get("loss_fn_config"))


class StepLoss(Protocol):
    """A ``loss_fn`` that also tells what the loss is computed from (the core's step loss).

    ``inputs(logprobs)`` builds the loss hook's inputs for given logprobs; ``on_policy`` is True
    when the ratio anchors on the current policy's own (detached) logprobs."""

    on_policy: bool

    def __call__(self, datums: Sequence[tinker.Datum], logprobs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]: ...

    def inputs(self, logprobs: list[torch.Tensor]) -> LossInputs: ...


def token_weights(inputs: LossInputs, agg: str) -> list[torch.Tensor]:
    """∂(aggregated loss)/∂ℓ_t for every token: what the service's sum over tokens must weigh each
    token's term by to give the aggregation (the step's normalizers included)."""
    padded = inputs.padded()
    term_B_T = torch.zeros_like(padded.mask_B_T, requires_grad=True)
    aggregate(term_B_T, padded, agg).backward()
    return [term_B_T.grad[i, : len(m)] for i, m in enumerate(inputs.mask)]


def _tensor_data(values: torch.Tensor) -> tinker.TensorData:
    return tinker.TensorData.from_torch(values.detach().to(torch.float32).contiguous())


@attrs.define(eq=False)
class TinkerTrainer:
    """The :class:`grpo_core.backend.Trainer` of a LoRA training client on a Tinker service."""

    service: Any
    training: Any
    tokenizer: Any
    base_model: str
    builtin: BuiltinLoss | None = None
    reduction: str = "sum"
    """How the service reduces a loss's per-token terms: "sum" or "sequence_mean" (see the option)."""
    version: int = 0
    pending: list[tuple[tinker.Datum, torch.Tensor, torch.Tensor]] = attrs.field(factory=list)
    """The custom path's (datum, its forward's logprobs, ∂loss/∂logprobs), sent with the optimizer
    step: a step with a non-finite loss then leaves no gradient on the service."""
    nonfinite_loss: bool = False
    counts: dict[str, int] = attrs.field(factory=lambda: {"forward": 0, "forward_backward": 0})
    sampler_cache: tuple[int, Any] | None = None
    saved_sampler: tuple[int, str] | None = None
    """The version and tinker:// path of the weights last saved for sampling."""
    model: str = ""
    """--model's local folder (or hub name): the base the service's adapter is merged into."""

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        self.counts["forward"] += 1
        output = sdk.resolved(self.training.forward(list(datums), "cross_entropy"))
        return [torch.tensor(lp, dtype=torch.float32) for lp in sdk.logprobs_of(output)]

    def forward_backward_custom(self, datums: Sequence[tinker.Datum], loss_fn: CustomLossFn) -> tinker.ForwardBackwardOutput:
        if self.builtin is not None and hasattr(loss_fn, "inputs") and (not loss_fn.on_policy or self.reduction == "sum"):
            return self._forward_backward_builtin(datums, loss_fn)
        logprobs = [lp.requires_grad_(True) for lp in self.forward(datums)]
        loss, metrics = loss_fn(datums, logprobs)
        if torch.isfinite(loss):
            loss.backward()
            for datum, lp in zip(datums, logprobs):
                self.pending.append((datum, lp.detach(), lp.grad if lp.grad is not None else torch.zeros_like(lp)))
        else:
            self.nonfinite_loss = True
        return _output(logprobs, metrics, loss)

    def _backward_datums(self) -> tuple[str, list[tinker.Datum]]:
        """The service loss and datums whose gradient is the pending custom-loss gradient."""
        if self.reduction == "sum":
            # Σ −weight·logprob: weights = −∂loss/∂logprob backpropagate the loss computed here.
            return "cross_entropy", [
                tinker.Datum(
                    model_input=d.model_input,
                    loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": _tensor_data(-grad)},
                )
                for d, _, grad in self.pending
            ]
        # A mean of per-sequence means over the weights scales each sequence's weights away, so the
        # gradient rides on importance_sampling instead: ratio exp(π − π_forward) = 1 with gradient
        # ∇π, every position weighted 1, advantages scaled by the sequence's length and the count.
        count = len(self.pending)
        return "importance_sampling", [
            tinker.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "weights": _tensor_data(torch.ones_like(lp)),
                    "logprobs": _tensor_data(lp),
                    "advantages": _tensor_data(-grad * len(lp) * count),
                },
            )
            for d, lp, grad in self.pending
        ]

    def _forward_backward_builtin(self, datums: Sequence[tinker.Datum], loss_fn: StepLoss) -> tinker.ForwardBackwardOutput:
        """One forward/backward of the service's own loss, then the run's loss on the logprobs of
        that forward for the loss value and metrics."""
        assert self.builtin is not None
        placeholders = [torch.zeros(len(d.loss_fn_inputs["target_tokens"].data)) for d in datums]
        inputs = loss_fn.inputs(placeholders)
        weights = token_weights(inputs, self.builtin.agg)
        sent, data = [], []
        for i, datum in enumerate(datums):
            trained = float(inputs.mask[i].sum())
            if trained == 0:
                continue  # no term, and a sequence_mean service would count it
            advantages = inputs.advantages[i] * weights[i] * inputs.mask[i]
            if self.reduction == "sequence_mean":
                advantages = advantages * trained * inputs.num_sequences
            if loss_fn.on_policy:
                # At ratio 1 every mapped loss has the gradient −A·∇log π: the service's
                # cross_entropy with weights A gives it without knowing π_old.
                loss_fn_inputs = {"target_tokens": datum.loss_fn_inputs["target_tokens"], "weights": _tensor_data(advantages)}
            else:
                loss_fn_inputs = {
                    "target_tokens": datum.loss_fn_inputs["target_tokens"],
                    "weights": _tensor_data(inputs.mask[i]),
                    "advantages": _tensor_data(advantages),
                    "logprobs": _tensor_data(inputs.old_logprobs[i]),
                }
            sent.append(i)
            data.append(tinker.Datum(model_input=datum.model_input, loss_fn_inputs=loss_fn_inputs))
        name, config = ("cross_entropy", None) if loss_fn.on_policy else (self.builtin.name, self.builtin.config)
        logprobs = [torch.zeros_like(p) for p in placeholders]
        if data:
            self.counts["forward_backward"] += 1
            output = sdk.resolved(self.training.forward_backward(data, name, config))
            for i, lp in zip(sent, sdk.logprobs_of(output)):
                logprobs[i] = torch.tensor(lp, dtype=torch.float32)
        with torch.no_grad():
            loss, metrics = loss_fn(datums, logprobs)
        if not torch.isfinite(loss):
            raise PluginError(
                f"the loss was non-finite ({float(loss)}) after the service had backpropagated its built-in {name} loss, "
                "which cannot be undone; resume from the last checkpoint, with --backend-opt builtin_losses=false to skip such steps"
            )
        return _output(logprobs, metrics, loss)

    def optim_step(self, adam_params: tinker.AdamParams) -> dict[str, float]:
        skip = self.nonfinite_loss
        metrics: dict[str, float] = {}
        if not skip:
            if self.pending:
                self.counts["forward_backward"] += 1
                loss_name, data = self._backward_datums()
                sdk.resolved(self.training.forward_backward(data, loss_name))
            response = sdk.resolved(self.training.optim_step(adam_params=adam_params))
            metrics = {f"optim/{k}": float(v) for k, v in (getattr(response, "metrics", None) or {}).items()}
            self.version += 1
        self.pending = []
        self.nonfinite_loss = False
        return {**metrics, "optim/lr": adam_params.learning_rate, "optim/skipped_nonfinite": float(skip)}

    def save_state(self, path: str) -> None:
        saved = sdk.resolved(self.training.save_state(self._checkpoint_name()))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        state = {"format": STATE_FORMAT, "tinker_path": saved.path, "version": self.version, "base_model": self.base_model}
        Path(path).write_text(json.dumps(state, indent=1) + "\n")

    def load_state(self, path: str) -> None:
        state = json.loads(Path(path).read_text())
        if state.get("format") != STATE_FORMAT:
            raise PluginError(f"{path} is not a tinker trainer's checkpoint (format {state.get('format')!r})")
        self.training = sdk.load_state(self.service, self.training, state["tinker_path"])
        self.version = int(state["version"])
        self.sampler_cache = None
        self.saved_sampler = None

    def sampling_client(self) -> Any:
        """A sampling client of the current weights (saved on the service once per version)."""
        if self.sampler_cache is None or self.sampler_cache[0] != self.version:
            self.sampler_cache = (self.version, sdk.sampling_client(self.service, model_path=self.sampler_path()))
        return self.sampler_cache[1]

    def sampler_path(self) -> str:
        """The tinker:// path of the current weights saved for sampling (saved once per version)."""
        if self.saved_sampler is None or self.saved_sampler[0] != self.version:
            saved = sdk.resolved(self.training.save_weights_for_sampler(self._checkpoint_name()))
            self.saved_sampler = (self.version, saved.path)
        return self.saved_sampler[1]

    def _checkpoint_name(self) -> str:
        return f"grpo-core-v{self.version}-{uuid.uuid4().hex[:8]}"

    def save_weights_for_sampler(self, path: str) -> str:
        """The policy as a transformers model folder: the service's LoRA adapter of the current
        weights, downloaded and merged into --model's weights, with the tokenizer; beside them
        tinker_weights.json keeps the weights' tinker:// path."""
        if not self.model:
            raise PluginError("the tinker trainer needs --model's weights to write the policy as a model (no local model was given)")
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        tinker_path = self.sampler_path()
        with tempfile.TemporaryDirectory(prefix="grpo-core-tinker-weights-") as download:
            sdk.download_weights(self.service, self.training, self._checkpoint_name(), tinker_path, Path(download))
            write_merged_model(self.model, Path(download), folder)
        pointer = {"tinker_path": tinker_path, "base_model": self.base_model, "version": self.version}
        (folder / POINTER_FILE).write_text(json.dumps(pointer, indent=1) + "\n")
        self.tokenizer.save_pretrained(path)
        return path

    def save_adapter_for_sampler(self, path: str) -> None:
        """The service's LoRA adapter of the current weights alone, as a PEFT adapter folder that
        vLLM loads (declared in hookspecs): MBs where the merged model is GBs."""
        with tempfile.TemporaryDirectory(prefix="grpo-core-tinker-weights-") as download:
            sdk.download_weights(self.service, self.training, self._checkpoint_name(), self.sampler_path(), Path(download))
            write_servable_adapter(Path(download), Path(path))


ADAPTER_CONFIG = "adapter_config.json"


def write_servable_adapter(weights: Path, out: Path) -> None:
    """``out``: the service's LoRA adapter in ``weights`` as vLLM loads one (adapter_config.json as
    the service wrote it, its factors in adapter_model.safetensors); refused where it is no adapter
    of linear layers (a full model, or an embedding's or output layer's factors, which a vLLM LoRA
    adapter does not carry)."""
    from safetensors.torch import load_file, save_file

    from grpo_core.engine.lora import ADAPTER_FILE

    full = "sync with --weight-sync-opt method=full or method=delta (the merged model)"
    if not (weights / ADAPTER_CONFIG).is_file():
        raise PluginError(f"the service's weights are no LoRA adapter ({sorted(p.name for p in weights.iterdir())}): {full}")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(weights.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if not tensors:
        raise PluginError(f"the service's LoRA adapter holds no safetensors file ({sorted(p.name for p in weights.iterdir())})")
    targets = set()
    for key in tensors:
        module, _, factor = key.removesuffix(".weight").rpartition(".")
        if factor not in ("lora_A", "lora_B") or module.rpartition(".")[2] in ("embed_tokens", "lm_head"):
            raise PluginError(f"the service's LoRA adapter holds {key}, not a factor of a linear layer that vLLM adapts: {full}")
        targets.add(module.rpartition(".")[2])
    config = json.loads((weights / ADAPTER_CONFIG).read_text())
    # What a reader of PEFT's format needs and a service may leave out: the type, the modules adapted.
    config.setdefault("peft_type", "LORA")
    config["target_modules"] = config.get("target_modules") or sorted(targets)
    out.mkdir(parents=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / ADAPTER_FILE), metadata={"format": "pt"})


def write_merged_model(base: str, weights: Path, out: Path) -> None:
    """``out``: the model of --model (``base``) with the service's weights in ``weights``: a LoRA
    adapter in PEFT's layout (adapter_config.json, A and B per module) is merged into the base's
    weights; a full model (config.json and safetensors) is taken as it is."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if not (weights / ADAPTER_CONFIG).is_file():
        if not (weights / "config.json").is_file() or not any(weights.glob("*.safetensors")):
            raise PluginError(f"the service's weights are neither a LoRA adapter nor a model: {sorted(p.name for p in weights.iterdir())}")
        shutil.copytree(weights, out, dirs_exist_ok=True)
        return
    config = json.loads((weights / ADAPTER_CONFIG).read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise PluginError(
            "the service's LoRA adapter sets ranks or alphas per module (rank_pattern, alpha_pattern), which the merge does not read"
        )
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(weights.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, factor = key.removeprefix("base_model.model.").removesuffix(".weight").rpartition(".")
        if factor not in LORA_FACTORS:
            raise PluginError(f"the service's LoRA adapter holds {key}, which is not a LoRA factor ({', '.join(LORA_FACTORS)})")
        factors.setdefault(module, {})[factor] = value.to(torch.float32)
    modules = {}
    for name, _pair in factors.items():
        try:
            modules[name] = model.get_submodule(name)
        except AttributeError:
            raise PluginError(f"the service's LoRA adapter changes {name}, which {base} does not have") from None
    output_layer = model.get_output_embeddings()
    if model.config.get_text_config().tie_word_embeddings and {model.get_input_embeddings(), output_layer} & set(modules.values()):
        # The adapter changes the embedding or the output layer alone: each gets its own weight.
        output_layer.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.config.get_text_config().tie_word_embeddings = False
        model.config.tie_word_embeddings = False
    with torch.no_grad():
        for name, pair in factors.items():
            weight = modules[name].weight
            delta = lora_delta(pair, tuple(weight.shape), isinstance(modules[name], torch.nn.Embedding), name)
            weight.copy_((weight.to(torch.float32) + scale * delta).to(weight.dtype))
    model.save_pretrained(str(out))


LORA_FACTORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def lora_delta(factors: dict[str, torch.Tensor], shape: tuple[int, ...], embedding: bool, module: str) -> torch.Tensor:
    """The unscaled change of a weight of ``shape`` from its LoRA factors, in the layout their names
    tell: a linear layer's lora_A (rank × in) and lora_B (out × rank), B·A; an embedding's in PEFT,
    lora_embedding_A (rank × vocab) and lora_embedding_B (hidden × rank), (B·A)ᵀ; an embedding's
    in skyrl, lora_A (vocab × rank) and lora_B (rank × hidden), A·B."""
    if set(factors) == {"lora_A", "lora_B"}:
        a, b = factors["lora_A"], factors["lora_B"]
        delta = a @ b if embedding and a.shape[1] == b.shape[0] else b @ a if a.shape[0] == b.shape[1] else None
    elif embedding and set(factors) == {"lora_embedding_A", "lora_embedding_B"}:
        a, b = factors["lora_embedding_A"], factors["lora_embedding_B"]
        delta = (b @ a).T if a.shape[0] == b.shape[1] else None
    else:
        raise PluginError(f"the service's LoRA adapter has {', '.join(sorted(factors))} of {module}, not a pair of LoRA factors")
    if delta is None or tuple(delta.shape) != shape:
        raise PluginError(
            f"the LoRA factors of {module} ({', '.join(str(tuple(f.shape)) for f in factors.values())}) do not fit its weight {shape}"
        )
    return delta


def _output(logprobs: list[torch.Tensor], metrics: dict[str, float], loss: torch.Tensor) -> tinker.ForwardBackwardOutput:
    return tinker.ForwardBackwardOutput(
        loss_fn_output_type="TorchLossReturn",
        loss_fn_outputs=[{"logprobs": _tensor_data(lp)} for lp in logprobs],
        metrics={**metrics, "loss": float(loss.detach())},
    )


@attrs.define(eq=False)
class TinkerReference:
    """The base model's logprobs from the service's sampling client (compute_logprobs)."""

    client: Any

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        futures = [
            self.client.compute_logprobs(tinker.ModelInput.from_ints(d.model_input.to_ints() + d.loss_fn_inputs["target_tokens"].data[-1:]))
            for d in datums
        ]
        # The first token has no logprob (a None, or left out: skyrl 0.3.0); the rest are the targets'.
        return [
            torch.tensor(
                [math.nan if x is None else x for x in sdk.resolved(f)[-len(d.loss_fn_inputs["target_tokens"].data) :]], dtype=torch.float32
            )
            for d, f in zip(datums, futures)
        ]
