"""A server process the integration tests start on 127.0.0.1 and stop by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Started in a session of its own, so that stopping it (SIGTERM, then SIGKILL) reaches every
    process it forks (an engine, workers), and nothing else."""

    name = "server"

    def __init__(self, log: Path, port: int | None = None) -> None:
        self.log = log
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def launch(self, command: list[str], env: dict[str, str], health_path: str, timeout: float, cwd: Path | None = None) -> float:
        """Start ``command`` and wait until ``health_path`` answers 200; returns the seconds that took."""
        import httpx

        started = time.monotonic()
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} while starting; see {self.log}")
            try:
                if httpx.get(f"{self.url}{health_path}", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._kill_leftovers()

    def kill(self) -> None:
        """As a crash would: SIGKILL, no shutdown."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
