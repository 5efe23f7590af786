"""The ``fsdp`` backend: one policy sharded over several processes with torch.distributed FSDP2.

One controller. Rank 0 is the process that runs the loop; the other ranks serve it. Each trainer
call is a command that rank 0 broadcasts and every rank then carries out the same way (one
:class:`Rank` method), so their collectives meet: every rank scores its share of the sequences
and keeps its graph, the detached logprobs are gathered on rank 0, which runs the loss on leaf
copies of them (any loss plugin, unchanged) and scatters ∂loss/∂logprobs back for each rank's
backward. This is the Tinker backend's custom-loss path, in process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import attrs
import tinker
import torch
import torch.distributed as dist

from grpo_core import hookimpl, option
from grpo_core.backend import CustomLossFn, NonFiniteWeights
from grpo_core.config import RunConfig, default_threads
from grpo_core.engine.architectures import AUTO
from grpo_core.engine.forward import TRAINER_FORWARD, TransformersForward
from grpo_core.engine.logprobs import DatumRouting, mean_entropy, target_logprobs, trained_entropy_sum
from grpo_core.engine.models import (
    enable_activation_checkpointing,
    load_model,
    model_path,
    resolve_checkpointing,
    resolve_precision,
    save_state_as_model,
    shared_storage_aliases,
    train_mode,
)
from grpo_core.engine.moe_routing import num_experts, routing_problem, tapped
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
from grpo_core.engine.trainer import LocalTrainer
from grpo_core.engine.vision import image_text_config
from grpo_core.errors import PluginError
from grpo_core.metrics import record
from grpo_core.plugins.backends.local import LocalBackend

STATE_FORMAT = "grpo-core-fsdp-1"
STATE_INFO = "fsdp.json"
"""Beside the DCP files of a checkpoint: its format, the policy's version and the world size."""

CONTROL_TIMEOUT = timedelta(days=7)
"""How long a rank waits for rank 0's next command: as long as sampling takes. A rank that dies
is noticed at once all the same (its connections close); only a rank that hangs is not."""
COMPUTE_TIMEOUT = timedelta(minutes=30)
"""How long a collective of the model (NCCL on CUDA) waits for the other ranks."""
START_TIMEOUT = 600.0
"""Seconds the spawned ranks have to import torch and join."""


def torchrun_world() -> int | None:
    """The world size when torchrun (or another launcher setting WORLD_SIZE) started this process."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


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

    def check(self, config: RunConfig) -> int:
        """The world size, after refusing what this backend cannot do (before anything loads)."""
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
        if not config.memory_check:
            raise PluginError("--no-memory-check would do nothing: the fsdp backend makes no memory plan to check (the local one does)")
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
    def check_config(self, config: RunConfig) -> None:
        self.check(config)

    @hookimpl
    def load_tokenizer(self, config: RunConfig) -> tuple[Any, int | None]:
        self.check(config)
        return LocalBackend(attn_implementation=self.attn_implementation).load_tokenizer(config=config)

    @hookimpl
    def make_trainer(self, config: RunConfig) -> FSDPTrainer:
        world = self.check(config)
        if config.train_vision or image_text_config(model_path(config.model)) is not None:
            raise PluginError(
                "--backend fsdp does not train vision-language models (their vision parts are not sharded): use --backend local"
            )
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
        group = start_group(world, device.type, spawn=torchrun_world() is None)
        pids = ", ".join(str(w.pid) for w in group.workers)
        started = f"; ranks 1-{world - 1} are pids {pids}" if pids else ""
        print(f"trainer: fsdp, {world} ranks ({'nccl' if device.type == 'cuda' else 'gloo'}{started})", file=sys.stderr)
        tokenizer = group.run("load", "policy", spec)
        return FSDPTrainer(group=group, tokenizer=tokenizer, spec=spec)

    @hookimpl
    def make_reference(self, config: RunConfig, trainer: FSDPTrainer) -> FSDPReference:
        trainer.group.run("load", "reference", trainer.spec)
        return FSDPReference(trainer.group)

    def serve_rank(self, config: RunConfig) -> int:
        """What a rank other than 0 that torchrun started runs instead of the loop: it serves rank
        0's trainer; returns the exit code."""
        self.check(config)
        device, _, _ = resolve_precision(config.device, config.dtype)
        rank = int(os.environ["RANK"])
        join_group(rank, int(os.environ["WORLD_SIZE"]), device.type, store=None)
        return serve(rank)


