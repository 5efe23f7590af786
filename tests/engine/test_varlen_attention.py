"""Packed rows through varlen attention (engine/varlen_attention.py).

torch's ``varlen_attn`` is a CUDA flash kernel: on a CPU these tests put a reference with its
contract (per-sequence causal sdpa over [T, H, D] tokens with cumulative lengths, GQA) in its one
place (``_kernel``). That the reference equals the real kernel cannot be checked on a CPU.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers

from grpo_core.config import RunConfig
from grpo_core.engine import logprobs as engine_logprobs
from grpo_core.engine import models as engine_models
from grpo_core.engine import varlen_attention
from grpo_core.engine.forward import TransformersForward
from grpo_core.engine.logprobs import target_logprobs
from grpo_core.engine.models import load_model, model_path
from grpo_core.engine.varlen_attention import VARLEN, choose_attention, packed_sequence_lengths
from grpo_core.errors import PluginError
from grpo_core.plugins.backends.local import LocalBackend
from tests.engine.ragged_datums import ragged_datums

CUDA = torch.device("cuda")


def reference_varlen_attn(
    query_T_H_D, key_T_K_D, value_T_K_D, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch.nn.attention.varlen.varlen_attn's contract for full and causal windows, by sdpa per sequence."""
    assert query_T_H_D.dim() == key_T_K_D.dim() == value_T_K_D.dim() == 3
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert max_q == max_k == int(cu_seq_q.diff().max()) and int(cu_seq_q[-1]) == len(query_T_H_D)
    if not enable_gqa and query_T_H_D.shape[1] != key_T_K_D.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads")
    if window_size not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"window {window_size}")
    outs = []
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query_T_H_D, key_T_K_D, value_T_K_D))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture(autouse=True)
def probe_passes_for_a_gpu_this_machine_lacks(monkeypatch):
    """What a CUDA run decides, asked on a machine without one: the start-up probe (which runs the
    kernel on the device) is taken to pass; where CUDA is present it runs."""
    real = varlen_attention.gqa_probe
    monkeypatch.setattr(
        varlen_attention,
        "gqa_probe",
        lambda device, dtype: None if device.type == "cuda" and not torch.cuda.is_available() else real(device, dtype),
    )


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []

    def kernel(*args, **kwargs):
        calls.append((args[3].tolist(), kwargs["enable_gqa"]))
        return reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(varlen_attention, "_kernel", lambda: kernel)
    return calls


