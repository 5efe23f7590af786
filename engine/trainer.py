"""The in-process trainer (the Tinker training contract over a transformers model) and the
reference that only scores, with the folder a trainer's state is saved in.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import attrs
import tinker
import torch

from grpo_core.backend import CustomLossFn, NonFiniteWeights
from grpo_core.engine.compile import CompiledLayers, counting_compiles
from grpo_core.engine.forward import TRAINER_FORWARD, TransformersForward
from grpo_core.engine.host_memory import release_freed_memory
from grpo_core.engine.logprobs import DatumRouting, mean_entropy, on_host, target_logprobs, tokens_run, trained_entropy_sum
from grpo_core.engine.lora import (
    adapters_disabled,
    has_adapters,
    load_trained_state_dict,
    save_merged_model,
    trained_state_dict,
    write_peft_adapter,
)
from grpo_core.engine.models import SHARD_SIZE, shared_storage_aliases, train_mode
from grpo_core.engine.moe_routing import routing_problem, tapped
from grpo_core.engine.optim import (
    all_finite,
    clip_and_step,
    forward_backward_output,
    load_metrics,
    make_optimizer,
    nonfinite_step_message,
    routing_outputs,
    step_metrics,
)
from grpo_core.engine.perf import memory_line, peak_flops, peak_memory_gib
from grpo_core.engine.reference_offload import OffloadedWeights
from grpo_core.engine.vision import save_processor
from grpo_core.hookspecs import declared
from grpo_core.metrics import record

TRAINER_FILE = "trainer.json"
OPTIMIZER_INFO = "optimizer.json"
"""The optimizer state's non-tensor part (param_groups, steps); its tensors are sharded
safetensors ``optimizer*.safetensors`` beside it, in the dtype the optimizer keeps them in."""
LEGACY_OPTIMIZER_FILE = "optimizer.pt"
"""The one pickle earlier checkpoints held the optimizer state in: still read."""


def save_optimizer_state(state_dict: dict[str, Any], folder: Path) -> None:
    """``state_dict`` (an optimizer's) as sharded safetensors and ``OPTIMIZER_INFO``: a large
    model's moments are many files of at most SHARD_SIZE, not one pickle of tens of GB."""
    from huggingface_hub import save_torch_state_dict

    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for param_id, entries in state_dict["state"].items():
        state[str(param_id)] = {"values": {}, "tensors": []}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{param_id}.{key}"] = value
                state[str(param_id)]["tensors"].append(key)
            else:
                state[str(param_id)]["values"][key] = value
    if tensors:
        save_torch_state_dict(tensors, folder, filename_pattern="optimizer{suffix}.safetensors", max_shard_size=SHARD_SIZE)
    info = {"param_groups": state_dict["param_groups"], "state": state}
    (folder / OPTIMIZER_INFO).write_text(json.dumps(info, indent=1) + "\n")


def load_optimizer_state(folder: Path, device: torch.device | str) -> dict[str, Any] | None:
    """What :func:`save_optimizer_state` wrote (or an earlier checkpoint's ``optimizer.pt``);
    None when the folder holds no optimizer state."""
    from safetensors.torch import load_file

    if (folder / LEGACY_OPTIMIZER_FILE).is_file():
        return torch.load(folder / LEGACY_OPTIMIZER_FILE, map_location=device, weights_only=True)
    if not (folder / OPTIMIZER_INFO).is_file():
        return None
    info = json.loads((folder / OPTIMIZER_INFO).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("optimizer*.safetensors")):
        tensors.update(load_file(shard, device=str(device)))
    state = {
        int(param_id): {**entries["values"], **{key: tensors[f"state.{param_id}.{key}"] for key in entries["tensors"]}}
        for param_id, entries in info["state"].items()
    }
    return {"state": state, "param_groups": info["param_groups"]}


OFFLOADED_AS = {"offload": ("fp32",)}
"""Saved moments an ``offload`` trainer keeps as they are (float32: offloading is where they wait, not their bytes)."""


def saved_moments(optimizer_state: dict[str, Any]) -> str | None:
    """The ``--optimizer-state`` form of a saved optimizer state, by its first moment's dtype
    (None: nothing saved yet)."""
    first = next((entries["exp_avg"] for entries in optimizer_state["state"].values() if "exp_avg" in entries), None)
    if first is None:
        return None
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "8bit"}[first.dtype]


