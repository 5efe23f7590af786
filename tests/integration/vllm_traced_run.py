"""``grpo-core ARGS`` with every call on the vLLM engine (and every policy written for a sampler)
appended to $GRPO_CORE_ENGINE_TRACE as JSON lines: what tests/integration/test_vllm_in_process.py
asserts about sleep, wake, loading from memory and files. Run with the vLLM virtualenv's python."""

from __future__ import annotations

import functools
import json
import os
import sys

import vllm

from grpo_core.cli import main
from grpo_core.engine.trainer import LocalTrainer

TRACE = os.environ["GRPO_CORE_ENGINE_TRACE"]


def note(call: str) -> None:
    with open(TRACE, "a") as f:
        f.write(json.dumps({"call": call}) + "\n")


def traced(cls: type, name: str, describe) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        note(describe(*args, **kwargs))
        return original(self, *args, **kwargs)

    setattr(cls, name, wrapper)


def rpc(method, *args, kwargs=None, **rest) -> str:
    # A reload from a path would read weights from a file: the trace says which it was.
    source = "memory" if kwargs and kwargs.get("weights_iterator") is not None and "weights_path" not in kwargs else "file"
    return f"{method}:{source}"


def generate(prompts, params, **kwargs) -> str:
    return "prompt_logprobs" if params[0].prompt_logprobs is not None else "generate"


traced(vllm.LLM, "__init__", lambda *a, **k: "engine")
traced(vllm.LLM, "sleep", lambda level=1, **k: f"sleep({level})")
traced(vllm.LLM, "wake_up", lambda tags=None: f"wake_up({','.join(tags) if tags else 'all'})")
traced(vllm.LLM, "collective_rpc", rpc)
traced(vllm.LLM, "reset_prefix_cache", lambda *a, **k: "reset_prefix_cache")
traced(vllm.LLM, "generate", generate)
traced(LocalTrainer, "save_weights_for_sampler", lambda path: f"save_weights_for_sampler:{os.path.basename(path.rstrip('/'))}")

if __name__ == "__main__":
    sys.argv[0] = "grpo-core"
    sys.exit(main())
