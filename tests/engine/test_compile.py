"""Regional compile of the trainer's and the reference's forward (engine/compile.py): the layers
compiled only inside the trainer's calls, the same logprobs and gradients as eager, no recompile
per length, and the refusals. They compile with ``aot_eager`` (the same traced forward and backward
graphs, without inductor's code generation, which takes ~1 min here: benchmarks/compile.py runs it)."""

from __future__ import annotations

import copy
import os

import pytest
import tinker
import torch
import torch._dynamo
import torch._dynamo.utils

from grpo_core.engine import compile as regional
from grpo_core.engine.compile import CompiledLayers, compile_problem, decoder_layers, resolve_compile
from grpo_core.engine.models import load_model
from grpo_core.engine.trainer import LocalReference, LocalTrainer
from grpo_core.errors import PluginError
from grpo_core.metrics import scope
from tests.engine.ragged_datums import datum, ragged_datums

CPU = torch.device("cpu")


def assert_same_as_eager(logprobs, grads, eager_logprobs, eager_grads) -> None:
    """Compiled logprobs and gradients equal the eager ones to float32 rounding."""
    for ours, theirs in zip(logprobs, eager_logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def frames_compiled() -> int:
    """Frames dynamo traced (first compiles and recompiles) since the test began."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def module_dynamo():
    """Graphs compiled once for the module: the layers' calls share them (their guards hold for
    every layer of every model of the same shape), so only the first test pays the compile."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_dynamo(module_dynamo, monkeypatch):
    monkeypatch.setattr(regional, "BACKEND", "aot_eager")
    torch._dynamo.utils.counters.clear()


def trainer_of(tiny_model_dir, compiled: bool, **kwargs) -> LocalTrainer:
    model, tokenizer = load_model(str(tiny_model_dir), CPU, "sdpa", dtype=torch.float32)
    return LocalTrainer(model=model, tokenizer=tokenizer, device=CPU, padding_free=True, compile=compiled, **kwargs)


def sum_loss(datums, logprobs):
    return -sum(lp.sum() for lp in logprobs), {}


def logprobs_and_grads(trainer: LocalTrainer, datums) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    trainer.model.zero_grad()
    out = trainer.forward_backward_custom(datums, sum_loss)
    logprobs = [torch.tensor(o["logprobs"].data) for o in out.loss_fn_outputs]
    return logprobs, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def shared_prompt_datums(gen: torch.Generator, prompt_tokens: int, completions: list[int]) -> list[tinker.Datum]:
    prompt = torch.randint(2, 290, (prompt_tokens,), generator=gen).tolist()
    return [datum(prompt + torch.randint(2, 290, (n,), generator=gen).tolist(), prompt_tokens - 1) for n in completions]


def test_false_is_off_and_says_so():
    assert resolve_compile(False, CPU) == (False, "off (--backend-opt compile=false)")


@pytest.mark.parametrize(("device", "why"), [("cpu", "tens of seconds at start"), ("cuda", "not measured on a GPU")])
def test_auto_is_off_and_the_line_says_why_and_how_to_turn_it_on(device, why):
    compiled, line = resolve_compile("auto", torch.device(device))
    assert compiled is False
    assert line.startswith("off (auto: ") and why in line and "--backend-opt compile=true" in line


def test_true_with_a_compiler_is_on():
    compiled, line = resolve_compile(True, CPU)
    assert compiled is True and line.startswith("on: each decoder layer compiled")


def test_true_without_a_cpp_compiler_is_refused_with_the_fix():
    import torch._inductor.config

    # inductor's own patch: monkeypatch's undo would delete the setting (it is no plain attribute),
    # and every later compile in the process would find no compiler.
    with torch._inductor.config.patch({"cpp.cxx": ("no-such-compiler-xyz",)}):
        with pytest.raises(PluginError, match=r"compile=true: inductor finds no C\+\+ compiler .*install g\+\+ .*compile=false"):
            resolve_compile(True, CPU)
    assert torch._inductor.config.cpp.cxx != ("no-such-compiler-xyz",)  # back, and still a setting