def leaking_kernel(query_T_H_D, key_T_K_D, value_T_K_D, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
    """A kernel that ignores the sequence lengths: one causal attention over all the tokens."""
    whole = torch.tensor([0, len(query_T_H_D)], dtype=torch.int32)
    return reference_varlen_attn(query_T_H_D, key_T_K_D, value_T_K_D, whole, whole, len(query_T_H_D), len(query_T_H_D), **kwargs)


def gqa_llama_dir(tmp_path):
    """A Llama with 8 query heads sharing 2 key/value heads (4 to 1; the embedded Qwen3 shares 2 to 1)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def load(path, attention, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention).eval()


@pytest.mark.parametrize("model", ["default", "gqa_llama"])
def test_packed_logprobs_and_gradients_through_varlen_equal_the_block_mask_path(model, tmp_path, kernel_calls, monkeypatch):
    path = model_path("default") if model == "default" else gqa_llama_dir(tmp_path)
    block_mask, varlen = (
        TransformersForward(load(path, "sdpa"), padding_free=True),
        TransformersForward(load(path, VARLEN), padding_free=True),
    )
    assert block_mask.packs and varlen.packs
    datums = ragged_datums()
    masks = []
    spy = lambda *a, _f=transformers.masking_utils.sdpa_mask, **k: masks.append(1) or _f(*a, **k)  # noqa: E731
    monkeypatch.setattr(transformers.masking_utils, "sdpa_mask", spy)
    monkeypatch.setitem(transformers.masking_utils.AttentionMaskInterface._global_mapping, "sdpa", spy)
    results = {}
    for name, forward in (("block_mask", block_mask), ("varlen", varlen)):
        masks.clear()
        kernel_calls.clear()
        logprobs, _ = target_logprobs(forward, datums, torch.device("cpu"), packed=True)
        sum(lp.sum() for lp in logprobs).backward()
        grads = {n: p.grad for n, p in forward.model.named_parameters()}
        results[name] = (logprobs, grads, len(masks), list(kernel_calls))
    (want, want_grads, want_masks, _), (got, got_grads, got_masks, calls) = results["block_mask"], results["varlen"]
    assert want_masks == 1 and got_masks == 0  # varlen builds no mask at all
    heads = varlen.model.config.num_attention_heads != varlen.model.config.num_key_value_heads
    layers = varlen.model.config.num_hidden_layers
    assert len(calls) == layers and all(gqa == heads for _, gqa in calls)
    assert len(calls[0][0]) > 2  # several sequences in a packed row
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6 * float(w.detach().abs().max()))
    # Gradients sum over every token of the row: summed per sequence instead of over the masked
    # row, their float32 rounding differs by up to 2e-6 of their norm on the embedded model.
    for n, w in want_grads.items():
        assert float((got_grads[n] - w).norm()) <= 1e-5 * float(w.norm()), n


@pytest.mark.parametrize(
    ("positions", "cu_seq_lens", "longest"),
    [
        ([[0, 1, 2, 3, 4]], [0, 5], 5),
        ([[0, 0, 0]], [0, 1, 2, 3], 1),
        ([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]], [0, 3, 5, 6, 8, 12], 4),
        ([[0, 1, 2], [3, 4, 5]], [0, 3, 6], 3),
        ([[0, 1, 0, 1, 2, 3, 0]], [0, 2, 6, 7], 4),
    ],
    ids=["one_sequence", "length_1_sequences", "two_rows_with_filler", "each_row_its_own", "trailing_length_1"],
)
def test_sequence_lengths_come_from_restarting_positions_and_row_starts(positions, cu_seq_lens, longest):
    got, got_longest = packed_sequence_lengths(torch.tensor(positions))
    assert got.dtype == torch.int32 and got.tolist() == cu_seq_lens and got_longest == longest


def test_padded_rows_and_a_cache_are_sdpas(kernel_calls):
    sdpa, varlen = load(model_path("default"), "sdpa"), load(model_path("default"), VARLEN)
    ids_B_T = torch.tensor([[5, 9, 2, 6], [3, 1, 0, 0]])
    mask_B_T = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    positions_B_T = torch.arange(4).expand(2, 4)
    sdpa_forward, varlen_forward = TransformersForward(sdpa), TransformersForward(varlen)
    kernel_calls.clear()  # the head's check ran one unpadded row through the kernel
    want = sdpa_forward.hidden_states(ids_B_T, positions_B_T, mask_B_T)
    got = varlen_forward.hidden_states(ids_B_T, positions_B_T, mask_B_T)
    assert kernel_calls == [] and torch.equal(got, want)
    assert torch.equal(
        varlen.generate(ids_B_T[:1], max_new_tokens=3, do_sample=False), sdpa.generate(ids_B_T[:1], max_new_tokens=3, do_sample=False)
    )
    assert kernel_calls == []


def test_the_packing_check_runs_varlen_in_the_models_dtype_and_still_sees_a_leak(monkeypatch, kernel_calls):
    lm = load(model_path("default"), VARLEN, dtype=torch.bfloat16)
    dtypes = []
    lm.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    forward = TransformersForward(lm, padding_free=True)
    assert forward.packing_problem is None and set(dtypes) == {torch.bfloat16}
    # The two packed rows, then the sequence alone: 4 layers each.
    assert [cu for cu, _ in kernel_calls[-12:]] == [[0, 3, 7]] * 8 + [[0, 4]] * 4
    assert forward.padding_line() == (
        "sequences that run whole are packed, not padded "
        "(varlen attention isolates them: flash attention over each row's sequence lengths, no [S, S] mask "
        f"(torch {torch.__version__}'s varlen_attn, grouped K/V heads through enable_gqa; forward and backward matched sdpa "
        "in the start-up probe))"
    )
    monkeypatch.setattr(varlen_attention, "_kernel", lambda: leaking_kernel)
    assert TransformersForward(lm, padding_free=True).packing_problem == (
        "varlen attention lets sequences packed in one row see each other in this qwen3 model"
    )


def config_dir(tmp_path, config):
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    ("device", "dtype", "padding_free", "kernel", "chosen", "problem"),
    [
        (CUDA, torch.bfloat16, True, True, VARLEN, None),
        (CUDA, torch.float16, True, True, VARLEN, None),
        (CUDA, torch.float32, True, True, "auto", "flash attention has no float32 kernel (bfloat16/float16 only)"),
        (torch.device("cpu"), torch.bfloat16, True, True, "auto", "varlen_attn is a CUDA kernel and this run is on cpu"),
        (CUDA, torch.bfloat16, False, True, "auto", "sequences are never packed (--backend-opt padding_free=false)"),
        (CUDA, torch.bfloat16, True, False, "auto", f"torch {torch.__version__} has no torch.nn.attention.varlen"),
    ],
    ids=["cuda_bf16", "cuda_fp16", "cuda_fp32", "cpu", "no_packing", "no_kernel"],
)
def test_auto_takes_varlen_where_it_runs_and_varlen_is_refused_where_not(
    tiny_model_dir, monkeypatch, device, dtype, padding_free, kernel, chosen, problem
):
    if not kernel:

        def missing():
            raise ImportError("no varlen")

        monkeypatch.setattr(varlen_attention, "_kernel", missing)
    assert choose_attention("auto", str(tiny_model_dir), device, dtype, padding_free) == chosen
    assert choose_attention("sdpa", str(tiny_model_dir), device, dtype, padding_free) == "sdpa"
    if problem is None:
        assert choose_attention(VARLEN, str(tiny_model_dir), device, dtype, padding_free) == VARLEN
    else:
        with pytest.raises(PluginError) as err:
            choose_attention(VARLEN, str(tiny_model_dir), device, dtype, padding_free)
        assert str(err.value) == f"--backend-opt attn_implementation=varlen: {problem}; use auto (sdpa with a block mask here)"


def test_a_torch_whose_varlen_attn_lacks_the_keywords_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(varlen_attention, "_kernel", lambda: lambda q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False: q)
    with pytest.raises(PluginError) as err:
        choose_attention(VARLEN, str(tiny_model_dir), CUDA, torch.bfloat16, True)
    assert str(err.value) == (
        f"--backend-opt attn_implementation=varlen: torch {torch.__version__}'s varlen_attn lacks window_size, scale; "
        "use auto (sdpa with a block mask here)"
    )


def torch_2_11_varlen_attn(
    query_T_H_D, key_T_K_D, value_T_K_D, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.10/2.11's signature: no enable_gqa; grouped K/V heads go to the flash kernel, which takes them."""
    return reference_varlen_attn(
        query_T_H_D, key_T_K_D, value_T_K_D, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=True
    )


def test_a_varlen_attn_without_enable_gqa_is_used_for_grouped_heads_once_the_probe_passes(tmp_path, monkeypatch):
    calls = []

    @functools.wraps(torch_2_11_varlen_attn)  # its signature
    def kernel(*args, **kwargs):
        calls.append(sorted(kwargs))
        return torch_2_11_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(varlen_attention, "_kernel", lambda: kernel)
    assert varlen_attention.kernel_problem() is None
    assert varlen_attention._gqa_probe.__wrapped__(torch.device("cpu"), torch.float32) is None
    assert calls == [["scale", "window_size"]]  # called without the keyword it lacks
    path = gqa_llama_dir(tmp_path)
    forward = TransformersForward(load(path, VARLEN), padding_free=True)
    calls.clear()
    target_logprobs(forward, ragged_datums(), torch.device("cpu"), packed=True)
    assert calls == [["scale", "window_size"]] * forward.model.config.num_hidden_layers
    line = varlen_attention.packed_attention_line(forward.model)
    assert "grouped K/V heads through the flash kernel's native grouped heads; forward and backward matched sdpa" in line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_start_up_probe_passes_a_kernel_that_computes_grouped_heads_and_names_one_that_does_not(monkeypatch, dtype):
    probe = varlen_attention._gqa_probe.__wrapped__
    cpu = torch.device("cpu")
    monkeypatch.setattr(varlen_attention, "_kernel", lambda: reference_varlen_attn)
    assert probe(cpu, dtype) is None
    refusing = lambda *a, scale=None, window_size=None: reference_varlen_attn(*a, scale=scale, window_size=window_size)  # noqa: E731
    monkeypatch.setattr(varlen_attention, "_kernel", lambda: refusing)
    refused = "varlen_attn failed the start-up probe (grouped heads, forward and backward): "
    assert probe(cpu, dtype) == refused + "Expect query and key/value to have the same number of heads"
    monkeypatch.setattr(varlen_attention, "_kernel", lambda: leaking_kernel)
    assert probe(cpu, dtype).startswith("varlen_attn's output over grouped heads is ")
    # Refused by auto and named by an explicit choice, as any other problem.
    monkeypatch.setattr(varlen_attention, "gqa_probe", probe)
    assert varlen_attention.varlen_problem(cpu, torch.bfloat16, None, None) == "varlen_attn is a CUDA kernel and this run is on cpu"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU")
def test_on_a_gpu_varlen_over_grouped_heads_equals_the_sdpa_block_mask_path(tmp_path):
    """The real kernel: the probe passes, and a GQA model's packed logprobs and gradients in bf16
    equal the sdpa block-mask path's within bf16 rounding (4 query heads per K/V head)."""
    assert varlen_attention.kernel_problem() is None
    assert varlen_attention.gqa_probe(CUDA, torch.bfloat16) is None
    path = gqa_llama_dir(tmp_path)
    results = {}
    for attention in ("sdpa", VARLEN):
        model = load(path, attention, torch.bfloat16).to(CUDA)
        forward = TransformersForward(model, padding_free=True)
        logprobs, _ = target_logprobs(forward, ragged_datums(), CUDA, packed=True)
        sum(lp.sum() for lp in logprobs).backward()
        results[attention] = (torch.cat(logprobs).float(), {n: p.grad.float() for n, p in model.named_parameters()})
    (want, want_grads), (got, got_grads) = results["sdpa"], results[VARLEN]
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())
    for name, w in want_grads.items():
        assert float((got_grads[name] - w).norm()) <= 0.03 * float(w.norm()), name


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (transformers.Gemma2Config(num_hidden_layers=2), "Gemma2ForCausalLM has no flash and sdpa attention"),
        (
            transformers.MistralConfig(num_hidden_layers=2, sliding_window=64),
            "MistralForCausalLM has sliding-window or other non-causal layers",
        ),
        (
            transformers.Qwen3Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1),
            "Qwen3ForCausalLM has sliding-window or other non-causal layers",
        ),
        (
            transformers.LlamaConfig(hidden_size=512, num_attention_heads=1),
            "LlamaForCausalLM's heads are 512 wide, flash attention's at most 256",
        ),
    ],
    ids=["softcapping", "mistral_sliding", "qwen3_sliding_layers", "wide_heads"],
)
def test_an_attention_that_is_not_plain_causal_keeps_sdpa(tmp_path, config, problem):
    path = config_dir(tmp_path, config)
    assert choose_attention("auto", path, CUDA, torch.bfloat16, True) == "auto"
    with pytest.raises(PluginError) as err:
        choose_attention(VARLEN, path, CUDA, torch.bfloat16, True)
    assert str(err.value) == f"--backend-opt attn_implementation=varlen: {problem}; use auto (sdpa with a block mask here)"


