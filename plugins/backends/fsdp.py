"""The ``fsdp`` backend: one policy sharded over several processes with torch.distributed FSDP2.

One controller. Rank 0 is the process that runs the loop; the other ranks serve it. Each trainer
call is a command of ``engine/rank_group.py``'s group that every rank carries out the same way
(one ``ShardedRank`` method of ``engine/sharded.py``), so their collectives meet: every rank scores
its share of the sequences and keeps its graph, the detached logprobs are gathered on rank 0,
which runs the loss on leaf copies of them (any loss plugin, unchanged) and scatters
∂loss/∂logprobs back for each rank's backward. This is the Tinker backend's custom-loss path, in
process. This file holds the options, the hooks and the trainer protocol over the group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import tinker
import torch

from grpo_core import hookimpl, option
from grpo_core.backend import CustomLossFn, NonFiniteWeights
from grpo_core.config import RunConfig, default_threads
from grpo_core.engine.architectures import AUTO
from grpo_core.engine.forward import TRAINER_FORWARD
from grpo_core.engine.logprobs import tokens_run
from grpo_core.engine.memory_plan import ASSUMED_PROMPT_TOKENS, check_sharded_fits
from grpo_core.engine.models import (
    load_model,
    model_path,
    resolve_checkpointing,
    resolve_precision,
    save_state_as_model,
    shared_storage_aliases,
)
from grpo_core.engine.moe_routing import num_experts, routing_problem
from grpo_core.engine.optim import forward_backward_output, load_metrics, nonfinite_step_message, step_metrics
from grpo_core.engine.perf import memory_line, peak_flops
from grpo_core.engine.rank_group import Group, join_group, serve, start_group, torchrun_world
from grpo_core.engine.sharded import UNPACKED, ModelSpec, ShardedRank, read_state_info, shares
from grpo_core.engine.trainer import LocalTrainer
from grpo_core.engine.vision import image_text_config
from grpo_core.errors import PluginError
from grpo_core.metrics import record
from grpo_core.plugins.backends.local import LocalBackend


def _validate_nproc(instance: Any, attribute: Any, value: int) -> None:
    if value < 0:
        raise ValueError(f"nproc must be >= 2 (0: the ranks torchrun started), got {value}")


@attrs.define
class FSDPBackend:
    """Train one policy sharded over several processes (torch.distributed FSDP2, one GPU each on
    CUDA, gloo on a CPU): for a model whose weights, gradients and AdamW state do not fit one device.

    Rank 0 runs the loop unchanged; the other ranks serve its trainer calls (forward, the loss's
    backward, the optimizer step, checkpoints). Every loss plugin works unchanged: the logprobs of
    all ranks are gathered on rank 0, which runs the loss and sends each rank the gradient of its
    sequences. One machine: --backend-opt nproc=N starts the N ranks. Several machines: torchrun
    starts them (docs/scaling-out.md), with the same flags and no nproc. Precision: float32 on a
    CPU (exact, like the local backend); with --dtype bfloat16 (auto on CUDA) the sharded weights,
    gradients and AdamW state stay float32 and each layer computes in bfloat16 (FSDP's
    MixedPrecisionPolicy, gradients reduced in float32); the KL reference is a second sharded
    model, bfloat16 there. Checkpoints are torch.distributed.checkpoint folders (each rank writes
    its shards: on several machines the run directory must be shared); the policy for a sampler
    and final/ are a transformers folder in the model's dtype, gathered on rank 0. --sampler
    local keeps a full copy of the policy on rank 0 (for small models and tests); real sizes
    sample from a server (--sampler openai --weight-sync vllm). LoRA is not supported here.
    Before any rank starts, a memory plan per rank (docs/scaling-out.md, Memory per rank) refuses
    a run that cannot fit (--no-memory-check runs it anyway); perf/mfu is over the N ranks' peak,
    perf/peak_memory_gib the largest rank's.
    """

    nproc: int = option(
        0,
        help="ranks to start on this machine, at least 2 (one GPU each on CUDA); 0 = torchrun started them; --resume may change it",
        validator=_validate_nproc,
        resumable=True,
    )
    attn_implementation: str = option(AUTO, help="transformers attention implementation (as --backend local's)")
    cpu_offload: bool = option(
        False,
        help=(
            "CUDA only: keep each rank's shards of the weights, gradients and AdamW moments in pinned host memory "
            "(FSDP2's CPUOffloadPolicy); a layer's weights come to the GPU for its forward and backward and the "
            "optimizer steps on the CPU: a GPU then holds activations and one layer's gathered weights (docs/scaling-out.md)"
        ),
    )
    compile: bool | Literal["auto"] = option(
        "auto",
        help="as --backend local's, but the fsdp backend's layers run eagerly: true is refused here; auto = off",
    )

    default_sampler = "local"
    default_weight_sync = "in_process"
    checkpoint_weights = "float32"  # the sharded master weights; a layer computes in --dtype

    @hookimpl
    def check_config(self, config: RunConfig) -> None:
        self.world_size(config)
        if config.train_vision or image_text_config(model_path(config.model)) is not None:
            raise PluginError(
                "--backend fsdp does not train vision-language models (their vision parts are not sharded): use --backend local"
            )

    def world_size(self, config: RunConfig) -> int:
        """The world size, after refusing what this backend cannot do."""
        launched = torchrun_world()
        if launched is not None and self.nproc:
            raise PluginError(f"--backend-opt nproc={self.nproc}: torchrun started the ranks (WORLD_SIZE={launched}); leave nproc out")
        world = launched if launched is not None else self.nproc
        if world == 0:
            raise PluginError("--backend fsdp: give the number of ranks, --backend-opt nproc=N (N >= 2), or start the run with torchrun")
        if world == 1:
            raise PluginError("--backend fsdp with one rank shards nothing: use --backend local")
        if self.compile is True:
            raise PluginError(
                "--backend-opt compile=true: the fsdp backend runs its layers eagerly (compiling them before fully_shard "
                "is not implemented); compiled layers run on --backend local, or leave compile out"
            )
        if config.lora_rank:
            raise PluginError("--lora-rank: the fsdp backend trains every weight; LoRA runs on --backend local")
        if config.optimizer_state not in ("auto", "fp32"):
            raise PluginError(
                f"--optimizer-state {config.optimizer_state}: the fsdp backend keeps float32 AdamW moments, sharded over its "
                "ranks (8/N bytes per parameter on each); reduced or streamed moments are not implemented for its sharded "
                "parameters: use --backend local for them, or --backend-opt cpu_offload=true to hold the shards in host memory"
            )
        cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        if self.cpu_offload and not cuda:
            raise PluginError(
                "--backend-opt cpu_offload=true moves the shards from the GPU to host memory; on a CPU run they are in host memory already"
            )
        if cuda:
            here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if torch.cuda.device_count() < here:
                raise PluginError(f"--backend fsdp puts one rank on each GPU: {here} ranks here, {torch.cuda.device_count()} GPUs")
        return world

    @hookimpl
    def load_tokenizer(self, config: RunConfig) -> tuple[Any, int | None]:
        return LocalBackend(attn_implementation=self.attn_implementation).load_tokenizer(config=config)

    @hookimpl
    def make_trainer(self, config: RunConfig, needs_reference: bool = True) -> FSDPTrainer:
        world = self.world_size(config)
        device, dtype, _ = resolve_precision(config.device, config.dtype)
        checkpointing, why = resolve_checkpointing(config.gradient_checkpointing, device.type)
        spec = ModelSpec(
            model=config.model,
            attn_implementation=self.attn_implementation,
            dtype=str(dtype).removeprefix("torch."),
            threads=config.threads or default_threads(),
            gradient_checkpointing=checkpointing,
            seed=config.seed,
            cpu_offload=self.cpu_offload,
        )
        print(f"precision: {PRECISION_NOTES[spec.dtype]}", file=sys.stderr)
        print(f"gradient checkpointing: {why}", file=sys.stderr)
        print("compile: off (the fsdp backend runs its layers eagerly; --backend local compiles them)", file=sys.stderr)
        where = "pinned host memory (cpu_offload)" if self.cpu_offload else f"each {device.type} rank"
        print(
            f"optimizer state: fp32 moments, sharded: 16/{world} = {16 / world:.3g} B per parameter on {where} "
            "(float32 weights 4 + gradients 4 + moments 8)",
            file=sys.stderr,
        )
        # Planned before any rank starts: a run that cannot fit loads nothing.
        fit = check_sharded_fits(
            config,
            model_path(config.model),
            world,
            int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            dtype,
            device,
            checkpointing,
            sampler_copy="sampler" in config.kinds and config.sampler in (None, "local"),  # sft samples nothing
            offload=self.cpu_offload,
            reference=needs_reference,
        )
        counted = "the KL reference counted" if needs_reference else "no KL reference counted (the loss uses none)"
        print(f"{fit.line()}; {counted}; activations assume prompts of {ASSUMED_PROMPT_TOKENS} tokens", file=sys.stderr)
        group = start_group(world, device.type, spawn=torchrun_world() is None, worker=ShardedRank)
        pids = ", ".join(str(w.pid) for w in group.workers)
        started = f"; ranks 1-{world - 1} are pids {pids}" if pids else ""
        print(f"trainer: fsdp, {world} ranks ({'nccl' if device.type == 'cuda' else 'gloo'}{started})", file=sys.stderr)
        tokenizer = group.run(ShardedRank.load, "policy", spec)
        return FSDPTrainer(group=group, tokenizer=tokenizer, spec=spec)

    @hookimpl
    def make_reference(self, config: RunConfig, trainer: FSDPTrainer) -> FSDPReference:
        trainer.group.run(ShardedRank.load, "reference", trainer.spec)
        return FSDPReference(trainer.group)

    def serve_rank(self, config: RunConfig) -> int:
        """What a rank other than 0 that torchrun started runs instead of the loop: it serves rank
        0's trainer; returns the exit code."""
        self.world_size(config)
        device, _, _ = resolve_precision(config.device, config.dtype)
        rank = int(os.environ["RANK"])
        return serve(join_group(rank, int(os.environ["WORLD_SIZE"]), device.type, None, ShardedRank))