def test_true_on_cuda_without_triton_is_refused_with_the_fix(monkeypatch):
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    with pytest.raises(PluginError, match=r"compile=true: inductor needs Triton .*pip install triton; or --backend-opt compile=false"):
        resolve_compile(True, torch.device("cuda"))


def test_a_model_without_layer_classes_is_refused(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir), CPU, "sdpa", dtype=torch.float32)
    model._no_split_modules = []
    with pytest.raises(PluginError, match="names no decoder layer classes .*compile=false"):
        CompiledLayers(model)


@pytest.mark.slow
def test_compiled_trainer_equals_eager_and_compiles_frames(tiny_model_dir, fresh_dynamo):
    datums = ragged_datums()
    eager = trainer_of(tiny_model_dir, False)
    eager_logprobs, eager_grads = logprobs_and_grads(eager, datums)
    assert eager.compiled_layers is None and frames_compiled() == 0  # compile=false compiles nothing
    trainer = trainer_of(tiny_model_dir, True)
    assert len(trainer.compiled_layers.layers) == 2 == len(decoder_layers(trainer.model))
    logprobs, grads = logprobs_and_grads(trainer, datums)
    assert trainer.compiled_layers.compiled_calls == 2  # one packed forward through both layers
    assert_same_as_eager(logprobs, grads, eager_logprobs, eager_grads)
    # Outside its calls the model is as it was: the sampler's forward and a deepcopy run eagerly.
    assert all(layer._compiled_call_impl is None for layer in trainer.compiled_layers.layers)
    copied = copy.deepcopy(trainer.model)
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(copied))


@pytest.mark.slow
def test_checkpointed_compiled_trainer_equals_eager(tiny_model_dir, fresh_dynamo):
    from grpo_core.engine.models import enable_activation_checkpointing

    datums = ragged_datums()[:3]
    trainers = [trainer_of(tiny_model_dir, compiled, activation_checkpointing=True) for compiled in (False, True)]
    for trainer in trainers:
        enable_activation_checkpointing(trainer.model)
    (eager_logprobs, eager_grads), (logprobs, grads) = (logprobs_and_grads(trainer, datums) for trainer in trainers)
    # One compiled call per layer: dynamo traces transformers' checkpoint, so the recompute in
    # backward is part of the compiled graph.
    assert trainers[1].compiled_layers.compiled_calls == 2
    assert_same_as_eager(logprobs, grads, eager_logprobs, eager_grads)


@pytest.mark.slow
def test_changing_lengths_do_not_recompile_each_step(tiny_model_dir, fresh_dynamo):
    trainer = trainer_of(tiny_model_dir, True)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        lengths = [5 + (7 * step + 3 * i) % 23 for i in range(2 + step % 3)]
        datums = [datum(torch.randint(2, 290, (n + 3,), generator=gen).tolist(), 2) for n in lengths]
        trainer.forward_backward_custom(datums, sum_loss)
    # Six steps of new lengths all ran compiled, on one graph for dynamic lengths and at most one
    # more where dynamo specializes a size of 1 (one packed row, then two): not one per step.
    assert trainer.compiled_layers.compiled_calls >= 12
    assert frames_compiled() <= 2


@pytest.mark.slow  # traces the layers for new shapes: ~25 s on 2 shared cores
def test_each_step_records_the_graphs_it_compiled_and_later_lengths_compile_none(tiny_model_dir, fresh_dynamo):
    trainer = trainer_of(tiny_model_dir, True)
    gen = torch.Generator().manual_seed(1)
    compiled = []
    for lengths in ([9, 14], [5, 21], [17, 6]):
        datums = [datum(torch.randint(2, 290, (n,), generator=gen).tolist(), 2) for n in lengths]
        with scope() as step:
            trainer.forward_backward_custom(datums, sum_loss)
        compiled.append(step.as_dict()["perf/recompiles"])
    # The module's first test pays the compile; a step that compiles nothing records 0, not nothing.
    assert compiled[1:] == [0, 0] and compiled[0] == frames_compiled()