def test_a_recorded_eager_attention_stays_and_a_recorded_sdpa_one_takes_varlen(tmp_path):
    path = config_dir(tmp_path, transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2))
    for recorded, chosen in (("eager", "auto"), ("sdpa", VARLEN)):
        saved = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**saved, "attn_implementation": recorded}))
        assert choose_attention("auto", path, CUDA, torch.bfloat16, True) == chosen


def test_varlen_on_a_cpu_is_refused_before_the_model_loads(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("grpo_core.plugins.backends.local.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(PluginError) as err:
        LocalBackend(attn_implementation=VARLEN).make_trainer(config=RunConfig(model=str(tiny_model_dir)))
    assert str(err.value) == (
        "--backend-opt attn_implementation=varlen: varlen_attn is a CUDA kernel and this run is on cpu; "
        "use auto (sdpa with a block mask here)"
    )
    # A backend that loads a model without choosing first (fsdp) gets the same refusal from load_model.
    with pytest.raises(
        PluginError, match="^attn_implementation=varlen: varlen_attn is a CUDA kernel and this run is on cpu; use auto or sdpa$"
    ):
        load_model(str(tiny_model_dir), torch.device("cpu"), VARLEN)


def test_a_cpu_run_names_why_packed_rows_keep_sdpa(tiny_model_dir, capsys):
    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir)))
    line = (
        "sequences that run whole are packed, not padded (sdpa attention isolates them with a block-diagonal mask; "
        "not varlen: varlen_attn is a CUDA kernel and this run is on cpu)"
    )
    assert trainer.run_info["padding"] == line
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"; {line}")


