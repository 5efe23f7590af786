"""A group of processes that run one controller's commands in step (torch.distributed).

Rank 0 is the controller: the process that runs the loop. Every other rank waits for its next
command, and every rank then runs the same method of its :class:`RankWorker` with the same
arguments, so that the collectives inside meet. The commands a worker serves are declared on its
class (``COMMANDS``) and travel as their index there: a rank never looks a method up by a name it
was sent. Each process holds its worker in a local variable (rank 0: the :class:`Group`; the
others: the loop of :func:`serve`), never in a module global.

This module owns the group's life (start, spawning ranks on one machine or joining torchrun's,
failure detection, shutdown); what the commands compute is the worker's (``engine/sharded.py``
for the fsdp backend).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from grpo_core.errors import PluginError

CONTROL_TIMEOUT = timedelta(days=7)
"""How long a rank waits for rank 0's next command: as long as sampling takes. A rank that dies
is noticed at once all the same (its connections close); only a rank that hangs is not."""
COMPUTE_TIMEOUT = timedelta(minutes=30)
"""How long a collective of the model (NCCL on CUDA) waits for the other ranks."""
START_TIMEOUT = 600.0
"""Seconds the spawned ranks have to import torch and join."""
GLOO_SETTLE_S = 0.2
"""How long a leaving rank lets gloo's workers finish freeing the last command's tensors."""
SHUTDOWN = -1
"""The command index that ends a rank's loop."""


def torchrun_world() -> int | None:
    """The world size when torchrun (or another launcher setting WORLD_SIZE) started this process."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


class RankFailed(PluginError):
    """A rank died or the ranks fell out of step: the group cannot go on."""


class Agreed(PluginError):
    """An error every rank raised at the same point of a command: the ranks are still in step."""


@attrs.define(eq=False)
class RankWorker:
    """One process's part of the work. Subclasses declare the methods rank 0 may command in
    ``COMMANDS``; every rank runs each command in the same order, results are rank 0's."""

    rank: int
    world: int
    device: torch.device
    control: Any
    """The process group commands travel on (gloo: Python objects on the CPU)."""

    COMMANDS: ClassVar[tuple[Callable[..., Any], ...]] = ()

    def agree(self, error: str | None) -> None:
        """Raise (on every rank) the first rank's error, if any rank had one."""
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, error, group=self.control)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, message = failed[0]
            raise Agreed(message if rank == 0 else f"rank {rank}: {message}")

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None on the others)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out


@attrs.define(eq=False)
class Group:
    """Rank 0's handle on the ranks: sends commands, notices a rank that died, and ends them."""

    world: int
    local: RankWorker
    """Rank 0's own worker."""
    workers: list[Any] = attrs.field(factory=list)
    """The ranks this process started (empty under torchrun)."""
    broken: str | None = None
    """Why the group cannot take another command."""
    lock: Any = attrs.field(factory=threading.RLock)
    """One command at a time (the async loop calls the trainer from several threads)."""

    def run(self, command: Callable[..., Any], *args: Any, **local: Any) -> Any:
        """Every rank runs ``command`` (a method in its worker's ``COMMANDS``) with ``args``; rank 0
        also gets ``local`` (what stays here, a loss function) and returns what it returns."""
        index = type(self.local).COMMANDS.index(command)  # a ValueError for an undeclared command, before anything is sent
        name = command.__name__
        with self.lock:
            if self.broken:
                raise RankFailed(self.broken)
            try:
                dist.broadcast_object_list([(index, args)], src=0, group=self.local.control)
                return command(self.local, *args, **local)
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
                    dist.broadcast_object_list([(SHUTDOWN, ())], src=0, group=self.local.control)
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


def start_group(world: int, device_type: str, spawn: bool, worker: type[RankWorker]) -> Group:
    """Rank 0's start: spawn ranks 1..world-1 here (or find torchrun's), join them, return the group
    whose ranks each serve a ``worker``."""
    if dist.is_initialized():
        raise PluginError("a torch.distributed group is already running in this process: one fsdp trainer per process")
    workers = []
    store = None
    if spawn:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=START_TIMEOUT))
        where = f"{worker.__module__}:{worker.__qualname__}"
        start = f"from {__name__} import spawned_rank; spawned_rank({{}}, {world}, {store.port}, {device_type!r}, {os.getpid()}, {where!r})"
        # A fresh interpreter per rank (not multiprocessing's spawn, which imports the caller's __main__ again).
        workers = [subprocess.Popen([sys.executable, "-c", start.format(rank)]) for rank in range(1, world)]
        _wait_for_ranks(store, workers)
    group = Group(world=world, local=join_group(0, world, device_type, store, worker), workers=workers)
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


def join_group(rank: int, world: int, device_type: str, store: Any, worker: type[RankWorker]) -> RankWorker:
    """Join the default process group (NCCL on CUDA, gloo on a CPU); returns this rank's worker,
    whose commands travel on gloo."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    kwargs = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
    dist.init_process_group(backend, timeout=CONTROL_TIMEOUT if backend == "gloo" else COMPUTE_TIMEOUT, **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return worker(rank=rank, world=world, device=device, control=control)


def leave_group() -> None:
    """Destroy this process's groups and give gloo's worker threads the moment they need to free
    the last command's tensors. A worker frees a finished collective's tensors after the caller
    has returned from it, and that takes the GIL: a worker that asks for it while the interpreter
    exits is stopped mid-destructor and the process aborts ("terminate called without an active
    exception", 1 exit in 5 under torchrun, where nothing waits between the last command and the
    exit). destroy_process_group does not join the workers: FSDP's state keeps the group alive."""
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(GLOO_SETTLE_S)  # the GIL is free while this thread sleeps


def spawned_rank(rank: int, world: int, port: int, device_type: str, parent: int, worker: str) -> None:
    """A rank that :func:`start_group` spawned: it dies with rank 0 and leaves signals to it;
    ``worker`` is its class as ``module:qualname``."""
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(1)  # rank 0 died before the line above took effect
    # Ctrl-C in a terminal and a SIGTERM to the process group reach every rank: rank 0 decides
    # (it finishes the step and saves, which needs this rank), then sends the shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    module, qualname = worker.split(":")
    worker_class = getattr(importlib.import_module(module), qualname)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=START_TIMEOUT))
    store.set(f"ready/{rank}", "1")
    sys.exit(serve(join_group(rank, world, device_type, store, worker_class)))


def _die_with_parent() -> None:
    """SIGKILL this process when the process that started it ends (Linux), however it ends."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def serve(worker: RankWorker) -> int:
    """A rank's loop: run rank 0's commands until the shutdown; returns the exit code."""
    commands = type(worker).COMMANDS
    while True:
        message: list[Any] = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=worker.control)
        except Exception as exc:
            print(f"fsdp rank {worker.rank}: rank 0 is gone ({type(exc).__name__}); stopping", file=sys.stderr)
            return 1
        index, args = message[0]
        if index == SHUTDOWN:
            leave_group()
            return 0
        try:
            commands[index](worker, *args)
        except Agreed:
            # An error every rank met in this command (a bad checkpoint, say): rank 0 raises it to
            # the loop and reports it; this rank stays in step and serves the next command.
            continue
