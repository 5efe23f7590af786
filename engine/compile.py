"""Regional ``torch.compile`` of the trainer's and the reference's forward (``--backend-opt compile``):
each decoder layer compiled once with dynamic shapes (as torchtitan and TRL do), so the lengths that
change every step do not recompile, and the masks, embedding and output layer stay eager.

The compiled layers are in force only inside :meth:`CompiledLayers.active` (a scoring or training
call): the model itself is left as it was, so the local sampler's forward over the same model, and a
``copy.deepcopy`` of it (a KL reference's frozen copy), run the layers eagerly as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from grpo_core.errors import PluginError
from grpo_core.metrics import record

AUTO_OFF = {
    # The measurements behind both: docs/performance.md, "Compiled layers".
    "cpu": (
        "off (auto: on a CPU compiling the layers takes tens of seconds at start, which the embedded model's short steps "
        "do not repay (docs/performance.md, 'Compiled layers'); --backend-opt compile=true turns it on)"
    ),
    "cuda": "off (auto: not measured on a GPU yet, so not on by default; --backend-opt compile=true turns it on)",
}


BACKEND = "inductor"
"""torch.compile's backend; the tests swap in ``aot_eager``, which traces the same forward and
backward graphs in seconds instead of generating and building their code."""


def compile_problem(device: torch.device) -> str | None:
    """Why inductor cannot compile for ``device`` here (its C++ compiler on a CPU, Triton on
    CUDA), with the fix; None when it can."""
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
        except ImportError:  # grpo-core runs on torch >= 2.4; inductor's C++ builder came later
            return f"torch {torch.__version__} has no inductor C++ builder that grpo-core knows (torch >= 2.5 has it)"
        try:
            get_cpp_compiler()
        except Exception as exc:  # inductor raises its own InvalidCxxCompiler, or an OSError
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"inductor finds no C++ compiler on this machine ({first}): install g++ or point CXX at one"
        return None
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "inductor needs Triton on CUDA and it is not installed: pip install triton"
    return f"inductor does not compile for {device.type} here"


def resolve_compile(setting: bool | str, device: torch.device, every_forward_cached: str | None = None) -> tuple[bool, str]:
    """Whether the trainer's and the reference's layers are compiled, and why (the run's first
    lines). ``true`` is refused, with the fix, where inductor cannot compile, and where
    ``every_forward_cached`` says why every forward of the run would take the shared-prompt path,
    whose layers run eagerly: the option would do nothing."""
    if setting is False:
        return False, "off (--backend-opt compile=false)"
    if setting is True:
        problem = compile_problem(device)
        if problem is not None:
            raise PluginError(f"--backend-opt compile=true: {problem}; or --backend-opt compile=false")
        if every_forward_cached is not None:
            raise PluginError(
                f"--backend-opt compile=true would compile nothing: {every_forward_cached}, so every forward runs a group's "
                "prompt once and its completions over the prompt's KV cache, whose layers run eagerly (a cache that grows "
                "layer by layer would build one graph per layer); add --gradient-checkpointing (whole sequences in one "
                "pass), or compile=false"
            )
        return True, (
            "on: each decoder layer compiled with dynamic shapes, in the first steps (--backend-opt compile=true); "
            f"the shared-prompt path's cached layers run eagerly; compiled code kept in {cache_directory()} for later runs; "
            "perf/recompiles counts the graphs each step compiled"
        )
    if every_forward_cached is not None:
        return False, f"off (auto: {every_forward_cached}: every forward runs over a shared prompt's KV cache, eagerly)"
    return False, AUTO_OFF.get(device.type, f"off (auto: not measured on {device.type}; --backend-opt compile=true turns it on)")


def cache_directory() -> Path:
    """Where inductor keeps what it compiled across runs: ``TORCHINDUCTOR_CACHE_DIR`` where set,
    else ``$XDG_CACHE_HOME/grpo-core/inductor`` (``~/.cache``), not inductor's own /tmp folder, which
    a reboot empties. Its FX-graph and AOTAutograd caches (on by default) then give a later run of
    the same layers its compiled code without compiling."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo-core" / "inductor"


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (first compiles and recompiles alike)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@contextmanager
def counting_compiles() -> Iterator[None]:
    """``perf/recompiles``: the graphs compiled while the block runs (the first steps compile the
    layers and the optimizer step; a later step's count above 0 is a recompile)."""
    before = graphs_compiled()
    try:
        yield
    finally:
        record("perf/recompiles", graphs_compiled() - before, "sum")


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes transformers never splits across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class CompiledLayers:
    """``model``'s decoder layers, each with a compiled call (made on its first use) that
    :meth:`active` puts in force. A call that brings a KV cache (the shared-prompt path) runs the
    layer eagerly: the cache grows layer by layer, which would compile one graph per layer."""

    def __init__(self, model: Any) -> None:
        self.layers = decoder_layers(model)
        if not self.layers:
            raise PluginError(
                f"--backend-opt compile=true: model type '{model.config.model_type}' names no decoder layer classes "
                "(_no_split_modules) to compile; use --backend-opt compile=false"
            )
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_directory())
        self.calls = [self._call_of(layer) for layer in self.layers]
        self.compiled_calls = 0
        """Layer calls that ran compiled (a cached one, the shared-prompt path's, runs eagerly)."""

    def _call_of(self, layer: torch.nn.Module) -> Any:
        eager = layer._call_impl
        compiled = torch.compile(eager, dynamic=True, backend=BACKEND)

        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("cache", kwargs.get("past_key_values")) is not None:
                return eager(*args, **kwargs)
            self.compiled_calls += 1
            return compiled(*args, **kwargs)

        return call

    @contextmanager
    def active(self) -> Iterator[None]:
        """The layers' compiled calls in force (a backward inside recomputes checkpointed layers
        with them too)."""
        before = [layer._compiled_call_impl for layer in self.layers]
        for layer, call in zip(self.layers, self.calls):
            layer._compiled_call_impl = call
        try:
            with counting_compiles():
                yield
        finally:
            for layer, call in zip(self.layers, before):
                layer._compiled_call_impl = call