PRECISION_NOTES = {
    "float32": "float32 (exact: a resumed run repeats the uninterrupted one bit for bit)",
    "bfloat16": "float32 sharded weights, gradients and AdamW state; layers compute in bfloat16, gradients reduced in float32",
}


@attrs.define(eq=False)
class FSDPReference:
    """The frozen reference: a second sharded model, forward only."""

    group: Group

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        return self.group.run(ShardedRank.forward, "reference", shares(datums, self.group.world))


@attrs.define(eq=False)
class FSDPTrainer:
    """The :class:`grpo_core.backend.Trainer` of the sharded policy, called on rank 0."""

    group: Group
    tokenizer: Any
    spec: ModelSpec
    version: int = 0
    nonfinite_loss: bool = False
    """A non-finite loss since the last optimizer step: that step will be skipped."""
    sampling_copy: LocalTrainer | None = None
    """A whole copy of the policy on rank 0 for ``--sampler local``, made when it first asks."""
    tokens_trained_on: int = 0
    """Tokens its forward_backward calls ran over all ranks since ``perf_counters`` last read them."""

    @property
    def routing_problem(self) -> str | None:
        """Why its forwards cannot record and force expert routing (declared in hookspecs)."""
        return routing_problem(self.group.local.models["policy"].lm)

    @property
    def run_info(self) -> dict[str, str]:
        """How it trains, for config.json (declared in hookspecs)."""
        device, dtype = self.group.local.device, getattr(torch, self.spec.dtype)
        return {
            "forward": TRAINER_FORWARD,
            "padding": f"sequences are padded ({UNPACKED})",
            "mfu_peak": f"{self.group.world} ranks x {peak_flops(device, dtype)[1]}",
            "peak_memory": f"the largest over the ranks of {memory_line(device)}",
        }

    def perf_counters(self) -> dict[str, float]:
        """What perf/mfu and perf/peak_memory_gib are computed from (declared in hookspecs): the
        world's peak is the ranks' (rank 0's rate N times: each rank runs a share of the rows; on one
        CPU ranks that share its cores make it an upper bound, so mfu errs low), the memory peak the
        largest rank's."""
        tokens, self.tokens_trained_on = self.tokens_trained_on, 0
        device, dtype = self.group.local.device, getattr(torch, self.spec.dtype)
        return {
            "forward_tokens": float(tokens),
            "parameters": float(sum(p.numel() for p in self.group.local.models["policy"].lm.parameters())),
            "peak_flops": self.group.world * peak_flops(device, dtype)[0],
            "peak_memory_gib": self.group.run(ShardedRank.largest_peak_memory_gib),
        }

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        return self.group.run(ShardedRank.forward, "policy", shares(datums, self.group.world))

    def forward_routed(self, datums: Sequence[tinker.Datum]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward``, and the experts each datum's input tokens were routed to (see LocalTrainer.forward_routed)."""
        if self.routing_problem is not None:
            raise ValueError(f"no routing to record: {self.routing_problem}")
        logprobs, routed = self.group.run(ShardedRank.forward, "policy", shares(datums, self.group.world), True)
        return logprobs, [r["routed_experts"] for r in routed]

    def forward_backward_custom(self, datums: Sequence[tinker.Datum], loss_fn: CustomLossFn) -> tinker.ForwardBackwardOutput:
        record("perf/padding_free", 0.0, "max")  # 0: padded (UNPACKED), as the local trainer records it
        self.tokens_trained_on += tokens_run(datums, whole_rows=True)  # one pass: every sequence whole, padding aside
        logprobs, loss, metrics, error, routed = self.group.run(
            ShardedRank.forward_backward, shares(datums, self.group.world), loss_fn=loss_fn, datums=list(datums)
        )
        if error is not None:
            raise error
        if not torch.isfinite(loss):
            self.nonfinite_loss = True
        if routed:
            experts = num_experts(self.group.local.models["policy"].lm)
            metrics = {**metrics, **load_metrics(torch.cat([r["routed_experts"] for r in routed]), experts)}
        return forward_backward_output(logprobs, loss, metrics, routed or None)

    def optim_step(self, adam_params: tinker.AdamParams) -> dict[str, float]:
        grad_norm, skipped, finite = self.group.run(ShardedRank.optim_step, adam_params, self.nonfinite_loss)
        self.nonfinite_loss = False
        if not skipped:
            self.version += 1
            if not finite:
                raise NonFiniteWeights(nonfinite_step_message(grad_norm, adam_params))
            self._refresh_sampling_copy()
        return step_metrics(grad_norm, adam_params, skipped)

    def weights_finite(self) -> bool:
        return self.group.run(ShardedRank.weights_finite)

    def save_state(self, path: str) -> None:
        """A torch.distributed.checkpoint folder (every rank writes its shards of the weights and
        of the AdamW state) and fsdp.json."""
        if not self.group.run(ShardedRank.save_state, path, self.version):
            raise NonFiniteWeights(f"the policy's weights hold NaN or inf: {path} not written")

    def load_state(self, path: str) -> None:
        info = read_state_info(path)
        if info["world_size"] != self.group.world:
            print(
                f"{path} was written by {info['world_size']} ranks: resharded for {self.group.world} (the run goes on "
                "within float rounding of the uninterrupted one, not bit for bit)",
                file=sys.stderr,
            )
        self.group.run(ShardedRank.load_state, path, info)
        self.version = int(info["version"])
        self._refresh_sampling_copy()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.group.run(ShardedRank.full_state_dict)

    def save_weights_for_sampler(self, path: str) -> str:
        """A plain transformers folder in the model's dtype, gathered on rank 0."""
        if not self.weights_finite():
            raise NonFiniteWeights(f"the policy's weights hold NaN or inf: {path} not written")
        state = self.full_state_dict()
        for alias in shared_storage_aliases(state):  # a tied weight is stored once, as the local trainer stores it
            del state[alias]
        save_state_as_model(self.group.local.models["policy"].lm, state, path)
        self.tokenizer.save_pretrained(path)
        return path

    def local_policy(self) -> LocalTrainer:
        """The policy as a local trainer on rank 0 (a whole copy, kept current), for ``--sampler local``."""
        if self.sampling_copy is None:
            device = self.group.local.device
            model, _ = load_model(self.spec.model, device, self.spec.attn_implementation, dtype=getattr(torch, self.spec.dtype))
            self.sampling_copy = LocalTrainer(model=model, device=device, tokenizer=self.tokenizer, seed=self.spec.seed)
            self._refresh_sampling_copy()
        return self.sampling_copy

    def close(self) -> None:
        """End the other ranks (also done at exit)."""
        self.group.close()

    def _refresh_sampling_copy(self) -> None:
        if self.sampling_copy is not None:
            self.sampling_copy.model.load_state_dict(self.full_state_dict())
            self.sampling_copy.version = self.version