def read_trainer_state(path: str | Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """What :meth:`LocalTrainer.save_state` wrote: ``{"model" or "adapter": tensors by name,
    "optimizer": state dict or None, "version": int}``."""
    from safetensors.torch import load_file

    folder = Path(path)
    info = json.loads((folder / TRAINER_FILE).read_text())
    kind = info["weights"]
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob(f"{kind}*.safetensors")):
        weights.update(load_file(shard, device=str(device)))
    weights.update({name: weights[kept] for name, kept in info["aliases"].items()})
    return {kind: weights, "optimizer": load_optimizer_state(folder, device), "version": info["version"]}


@attrs.frozen
class SavedState:
    """What :meth:`LocalTrainer.save_state` writes: the trained weights (``kind``: a LoRA run's
    adapters or the whole model) with the names that share another's storage, the optimizer's
    state dict, the version. The trainer's live tensors, or their copies in host memory."""

    kind: str
    weights: dict[str, torch.Tensor]
    aliases: dict[str, str]
    """{name: the name whose storage it shares}: stored once (:func:`shared_storage_aliases`)."""
    optimizer: dict[str, Any] | None
    version: int

    def write(self, path: str) -> None:
        from huggingface_hub import save_torch_state_dict

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        save_torch_state_dict(
            dict(self.weights),  # it deletes the aliases from the dict it is given
            folder,
            filename_pattern=self.kind + "{suffix}.safetensors",
            max_shard_size=SHARD_SIZE,
            shared_tensors_to_discard=list(self.aliases),
        )
        if self.optimizer is not None:
            save_optimizer_state(self.optimizer, folder)
        info = {"weights": self.kind, "version": self.version, "aliases": self.aliases}
        (folder / TRAINER_FILE).write_text(json.dumps(info, indent=1) + "\n")

    def on_host(self) -> SavedState:
        """The same state, every tensor copied to host memory (:func:`host_copies`): what a later
        step changes in place (weights, moments, a fused AdamW's step count) no longer changes it.
        An alias is the copy of the tensor it shares storage with: it is still stored once."""
        weights = {name: tensor for name, tensor in self.weights.items() if name not in self.aliases}
        optimizer = None
        if self.optimizer is not None:
            # Its per-parameter dicts are the optimizer's own (a step counts in them): copied too.
            state = {param_id: dict(entries) for param_id, entries in self.optimizer["state"].items()}
            optimizer = {"state": state, "param_groups": copy.deepcopy(self.optimizer["param_groups"])}
        entries_of = [weights, *(optimizer["state"].values() if optimizer is not None else ())]
        places = [(entries, key) for entries in entries_of for key, value in entries.items() if isinstance(value, torch.Tensor)]
        for (entries, key), copied in zip(places, host_copies([entries[key] for entries, key in places])):
            entries[key] = copied
        # In the live dict's order (the shards' layout follows it), aliases beside their storage's owner.
        weights = {name: weights[self.aliases.get(name, name)] for name in self.weights}
        return attrs.evolve(self, weights=weights, optimizer=optimizer)