PRECISION_NOTES = {
    "float32": "float32 (exact: a resumed run repeats the uninterrupted one bit for bit)",
    "bfloat16": "float32 sharded weights, gradients and AdamW state; layers compute in bfloat16, gradients reduced in float32",
}


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


class RankFailed(PluginError):
    """A rank died or the ranks fell out of step: the group cannot go on."""


class Agreed(PluginError):
    """An error every rank raised at the same point of a command: the ranks are still in step."""


# --- the group of ranks, as rank 0 sees it ----------------------------------------------------------


@attrs.define(eq=False)
class Group:
    """Rank 0's handle on the ranks: sends commands, notices a rank that died, and ends them."""

    world: int
    control: Any
    """The process group commands travel on (gloo: Python objects on the CPU)."""
    workers: list[Any] = attrs.field(factory=list)
    """The ranks this process started (empty under torchrun)."""
    broken: str | None = None
    """Why the group cannot take another command."""
    lock: Any = attrs.field(factory=threading.RLock)
    """One command at a time (the async loop calls the trainer from several threads)."""

    def run(self, name: str, *args: Any, **local: Any) -> Any:
        """Every rank runs ``Rank.<name>(*args)``; rank 0 also gets ``local`` (what stays here, a
        loss function) and returns what its method returns."""
        with self.lock:
            if self.broken:
                raise RankFailed(self.broken)
            try:
                dist.broadcast_object_list([(name, args)], src=0, group=self.control)
                return getattr(RANK_STATE[0], name)(*args, **local)
            except Agreed:
                raise
            except Exception as exc:
                # Where the other ranks are in this command is unknown now: no further command can meet them.
                self.broken = self.why_broken(name, exc)
                raise RankFailed(self.broken) from exc
            except BaseException:  # a second Ctrl-C, mid-command: the ranks are out of step too
                self.broken = f"interrupted during {name}: the ranks were left mid-command, nothing more is saved from them"
                raise

    def why_broken(self, command: str, exc: Exception) -> str:
        deadline = time.monotonic() + 2.0  # a rank that died is reaped within moments of its connections closing
        while time.monotonic() < deadline and all(w.poll() is None for w in self.workers):
            time.sleep(0.05)
        dead = [(r, w) for r, w in enumerate(self.workers, start=1) if w.poll() is not None]
        if dead:
            rank, worker = dead[0]
            code = worker.returncode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return f"rank {rank} of {self.world} (pid {worker.pid}) died ({how}) during {command}: the run cannot go on without it"
        if isinstance(exc, dist.DistError) or "Connection closed" in str(exc) or "Connection reset" in str(exc):
            return f"a rank stopped answering during {command} ({type(exc).__name__}: {str(exc).splitlines()[0]}): the run cannot go on"
        return f"{command} failed on rank 0 ({type(exc).__name__}: {exc}); the other ranks are left mid-command"

    def close(self) -> None:
        """End the ranks: a shutdown command when they can take it, else (or if they do not go) kill them."""
        with self.lock:
            if not self.broken and dist.is_initialized():
                try:
                    dist.broadcast_object_list([("shutdown", ())], src=0, group=self.control)
                except Exception:
                    pass
            self.broken = self.broken or "the group was closed"
            for worker in self.workers:
                try:
                    worker.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
            leave_group()


def start_group(world: int, device_type: str, spawn: bool) -> Group:
    """Rank 0's start: spawn ranks 1..world-1 here (or find torchrun's), join them, return the group."""
    if dist.is_initialized():
        raise PluginError("a torch.distributed group is already running in this process: one fsdp trainer per process")
    workers = []
    store = None
    if spawn:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=START_TIMEOUT))
        # A fresh interpreter per rank (not multiprocessing's spawn, which imports the caller's __main__ again).
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from {__name__} import _spawned_rank; _spawned_rank({rank}, {world}, {store.port}, {device_type!r}, {os.getpid()})",
                ]
            )  # fmt: skip
            for rank in range(1, world)
        ]
        _wait_for_ranks(store, workers)
    control = join_group(0, world, device_type, store)
    group = Group(world=world, control=control, workers=workers)
    atexit.register(group.close)
    return group


