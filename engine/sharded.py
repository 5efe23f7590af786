"""The sharded model of the fsdp backend: FSDP2 wrapping, the commands every rank runs on its
shards, and their state dicts and DCP checkpoints.

Each rank holds its shards of the policy (float32, computing in the run's dtype) and of the frozen
reference. Rank 0 gathers the logprobs of every rank's sequences, runs the loss on leaf copies of
them and scatters the gradient of each rank's share back (``ShardedRank.forward_backward``): any
loss plugin runs unchanged. The group the commands travel in is ``engine/rank_group.py``'s.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import tinker
import torch
import torch.distributed as dist

from grpo_core.backend import CustomLossFn
from grpo_core.engine.forward import TransformersForward
from grpo_core.engine.logprobs import DatumRouting, mean_entropy, target_logprobs, trained_entropy_sum
from grpo_core.engine.models import enable_activation_checkpointing, load_model, train_mode
from grpo_core.engine.moe_routing import routing_problem, tapped
from grpo_core.engine.optim import all_finite, clip_and_step, make_optimizer, routing_outputs
from grpo_core.engine.perf import peak_memory_gib
from grpo_core.engine.rank_group import RankWorker
from grpo_core.errors import PluginError

STATE_FORMAT = "grpo-core-fsdp-1"
STATE_INFO = "fsdp.json"
"""Beside the DCP files of a checkpoint: its format, the policy's version and the world size."""


@attrs.frozen
class ModelSpec:
    """What every rank needs to load its part of the model (sent to the ranks with the command)."""

    model: str
    attn_implementation: str
    dtype: str
    threads: int
    gradient_checkpointing: bool
    seed: int
    cpu_offload: bool = False


class LogprobsRoot(torch.nn.Module):
    """The root of a sharded model: FSDP gathers the weights outside the decoder layers (embedding,
    final norm, output layer) around a call of the root, so whatever reads them runs inside one:
    ``root(fn, *args)`` is ``fn(*args)`` with those weights gathered."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


@attrs.define(eq=False)
class Sharded:
    """One model as a rank holds it: its shards, the root to call it through, its forward."""

    lm: Any
    root: LogprobsRoot
    forward_fn: TransformersForward
    dtype: torch.dtype
    """The model's own dtype: what the policy for a sampler is written in."""


UNPACKED = "the fsdp backend runs each rank's sequences whole, right-padded in one forward; it does not pack them"
"""Why its rows are padded (``ShardedRank.logprobs``): ``perf/padding_free`` is 0 and config.json says so."""

PLACEHOLDER = tinker.Datum(model_input=tinker.ModelInput.from_ints([0]), loss_fn_inputs={"target_tokens": [0], "weights": [0.0]})
"""A rank with no sequence of a call still runs the model (its layers' collectives need it) on this."""


