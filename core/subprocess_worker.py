"""A helper for plugin authors: run checks in a child process with a time limit per check.

A reward that calls a library which can hang or exhaust memory on model output (sympy,
math-verify) runs it in a worker process: a hanging check scores as a failure within its time
limit and the process is replaced, and the run itself never blocks.

The child is ``python -m <module> [args]`` whose ``main`` calls :func:`serve`; the parent holds a
:class:`ReplacedWorker` (a :class:`WorkerProcess` started on first use, replaced after a timeout
or a death). Protocol: the child writes ``ready`` once loaded; then for each JSON line
``{"id": n, ...}`` on its stdin it writes one JSON line ``{"id": n, ...}`` on its stdout.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ReplacedWorker", "WorkerProcess", "limit_memory", "serve"]

# --------------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------------


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


def _read(stream: Any, replies: queue.Queue[str | None]) -> None:
    try:
        for line in stream:
            replies.put(line.strip())
    except (OSError, ValueError):
        pass
    replies.put(None)


class WorkerProcess:
    """A ``python -m <module> [args]`` child and a thread that reads its replies.

    ``name`` names the worker in the error raised when it is not ready within
    ``startup_timeout_s``; ``pythonpath`` is put first on the child's PYTHONPATH (the folder
    holding the plugin's package, so that it works from a source checkout too).
    """

    def __init__(
        self, module: str, args: Sequence[str] = (), *, name: str, startup_timeout_s: float, pythonpath: str | None = None
    ) -> None:
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            bufsize=1,
            env=env,
        )
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_read, args=(self.proc.stdout, self.replies), daemon=True).start()
        self.next_id = 0
        try:
            ready = self.replies.get(timeout=startup_timeout_s)
        except queue.Empty:
            ready = None
        if ready != "ready":
            self.close()
            raise RuntimeError(
                f"the {name} worker ({sys.executable} -m {module}) did not start within {startup_timeout_s:g} s; its stderr is above"
            )

    def request(self, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The worker's reply to ``payload``, or None when it ran past ``timeout_s`` or died."""
        self.next_id += 1
        try:
            self.proc.stdin.write(json.dumps({"id": self.next_id, **payload}) + "\n")
            self.proc.stdin.flush()
            line = self.replies.get(timeout=timeout_s)
            reply = json.loads(line) if line is not None else None
        except (OSError, ValueError, queue.Empty):
            return None
        return reply if isinstance(reply, dict) and reply.get("id") == self.next_id else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self._finalizer()


class ReplacedWorker:
    """A :class:`WorkerProcess` made by ``start`` on first use and replaced when a request runs
    past its time limit or the process died; one request at a time (thread-safe)."""

    def __init__(self, start: Callable[[], WorkerProcess]) -> None:
        self._start = start
        self.process: WorkerProcess | None = None
        self._lock = threading.Lock()

    def request(self, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The reply, or None after a timeout or a death (the process is then stopped)."""
        with self._lock:
            if self.process is None or not self.process.alive():
                self.process = self._start()
            reply = self.process.request(payload, timeout_s)
            if reply is None:
                self.process.close()
                self.process = None
            return reply

    def close(self) -> None:
        """Stop the process (a later request starts a new one)."""
        with self._lock:
            if self.process is not None:
                self.process.close()
                self.process = None


# --------------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------------


def limit_memory(megabytes: int) -> None:
    """Limit this process's address space (Linux); 0 = no limit."""
    if megabytes <= 0:
        return
    try:
        import resource

        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
        pass


def serve(load: Callable[[], Callable[[dict[str, Any]], Mapping[str, Any]]], *, memory_limit_mb: int, failure: Mapping[str, Any]) -> int:
    """Answer requests on stdin until its end; the body of a worker module's ``main``.

    ``load`` imports the checking library, warms it up (so the first timed check does not pay
    for lazy imports) and returns the handler, which maps a request to the fields of its reply.
    A handler that raises gives ``failure`` plus ``error``: what the model wrote cannot break
    the worker. The memory limit is set after loading, so that it bounds the checks only.
    """
    # The protocol gets its own copy of stdout; anything printed by libraries goes to stderr.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    handle = load()
    limit_memory(memory_limit_mb)
    channel.write("ready\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply: dict[str, object] = {"id": request["id"]}
        try:
            reply.update(handle(request))
        except MemoryError:
            reply.update(failure, error="MemoryError")
        except Exception as exc:
            reply.update(failure, error=f"{type(exc).__name__}: {exc}"[:300])
        channel.write(json.dumps(reply) + "\n")
    return 0