def _wait_for_ranks(store: Any, workers: list[Any]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    keys = [f"ready/{rank}" for rank in range(1, len(workers) + 1)]
    while not store.check(keys):
        for rank, worker in enumerate(workers, start=1):
            if worker.poll() is not None:
                for other in workers:
                    other.kill()
                raise RankFailed(f"rank {rank} exited while starting (exit code {worker.returncode}); its error is printed above")
        if time.monotonic() > deadline:
            for other in workers:
                other.kill()
            raise RankFailed(f"the ranks did not start within {START_TIMEOUT:.0f} s")
        time.sleep(0.05)


def join_group(rank: int, world: int, device_type: str, store: Any) -> Any:
    """Join the default process group (NCCL on CUDA, gloo on a CPU) and make this rank's state;
    returns the group commands travel on (gloo)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    kwargs = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
    dist.init_process_group(backend, timeout=CONTROL_TIMEOUT if backend == "gloo" else COMPUTE_TIMEOUT, **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    RANK_STATE[:] = [Rank(rank=rank, world=world, device=device, control=control)]
    return control


GLOO_SETTLE_S = 0.2
"""How long a leaving rank lets gloo's workers finish freeing the last command's tensors."""

RANK_STATE: list[Rank] = []
"""This process's :class:`Rank` (one per process: one default process group)."""


def leave_group() -> None:
    """Destroy this process's groups and give gloo's worker threads the moment they need to free
    the last command's tensors. A worker frees a finished collective's tensors after the caller
    has returned from it, and that takes the GIL: a worker that asks for it while the interpreter
    exits is stopped mid-destructor and the process aborts ("terminate called without an active
    exception", 1 exit in 5 under torchrun, where nothing waits between the last command and the
    exit). destroy_process_group does not join the workers: FSDP's state keeps the group alive."""
    RANK_STATE.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(GLOO_SETTLE_S)  # the GIL is free while this thread sleeps


def _spawned_rank(rank: int, world: int, port: int, device_type: str, parent: int) -> None:
    """A rank that ``nproc`` started: it dies with rank 0 and leaves signals to it."""
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(1)  # rank 0 died before the line above took effect
    # Ctrl-C in a terminal and a SIGTERM to the process group reach every rank: rank 0 decides
    # (it finishes the step and saves, which needs this rank), then sends the shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=START_TIMEOUT))
    store.set(f"ready/{rank}", "1")
    join_group(rank, world, device_type, store)
    sys.exit(serve(rank))


def _die_with_parent() -> None:
    """SIGKILL this process when the process that started it ends (Linux), however it ends."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def serve(rank: int) -> int:
    """A rank's loop: run rank 0's commands until the shutdown; returns the exit code."""
    state = RANK_STATE[0]
    while True:
        message: list[Any] = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=state.control)
        except Exception as exc:
            print(f"fsdp rank {rank}: rank 0 is gone ({type(exc).__name__}); stopping", file=sys.stderr)
            return 1
        name, args = message[0]
        if name == "shutdown":
            leave_group()
            return 0
        try:
            getattr(state, name)(*args)
        except Agreed:
            # An error every rank met in this command (a bad checkpoint, say): rank 0 raises it to
            # the loop and reports it; this rank stays in step and serves the next command.
            continue


# --- what every rank does for each command ----------------------------------------------------------


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
"""Why its rows are padded (``Rank.logprobs``): ``perf/padding_free`` is 0 and config.json says so."""

PLACEHOLDER = tinker.Datum(model_input=tinker.ModelInput.from_ints([0]), loss_fn_inputs={"target_tokens": [0], "weights": [0.0]})
"""A rank with no sequence of a call still runs the model (its layers' collectives need it) on this."""


def shares(items: Sequence[Any], world: int) -> list[list[Any]]:
    """``items`` split in ``world`` consecutive shares, their sizes differing by at most one."""
    n = len(items)
    return [list(items[r * n // world : (r + 1) * n // world]) for r in range(world)]


@attrs.define(eq=False)
class Rank:
    """One process's part of the work. Every rank runs the same method for each command, in the
    same order, so that the collectives inside meet; results are rank 0's."""

    rank: int
    world: int
    device: torch.device
    control: Any
    models: dict[str, Sharded] = attrs.field(factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    spec: ModelSpec | None = None

    def agree(self, error: str | None) -> None:
        """Raise (on every rank) the first rank's error, if any rank had one."""
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, error, group=self.control)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, message = failed[0]
            raise Agreed(message if rank == 0 else f"rank {rank}: {message}")

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

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


# --- the trainer protocol on rank 0 -----------------------------------------------------------------


@attrs.define(eq=False)
class FSDPReference:
    """The frozen reference: a second sharded model, forward only."""

    group: Group

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        return self.group.run("forward", "reference", shares(datums, self.group.world))


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

    @property
    def routing_problem(self) -> str | None:
        """Why its forwards cannot record and force expert routing (declared in hookspecs)."""
        return routing_problem(RANK_STATE[0].models["policy"].lm)

    @property
    def run_info(self) -> dict[str, str]:
        """How it trains, for config.json (declared in hookspecs)."""
        return {"forward": TRAINER_FORWARD, "padding": f"sequences are padded ({UNPACKED})"}

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        return self.group.run("forward", "policy", shares(datums, self.group.world))

    def forward_routed(self, datums: Sequence[tinker.Datum]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward``, and the experts each datum's input tokens were routed to (see LocalTrainer.forward_routed)."""
        if self.routing_problem is not None:
            raise ValueError(f"no routing to record: {self.routing_problem}")
        logprobs, routed = self.group.run("forward", "policy", shares(datums, self.group.world), True)
        return logprobs, [r["routed_experts"] for r in routed]

    def forward_backward_custom(self, datums: Sequence[tinker.Datum], loss_fn: CustomLossFn) -> tinker.ForwardBackwardOutput:
        record("perf/padding_free", 0.0, "max")  # 0: padded (UNPACKED), as the local trainer records it
        logprobs, loss, metrics, error, routed = self.group.run(
            "forward_backward", shares(datums, self.group.world), loss_fn=loss_fn, datums=list(datums)
        )
        if error is not None:
            raise error
        if not torch.isfinite(loss):
            self.nonfinite_loss = True
        if routed:
            experts = num_experts(RANK_STATE[0].models["policy"].lm)
            metrics = {**metrics, **load_metrics(torch.cat([r["routed_experts"] for r in routed]), experts)}
        return forward_backward_output(logprobs, loss, metrics, routed or None)

    def optim_step(self, adam_params: tinker.AdamParams) -> dict[str, float]:
        grad_norm, skipped, finite = self.group.run("optim_step", adam_params, self.nonfinite_loss)
        self.nonfinite_loss = False
        if not skipped:
            self.version += 1
            if not finite:
                raise NonFiniteWeights(nonfinite_step_message(grad_norm, adam_params))
            self._refresh_sampling_copy()
        return step_metrics(grad_norm, adam_params, skipped)

    def weights_finite(self) -> bool:
        return self.group.run("weights_finite")

    def save_state(self, path: str) -> None:
        """A torch.distributed.checkpoint folder (every rank writes its shards of the weights and
        of the AdamW state) and fsdp.json."""
        if not self.group.run("save_state", path, self.version):
            raise NonFiniteWeights(f"the policy's weights hold NaN or inf: {path} not written")

    def load_state(self, path: str) -> None:
        info_file = Path(path) / STATE_INFO
        if not info_file.is_file():
            raise PluginError(f"{path} is not a checkpoint of the fsdp trainer (no {STATE_INFO})")
        info = json.loads(info_file.read_text())
        if info.get("format") != STATE_FORMAT:
            raise PluginError(f"{path} is not a checkpoint of the fsdp trainer (format {info.get('format')!r})")
        if info["world_size"] != self.group.world:
            print(
                f"{path} was written by {info['world_size']} ranks: resharded for {self.group.world} (the run goes on "
                "within float rounding of the uninterrupted one, not bit for bit)",
                file=sys.stderr,
            )
        self.group.run("load_state", path, info)
        self.version = int(info["version"])
        self._refresh_sampling_copy()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.group.run("full_state_dict")

    def save_weights_for_sampler(self, path: str) -> str:
        """A plain transformers folder in the model's dtype, gathered on rank 0."""
        if not self.weights_finite():
            raise NonFiniteWeights(f"the policy's weights hold NaN or inf: {path} not written")
        state = self.full_state_dict()
        for alias in shared_storage_aliases(state):  # a tied weight is stored once, as the local trainer stores it
            del state[alias]
        save_state_as_model(RANK_STATE[0].models["policy"].lm, state, path)
        self.tokenizer.save_pretrained(path)
        return path

    def local_policy(self) -> LocalTrainer:
        """The policy as a local trainer on rank 0 (a whole copy, kept current), for ``--sampler local``."""
        if self.sampling_copy is None:
            device = RANK_STATE[0].device
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