def shares(items: Sequence[Any], world: int) -> list[list[Any]]:
    """``items`` split in ``world`` consecutive shares, their sizes differing by at most one."""
    n = len(items)
    return [list(items[r * n // world : (r + 1) * n // world]) for r in range(world)]


@attrs.define(eq=False)
class ShardedRank(RankWorker):
    """One process's shards of the policy (and the reference), and the commands rank 0 gives them:
    load, forward, forward and backward, optimizer step, checkpoints, the whole state dict."""

    models: dict[str, Sharded] = attrs.field(factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    spec: ModelSpec | None = None

    def load(self, which: str, spec: ModelSpec) -> Any:
        """Load ``which`` ("policy" or "reference"), shard it; the policy gets its optimizer.
        Returns the tokenizer (rank 0)."""
        torch.set_num_threads(spec.threads)
        self.spec = spec
        policy = which == "policy"
        compute = getattr(torch, spec.dtype)
        # A trained policy keeps float32 weights under bf16 compute (FSDP casts each layer's
        # gathered weights); the frozen reference is held in the compute dtype itself.
        held = torch.float32 if policy else compute
        error, model, tokenizer = None, None, None
        try:
            model, tokenizer = load_model(spec.model, torch.device("cpu"), spec.attn_implementation, dtype=held)
            if policy and spec.gradient_checkpointing:
                enable_activation_checkpointing(model)
            if not layer_classes(model):
                raise PluginError(f"--backend fsdp: model type '{model.config.model_type}' names no decoder layer to shard")
        except PluginError as exc:
            error = str(exc)
        self.agree(error)
        if not policy:
            model.requires_grad_(False)
        offload = policy and spec.cpu_offload
        root = shard(model, self.device, mixed=policy and compute != torch.float32, compute=compute, offload=offload)
        with torch.no_grad():
            forward_fn = root(TransformersForward, model)
        self.models[which] = Sharded(model, root, forward_fn, compute)
        if policy:
            self.optimizer = make_optimizer([p for p in root.parameters() if p.requires_grad], spec.seed, self.optimizer_device)
        return tokenizer if self.rank == 0 else None

    @property
    def optimizer_device(self) -> torch.device:
        """Where the policy's shards are stepped: the host with cpu_offload (FSDP2 keeps them there)."""
        return torch.device("cpu") if self.spec.cpu_offload else self.device

    def logprobs(
        self, which: str, datums: Sequence[tinker.Datum], routing: DatumRouting | None = None, entropy: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The datums' target logprobs, and with ``entropy`` their entropies (see ``target_logprobs``)."""
        model = self.models[which]
        # One pass, never the shared-prefix path: FSDP frees a layer's gathered weights after each
        # call, and a gradient through a cached prefix reaches them without passing the layer's output.
        with warnings.catch_warnings():
            # The logprobs are views of one tensor, never changed in place (which would skip FSDP's hook).
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            return model.root(target_logprobs, model.forward_fn, datums, self.device, True, False, routing, entropy)

    @contextlib.contextmanager
    def routing(self, which: str, datums: Sequence[tinker.Datum]) -> Any:
        """The routing of the policy's forward over this rank's ``datums`` (a mixture-of-experts
        model; None otherwise, and for the reference, which routes on its own as the local one)."""
        lm = self.models[which].lm
        if which != "policy" or routing_problem(lm) is not None:
            yield None
            return
        with tapped(lm) as tap:
            yield DatumRouting.of(tap, datums)

    def forward(
        self, which: str, datums_by_rank: list[list[tinker.Datum]], with_routes: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]] | None:
        """Each rank's share scored without gradient, gathered on rank 0 (``with_routes``: and the
        experts each datum's tokens were routed to)."""
        mine = datums_by_rank[self.rank]
        batch = mine or [PLACEHOLDER]
        with torch.no_grad(), self.routing(which, batch) as routing:
            logprobs, _ = self.logprobs(which, batch, routing)
            routed = routing_outputs(routing, batch) if routing is not None and mine else []
        gathered = self.gather(([lp.cpu() for lp in logprobs], routed) if mine else ([], []))
        if gathered is None:
            return None
        flat = [lp for part, _ in gathered for lp in part]
        return (flat, [r for _, part in gathered for r in part]) if with_routes else flat

    def forward_backward(
        self, datums_by_rank: list[list[tinker.Datum]], loss_fn: CustomLossFn | None = None, datums: Sequence[tinker.Datum] = ()
    ) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, float], BaseException | None, list[dict[str, torch.Tensor]]] | None:
        """Each rank's forward with its graph kept; rank 0 runs ``loss_fn`` on the gathered
        logprobs and scatters their gradients, scaled by the world size (FSDP averages the ranks'
        gradients; the loss already covers every sequence); each rank's backward. A mixture-of-experts
        policy forces the routes its datums carry and rank 0 also returns each datum's routing.
        ``policy/entropy`` is each rank's entropy sum over its trained tokens, added up on rank 0: the
        mean over all of them, as the local trainer's."""
        policy = self.models["policy"]
        mine = datums_by_rank[self.rank]
        batch = mine or [PLACEHOLDER]
        # The backward inside the routing: checkpointed layers recompute with the same forced experts.
        with (
            train_mode(policy.lm) if self.spec.gradient_checkpointing else contextlib.nullcontext(),
            self.routing("policy", batch) as routing,
        ):
            logprobs, entropy_by_datum = self.logprobs("policy", batch, routing, entropy=True)
            routed = routing_outputs(routing, batch) if routing is not None and mine else []
            entropy_sum = trained_entropy_sum(mine, entropy_by_datum)  # (0, 0) for a placeholder
            gathered = self.gather(([lp.detach().cpu() for lp in logprobs] if mine else [], routed, entropy_sum))
            result = None
            grads_by_rank: list[Any] | None = None
            if gathered is not None:
                result, grads_by_rank = self._loss_on_rank0([part for part, _, _ in gathered], datums_by_rank, loss_fn, datums)
                leaves, loss, metrics, error = result
                totals, weights = zip(*(entropy_sum for _, _, entropy_sum in gathered))
                entropy = mean_entropy(sum(totals), sum(weights))
                result = (leaves, loss, {**metrics, "policy/entropy": entropy}, error, [r for _, part, _ in gathered for r in part])
            received: list[Any] = [None]
            dist.scatter_object_list(received, grads_by_rank, src=0, group=self.control)
            grads = received[0]
            if not mine or grads is None:  # a placeholder, a non-finite loss, a failed loss: no gradient
                grads = [torch.zeros_like(lp) for lp in logprobs]
            torch.autograd.backward(logprobs, [g.to(lp.device) for g, lp in zip(grads, logprobs)])
        return result

    def _loss_on_rank0(
        self, gathered: list[list[torch.Tensor]], datums_by_rank: list[list[tinker.Datum]], loss_fn: Any, datums: Sequence[tinker.Datum]
    ) -> tuple[Any, list[Any]]:
        leaves = [lp.clone().requires_grad_(True) for part in gathered for lp in part]
        try:
            loss, metrics = loss_fn(datums, leaves)
            finite = bool(torch.isfinite(loss))
            if finite:
                loss.backward()
        except Exception as exc:  # every rank still finishes this command; the trainer raises it
            return (leaves, torch.tensor(float("nan")), {}, exc), [None] * self.world
        if not finite:
            return (leaves, loss, metrics, None), [None] * self.world
        grads = [(lp.grad if lp.grad is not None else torch.zeros_like(lp)) * self.world for lp in leaves]
        bounds = [0]
        for part in datums_by_rank:
            bounds.append(bounds[-1] + len(part))
        return (leaves, loss, metrics, None), [grads[bounds[r] : bounds[r + 1]] for r in range(self.world)]

    def optim_step(self, adam_params: tinker.AdamParams, skip: bool) -> tuple[float, bool, bool]:
        """Clip and step (as the local trainer); returns the gradient norm, whether the step was
        skipped, and whether the weights are finite after it."""
        grad_norm, skipped = clip_and_step(self.optimizer, adam_params, skip)
        return grad_norm, skipped, skipped or self.weights_finite()

    def weights_finite(self) -> bool:
        params = [p.detach() for p in self.models["policy"].root.parameters() if p.requires_grad]
        shards = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        finite = torch.tensor([float(all_finite(shards))], device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def save_state(self, path: str, version: int) -> bool:
        """Write the checkpoint; False (nothing written) when the weights are not finite."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if not self.weights_finite():
            return False
        root = self.models["policy"].root
        state = {"model": get_model_state_dict(root)}
        if self.optimizer.state:  # no step taken yet: nothing to save (as the local trainer)
            state["optimizer"] = get_optimizer_state_dict(root, self.optimizer)
        dcp.save(state, checkpoint_id=path)
        if self.rank == 0:
            info = {"format": STATE_FORMAT, "version": version, "world_size": self.world, "optimizer": "optimizer" in state}
            (Path(path) / STATE_INFO).write_text(json.dumps(info, indent=1) + "\n")
        dist.barrier(group=self.control)
        return True

    def load_state(self, path: str, info: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self.agree(None if Path(path, STATE_INFO).is_file() else f"{path} cannot be read here (on several machines it must be shared)")
        root = self.models["policy"].root
        state = {"model": get_model_state_dict(root)}
        if info["optimizer"]:
            state["optimizer"] = get_optimizer_state_dict(root, self.optimizer)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(root, state["model"])
        if info["optimizer"]:
            set_optimizer_state_dict(root, self.optimizer, state["optimizer"])
        else:
            self.optimizer = make_optimizer([p for p in root.parameters() if p.requires_grad], self.spec.seed, self.optimizer_device)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy's whole state dict in its own dtype, gathered to rank 0's CPU one tensor at a time."""
        policy = self.models["policy"]
        full: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}
        for name, tensor in policy.lm.state_dict().items():
            # A tied weight is one parameter under two names (the state dict gives two views of it):
            # gathered once, one tensor under both names.
            parameter = _parameter(policy.lm, name)
            owner = id(tensor if parameter is None else parameter)
            if owner in first:
                full[name] = full[first[owner]]
                continue
            first[owner] = name
            whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            full[name] = whole.to("cpu", policy.dtype) if self.rank == 0 else whole
        return full if self.rank == 0 else None

    def largest_peak_memory_gib(self) -> float | None:
        """The largest rank's memory peak since the last call (``engine.perf.peak_memory_gib``), on rank 0."""
        peaks = self.gather(peak_memory_gib(self.device))
        return None if peaks is None else max(peaks)

    COMMANDS: ClassVar[tuple[Any, ...]] = (
        load,
        forward,
        forward_backward,
        optim_step,
        weights_finite,
        save_state,
        load_state,
        full_state_dict,
        largest_peak_memory_gib,
    )


def read_state_info(path: str) -> dict[str, Any]:
    """The fsdp.json of a checkpoint folder, checked to be the fsdp trainer's."""
    info_file = Path(path) / STATE_INFO
    if not info_file.is_file():
        raise PluginError(f"{path} is not a checkpoint of the fsdp trainer (no {STATE_INFO})")
    info = json.loads(info_file.read_text())
    if info.get("format") != STATE_FORMAT:
        raise PluginError(f"{path} is not a checkpoint of the fsdp trainer (format {info.get('format')!r})")
    return info


def _parameter(model: Any, name: str) -> torch.nn.Parameter | None:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None  # a buffer


def layer_classes(model: Any) -> set[str]:
    """The decoder layers' class names (what transformers never splits across devices)."""
    return set(getattr(model, "_no_split_modules", None) or ())


def shard(model: Any, device: torch.device, mixed: bool, compute: torch.dtype, offload: bool = False) -> LogprobsRoot:
    """``fully_shard`` on each decoder layer, then on a root around the model (the rest);
    ``offload``: the shards wait in pinned host memory (FSDP2's CPUOffloadPolicy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    def policy(cast_forward_inputs: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"mesh": mesh}
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        if mixed:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=cast_forward_inputs
            )
        return kwargs

    names = layer_classes(model)
    for module in model.modules():
        if type(module).__name__ in names:
            fully_shard(module, **policy(cast_forward_inputs=True))
    root = LogprobsRoot(model)
    # Resharded after each call like the layers (FSDP keeps a root gathered by default): the
    # embedding and the output layer are whole only within a command, and the optimizer steps
    # the sharded parameters. Its inputs are left alone: they are a function and tinker.Datum
    # objects, which FSDP's input cast would rebuild field by field (and fail on); the tensors
    # the model computes from them are in the compute dtype already (the embedding's weight is).
    fully_shard(root, reshard_after_forward=True, **policy(cast_forward_inputs=False))
    return root