def host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` copied to host memory: a clone of one there already; a GPU's copied without
    blocking into pinned memory (torch allocates it so and keeps it cached for the next copy),
    every copy complete on return (one synchronize per device, not one per tensor)."""
    copies = [t.to("cpu", non_blocking=True) if t.is_cuda else t.clone() for t in tensors]
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)
    return copies


@attrs.define(eq=False)
class LocalReference:
    """A policy that only scores tokens (the KL reference); the trainer is one that also learns."""

    model: Any
    device: torch.device
    adapters_off: bool = False
    """Score with the model's LoRA adapters disabled: the base model (a LoRA run's reference).
    Only the main thread runs the trainer's model, so switching them off for a call is safe."""
    padding_free: bool = False
    """Pack sequences that run whole where the model allows it (:meth:`TransformersForward._packing_problem`)."""
    offloaded: OffloadedWeights | None = None
    """Where the model's weights wait between forwards when they are offloaded (its parameters
    are empty then)."""
    return_freed_memory: bool = False
    """On a CPU, give the C heap's free pages back to the OS where a phase has just freed its
    memory (the local backend's ``return_freed_memory``): a lower peak where memory is tight, the
    next phase's page faults and the trim itself (~15 % of a small model's step) where it is not."""
    compile: bool = False
    """Run its forwards (and backwards) with each decoder layer compiled (:mod:`grpo_core.engine.compile`)."""
    forward_fn: TransformersForward = attrs.field(init=False)
    compiled_layers: CompiledLayers | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        # Measured: with gradients, and for scoring whole sequences, transformers' forward is the
        # faster one; the fused decoder wins in sampling only (docs/performance.md).
        with self._weights():
            self.forward_fn = TransformersForward(self.model, padding_free=self.padding_free)
        if self.compile:
            self.compiled_layers = CompiledLayers(self.model)

    def _release_freed_memory(self) -> None:
        if self.return_freed_memory:
            release_freed_memory(self.device)

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        # What sampling freed leaves the process before the weights are mapped in beside it.
        self._release_freed_memory()
        with torch.no_grad(), self._weights(), self._compiled(), adapters_disabled(self.model) if self.adapters_off else nullcontext():
            logprobs, _ = target_logprobs(self.forward_fn, datums, self.device, packed=self.forward_fn.packs)
            return on_host(logprobs)[0]

    def _compiled(self) -> AbstractContextManager[None]:
        return self.compiled_layers.active() if self.compiled_layers is not None else nullcontext()

    def _weights(self) -> AbstractContextManager[None]:
        return self.offloaded.loaded() if self.offloaded is not None else nullcontext()


@attrs.define(eq=False, kw_only=True)
class LocalTrainer(LocalReference):
    tokenizer: Any
    fast_forward: bool = True
    """Whether the local sampler uses the fused decoder (where it runs the model)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward (transformers' checkpointing; the forward
    then runs in one pass: a cached prefix would be dropped by the checkpointed layers)."""
    seed: int = 0
    """Seeds the stochastic rounding of bfloat16 weights (float32 ones are updated exactly)."""
    optimizer_state: str = "fp32"
    """How Adam's moments are kept (``--optimizer-state``: engine.optim.MOMENT_FORMATS)."""
    optimizer_state_chosen: bool = False
    """``optimizer_state`` is what ``--optimizer-state auto`` chose for this device: a checkpoint
    whose moments are kept otherwise resumes in its own form (its bytes are the run's state)."""
    optimizer_kernel: str = "eager"
    """The stochastic-rounding step's kernel: compiled or eager (engine.optim.resolve_optimizer_kernel)."""
    optimizer_line: str = "torch's fused AdamW (float32 weights and moments)"
    """Which optimizer step runs and why, in words (run_info)."""
    version: int = 0
    optimizer: torch.optim.Optimizer | None = None
    nonfinite_loss: bool = False
    """A non-finite loss since the last optimizer step: that step will be skipped."""
    tokens_trained_on: int = attrs.field(init=False, default=0)
    """Tokens its forward/backward calls ran since ``perf_counters`` last read them (a shared prompt once)."""
    routing_problem: str | None = attrs.field(init=False, default=None)
    """Why its forwards cannot record and force expert routing (None: a mixture-of-experts model
    it can; declared in hookspecs)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.routing_problem = routing_problem(self.model)

    @property
    def save_adapter_for_sampler(self) -> Callable[[str], None] | None:
        """Where its model trains LoRA adapters: the function that writes them alone as a PEFT
        adapter folder (declared in hookspecs)."""
        if not has_adapters(self.model):
            return None
        return lambda path: write_peft_adapter(self.model, Path(path))

    @property
    def run_info(self) -> dict[str, str]:
        """How it trains, for config.json (declared in hookspecs)."""
        info = {"forward": TRAINER_FORWARD, "padding": self.forward_fn.padding_line(), "optimizer": self.optimizer_line}
        if self.routing_problem is None:
            info["routing"] = "each token's experts recorded (forced where a datum carries them) in one forward: no shared prompt prefix"
        info["mfu_peak"] = peak_flops(self.device, self._weights_dtype)[1]
        info["peak_memory"] = memory_line(self.device)
        return info

    def perf_counters(self) -> dict[str, float]:
        """What perf/mfu and perf/peak_memory_gib are computed from (declared in hookspecs)."""
        tokens, self.tokens_trained_on = self.tokens_trained_on, 0
        return {
            "forward_tokens": float(tokens),
            "parameters": float(sum(p.numel() for p in self.model.parameters())),
            "peak_flops": peak_flops(self.device, self._weights_dtype)[0],
            "peak_memory_gib": peak_memory_gib(self.device),
        }

    @property
    def _weights_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @contextmanager
    def _routing(self, datums: Sequence[tinker.Datum]) -> Iterator[DatumRouting | None]:
        """The routing of a forward over ``datums`` (a mixture-of-experts model), None otherwise."""
        if self.routing_problem is not None:
            if any("routed_experts" in d.loss_fn_inputs for d in datums):
                raise ValueError(f"datums carry routed_experts to replay, but {self.routing_problem}")
            yield None
            return
        with tapped(self.model) as tap:
            yield DatumRouting.of(tap, datums)

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        """Target-token logprobs without gradient; datums that carry routed_experts are scored with those experts."""
        if any("routed_experts" in d.loss_fn_inputs for d in datums):
            return self.forward_routed(datums)[0]
        return super().forward(datums)

    def forward_routed(self, datums: Sequence[tinker.Datum]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward``, and the experts each datum's input tokens were routed to, ``[tokens, layers, top_k]``
        (those it carries, where it carries some): what --router-replay R2 records in pi_old's forward."""
        self._release_freed_memory()
        with torch.no_grad(), self._compiled(), self._routing(datums) as routing:
            if routing is None:
                raise ValueError(f"no routing to record: {self.routing_problem}")
            logprobs, _ = target_logprobs(self.forward_fn, datums, self.device, packed=self.forward_fn.packs, routing=routing)
            return on_host(logprobs)[0], routing.per_datum(routing.tap.take(), [d.model_input.length for d in datums])

    def forward_backward_custom(self, datums: Sequence[tinker.Datum], loss_fn: CustomLossFn) -> tinker.ForwardBackwardOutput:
        self._release_freed_memory()
        # 1: sequences that run whole are packed (not padded); the reason is in config.json's run_info.
        record("perf/padding_free", float(self.forward_fn.packs), "max")
        self.tokens_trained_on += tokens_run(datums, whole_rows=self.activation_checkpointing or self.routing_problem is None)
        routed: list[dict[str, torch.Tensor]] = [{} for _ in datums]
        # The backward inside the routing: checkpointed layers recompute with the same forced experts.
        with self._compiled(), self._routing(datums) as routing:
            with train_mode(self.model) if self.activation_checkpointing else nullcontext():
                logprobs, entropy_by_datum = target_logprobs(
                    self.forward_fn,
                    datums,
                    self.device,
                    one_pass=self.activation_checkpointing,
                    packed=self.forward_fn.packs,
                    routing=routing,
                    entropy=True,
                )
                logprobs, entropy_by_datum = on_host(logprobs, entropy_by_datum)
            entropy = mean_entropy(*trained_entropy_sum(datums, entropy_by_datum))
            if routing is not None:
                routed = routing_outputs(routing, datums)
            loss, metrics = loss_fn(datums, logprobs)
            metrics = {**metrics, "policy/entropy": entropy}
            if routing is not None:
                metrics.update(load_metrics(torch.cat([r["routed_experts"] for r in routed]), routing.tap.num_experts))
            if torch.isfinite(loss):
                loss.backward()
            else:
                # No backward: a NaN would spread into every gradient; optim_step skips the step.
                self.nonfinite_loss = True
        return forward_backward_output(logprobs, loss, metrics, routed)

    def optim_step(self, adam_params: tinker.AdamParams) -> dict[str, float]:
        if self.optimizer is None:
            self.optimizer = self._make_optimizer()
        with counting_compiles() if self.optimizer_kernel == "compiled" else nullcontext():
            grad_norm, skip = clip_and_step(self.optimizer, adam_params, self.nonfinite_loss)
        if not skip:
            self.version += 1
            if not self.weights_finite():
                raise NonFiniteWeights(nonfinite_step_message(grad_norm, adam_params))
        self._release_freed_memory()  # the gradients clip_and_step freed
        self.nonfinite_loss = False
        return step_metrics(grad_norm, adam_params, skip)

    def weights_finite(self) -> bool:
        # Frozen weights (a LoRA run's base model) were finite when loaded and never change.
        return all_finite([p.detach() for p in self.model.parameters() if p.requires_grad])

    def _refuse_nonfinite(self, what: str) -> None:
        if not self.weights_finite():
            raise NonFiniteWeights(f"the policy's weights hold NaN or inf: {what} not written")

    def _make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return make_optimizer(params, self.seed, self.device, self.optimizer_state, self.optimizer_kernel)

    def save_state(self, path: str) -> None:
        """A folder: the trained weights in their own dtype as sharded safetensors, then the
        optimizer state as sharded safetensors in the dtype it is kept in (``--optimizer-state``),
        the version in trainer.json (see :func:`read_trainer_state`)."""
        self._refuse_nonfinite(path)
        self._saved_state().write(path)

    def state_snapshot(self) -> Callable[[str], None]:
        """What ``save_state`` would write now, copied to host memory, and the function that writes
        it there later from another thread (declared in hookspecs): core's periodic checkpoints.
        The copy takes as much host memory as the checkpoint until it is written."""
        self._refuse_nonfinite("the checkpoint")
        return self._saved_state().on_host().write

    def _saved_state(self) -> SavedState:
        # A LoRA run saves its adapters only: the base model is the run's --model, loaded again.
        weights = trained_state_dict(self.model)
        return SavedState(
            kind="adapter" if has_adapters(self.model) else "model",
            weights=weights,
            aliases=shared_storage_aliases(weights),
            optimizer=self.optimizer.state_dict() if self.optimizer is not None else None,
            version=self.version,
        )

    def load_state(self, path: str) -> None:
        state = read_trainer_state(path, self.device)
        if has_adapters(self.model) != ("adapter" in state):
            saved, here = ("LoRA adapters", "the whole model") if "adapter" in state else ("the whole model", "LoRA adapters")
            raise ValueError(f"{path} holds {saved}, but this trainer trains {here}")
        weights = state["adapter" if "adapter" in state else "model"]
        load_trained_state_dict(self.model, weights)
        if state["optimizer"] is not None:
            saved = saved_moments(state["optimizer"])
            if self.optimizer_state_chosen and saved not in (None, self.optimizer_state, *OFFLOADED_AS.get(self.optimizer_state, ())):
                print(
                    f"optimizer state: {saved} moments, as the checkpoint keeps them (auto chose {self.optimizer_state} for "
                    "this device; a resumed run continues in its checkpoint's form)",
                    file=sys.stderr,
                )
                self.optimizer_state, self.optimizer = saved, None
                if self.optimizer_kernel == "compiled" and saved != "fp32":
                    self.optimizer_kernel = "eager"
            if self.optimizer is None:
                self.optimizer = self._make_optimizer()
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]

    def save_weights_for_sampler(self, path: str) -> str:
        """A plain transformers folder (LoRA adapters merged in) that any engine loads."""
        self._refuse_nonfinite(path)
        if has_adapters(self.model):
            save_merged_model(self.model, path)
        else:
            self.model.save_pretrained(path, max_shard_size=SHARD_SIZE)
        self.tokenizer.save_pretrained(path)
        save_processor(self.model, self.tokenizer, path)
        return path


def local_policy(trainer: Any) -> Any:
    """The local trainer whose model the sampler generates with: the trainer itself, or the whole
    copy a trainer that is not local keeps in this process for sampling (``local_policy()``: the
    fsdp trainer's, on rank 0)."""
    policy = declared(trainer, "trainer object", "local_policy")
    return policy() if policy is not None else trainer