def test_compiled_code_is_kept_across_runs_outside_tmp(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert regional.cache_directory() == tmp_path / "grpo-core" / "inductor"
    trainer_of(tiny_model_dir, True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "grpo-core" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert regional.cache_directory() == tmp_path / "mine"  # the user's own stays
    assert "compiled code kept in " + str(tmp_path / "mine") in resolve_compile(True, CPU)[1]


def test_shared_prefix_runs_cached_layers_eagerly_and_equals_eager(tiny_model_dir, fresh_dynamo):
    gen = torch.Generator().manual_seed(2)
    datums = shared_prompt_datums(gen, 9, [4, 7]) + shared_prompt_datums(gen, 9, [3, 6])
    eager_logprobs, eager_grads = logprobs_and_grads(trainer_of(tiny_model_dir, False), datums)
    trainer = trainer_of(tiny_model_dir, True)
    logprobs, grads = logprobs_and_grads(trainer, datums)
    # Its two forwards both bring the KV cache: eager, nothing compiled per layer.
    assert trainer.compiled_layers.compiled_calls == 0 and frames_compiled() == 0
    assert_same_as_eager(logprobs, grads, eager_logprobs, eager_grads)


@pytest.mark.slow
def test_compiled_reference_scores_as_eager(tiny_model_dir, fresh_dynamo):
    datums = ragged_datums()
    model, _ = load_model(str(tiny_model_dir), CPU, "sdpa", dtype=torch.float32)
    eager = LocalReference(model, CPU, padding_free=True).forward(datums)
    reference = LocalReference(model, CPU, padding_free=True, compile=True)
    compiled = reference.forward(datums)
    assert reference.compiled_layers.compiled_calls == 2
    for ours, theirs in zip(compiled, eager, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_torch_without_inductors_cpp_builder_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch._inductor.cpp_builder", None)
    problem = compile_problem(CPU)
    assert problem.startswith(f"torch {torch.__version__} has no inductor C++ builder") and "torch >= 2.5" in problem


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_inductors_layers_equal_eager_and_new_lengths_compile_nothing(tiny_model_dir, dtype):
    """The real backend (inductor, Triton): the same logprobs and gradients as the eager layers, and
    steps of new lengths after the first record perf/recompiles 0."""
    cuda = torch.device("cuda")
    torch._dynamo.reset()

    def trainer(compiled: bool) -> LocalTrainer:
        model, tokenizer = load_model(str(tiny_model_dir), cuda, "sdpa", dtype=dtype)
        return LocalTrainer(model=model, tokenizer=tokenizer, device=cuda, padding_free=True, compile=compiled)

    datums = ragged_datums()
    eager_logprobs, eager_grads = logprobs_and_grads(trainer(False), datums)
    compiled = trainer(True)
    logprobs, grads = logprobs_and_grads(compiled, datums)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for ours, theirs in zip(logprobs, eager_logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, **tolerance)
    for name in grads:
        scale = float(eager_grads[name].float().norm())
        assert float((grads[name].float() - eager_grads[name].float()).norm()) <= (1e-3 if dtype == torch.float32 else 3e-2) * scale, name
    gen = torch.Generator().manual_seed(3)
    recompiles = []
    for lengths in ([9, 14, 30], [5, 21, 8], [17, 6, 40]):
        with scope() as step:
            compiled.forward_backward_custom([datum(torch.randint(2, 290, (n,), generator=gen).tolist(), 2) for n in lengths], sum_loss)
        recompiles.append(step.as_dict()["perf/recompiles"])
    assert recompiles[1:] == [0, 0], recompiles