def test_auto_where_varlen_runs_trains_through_it_names_it_and_saves_sdpa(tiny_model_dir, tmp_path, monkeypatch, capsys, kernel_calls):
    # What a CUDA bfloat16 run decides, on this CPU in float32 with the reference kernel.
    for module in (varlen_attention, engine_models):
        monkeypatch.setattr(module, "varlen_problem", lambda *a: None)
    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir)))
    assert trainer.model.config._attn_implementation == VARLEN and trainer.forward_fn.packs
    line = (
        "sequences that run whole are packed, not padded "
        "(varlen attention isolates them: flash attention over each row's sequence lengths, no [S, S] mask "
        f"(torch {torch.__version__}'s varlen_attn, grouped K/V heads through enable_gqa; forward and backward matched sdpa "
        "in the start-up probe))"
    )
    assert trainer.run_info["padding"] == line
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"; {line}")
    paths = []
    monkeypatch.setattr(
        engine_logprobs, "_logprobs_packed", lambda *a, _f=engine_logprobs._logprobs_packed, **k: paths.append(1) or _f(*a, **k)
    )
    kernel_calls.clear()
    trainer.forward_backward_custom(ragged_datums(), lambda d, lps: (sum(lp.sum() for lp in lps), {}))
    assert paths == [1] and len(kernel_calls) == trainer.model.config.num_hidden_layers
    trainer.model.save_pretrained(tmp_path / "policy")
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["attn_implementation"] == "sdpa"


@pytest.mark.slow  # traces the layers (aot_eager)
def test_compiled_layers_take_the_packed_rows_lengths_through_varlen(kernel_calls, monkeypatch):
    """The default GPU path with --backend-opt compile=true: packed rows, varlen attention, compiled layers."""
    import torch._dynamo

    from grpo_core.engine import compile as regional
    from grpo_core.engine.compile import CompiledLayers

    monkeypatch.setattr(regional, "BACKEND", "aot_eager")  # the traced graphs, without inductor's code
    # The real kernel is one opaque op in the graph; the reference's Python loop is left untraced.
    reference = varlen_attention._kernel()
    monkeypatch.setattr(varlen_attention, "_kernel", lambda: torch._dynamo.disable(reference))
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        forward = TransformersForward(load(model_path("default"), VARLEN), padding_free=True)
        layers = CompiledLayers(forward.model)
        kernel_calls.clear()
        with layers.active() if compiled else torch.enable_grad():
            logprobs, _ = target_logprobs(forward, ragged_datums(), torch.device("cpu"), packed=True)
            sum(lp.sum() for lp in logprobs).backward()
        assert len(kernel_calls) == forward.model.config.num_hidden_layers and layers.compiled_calls == (4 if compiled else 0)
        results.append((logprobs, {n: p.grad for n, p in forward.model.named_parameters()}))
    torch._dynamo.reset()
    (want, want_grads), (got, got_grads) = results
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for n, w in want_grads.items():
        assert float((got_grads[n] - w).norm()) <= 1e-5 * float(w.norm()), n
