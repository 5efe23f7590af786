"""The fused head: per-token logprobs and entropies of a linear output layer without [N, V] logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_core.engine import fused_logprobs
from grpo_core.engine.fused_logprobs import LinearHead, LowRank, chunk_rows, linear_logprobs

N, H, V, R = 37, 16, 300, 4
on_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU")


def tensors(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    made = {
        "hidden": torch.randn(N, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / 4,
        "bias": torch.randn(V, generator=g),
        "down_weight": torch.randn(R, H, generator=g),
        "up": torch.randn(V, R, generator=g) / 4,
    }
    made = {k: v.to(dtype).requires_grad_() for k, v in made.items()}
    return made, torch.randint(V, (N,), generator=g), torch.randn(N, generator=g)


def reference(t, targets, bias, low_rank, softcap):
    """What the output layer and the checkpointed chunks computed: the layer's logits (peft's LoRA
    term, transformers' softcap), .float(), log_softmax, gather; entropy from the log-softmax."""
    logits = F.linear(t["hidden"], t["weight"], t["bias"] if bias else None)
    if low_rank:
        logits = (logits + F.linear(F.linear(t["hidden"], t["down_weight"]), t["up"]) * 0.5).to(logits.dtype)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logprobs_N_V = logits.float().log_softmax(-1)
    return logprobs_N_V.gather(-1, targets[:, None])[:, 0], -(logprobs_N_V.exp() * logprobs_N_V).sum(-1).detach()


def fused(t, targets, bias, low_rank, softcap, rows=None):
    low = LowRank(F.linear(t["hidden"], t["down_weight"]), t["up"], 0.5) if low_rank else None
    head = LinearHead(t["weight"], t["bias"] if bias else None, low, softcap)
    return linear_logprobs(head, t["hidden"], targets, entropy=True, rows=rows)


def scores_and_grads(compute, t, upstream):
    for x in t.values():
        x.grad = None
    logprobs, entropy = compute()
    (logprobs * upstream).sum().backward()
    return {"logprobs": logprobs.detach(), "entropy": entropy} | {k: x.grad for k, x in t.items() if x.grad is not None}


def assert_within(got, want, relative):
    assert got.keys() == want.keys()
    for name in want:
        scale = float(want[name].abs().max())
        error = float((got[name].double() - want[name].double()).abs().max())
        assert error <= relative * scale, f"{name}: {error:.3g} off at a magnitude of {scale:.3g}"


@pytest.mark.parametrize("rows", [1, 5, 1000])
@pytest.mark.parametrize("bias, low_rank, softcap", [(False, False, None), (True, False, None), (False, True, None), (True, True, 5.0)])
def test_fp32_logprobs_entropies_and_gradients_equal_the_full_log_softmax(rows, bias, low_rank, softcap):
    t, targets, upstream = tensors()
    want = scores_and_grads(lambda: reference(t, targets, bias, low_rank, softcap), t, upstream)
    got = scores_and_grads(lambda: fused(t, targets, bias, low_rank, softcap, rows), t, upstream)
    assert got["logprobs"].dtype == got["entropy"].dtype == torch.float32
    assert_within(got, want, 1e-6)


def test_bf16_equals_the_bf16_layer_to_its_rounding_and_sums_the_weight_gradient_more_exactly():
    """The same bf16 logits go through a float32 softmax: logprobs and entropies agree to float32
    rounding. The hidden states' gradient is one bf16 matmul either way (a bf16 unit, 2^-8, apart
    at most where the rounded logit gradients differ); the weight's gradient is summed over chunks
    in float32 here where autograd summed it in bf16, so it is nearer the float64 gradient."""
    t, targets, upstream = tensors(torch.bfloat16)
    wide = {k: v.detach().double().requires_grad_() for k, v in t.items()}
    exact = scores_and_grads(lambda: reference(wide, targets, True, False, None), wide, upstream.double())

    def chunked_reference():
        parts = [reference({k: v[at] if k == "hidden" else v for k, v in t.items()}, targets[at], True, False, None) for at in chunks]
        return torch.cat([lp for lp, _ in parts]), torch.cat([e for _, e in parts])

    chunks = [slice(s, s + 4) for s in range(0, N, 4)]
    today = scores_and_grads(chunked_reference, t, upstream)
    got = scores_and_grads(lambda: fused(t, targets, True, False, None, rows=4), t, upstream)
    assert_within({k: got[k] for k in ("logprobs", "entropy")}, {k: today[k] for k in ("logprobs", "entropy")}, 1e-6)
    assert_within({"hidden": got["hidden"]}, {"hidden": today["hidden"]}, 2**-7)
    for name in ("weight", "bias"):
        assert got[name].dtype == torch.bfloat16
        assert (got[name].double() - exact[name]).norm() <= (today[name].double() - exact[name]).norm(), name


def test_a_tied_weight_gets_both_uses_gradients():
    t, targets, upstream = tensors()
    ids = torch.randint(V, (N,))
    tied = {"weight": t["weight"]}

    def through_the_embedding(compute):
        # The embedding table is the output layer: the hidden states come from it too.
        return compute({"hidden": F.embedding(ids, t["weight"]) * 2, "weight": t["weight"]})

    want = scores_and_grads(lambda: through_the_embedding(lambda u: reference(u, targets, False, False, None)), tied, upstream)
    got = scores_and_grads(lambda: through_the_embedding(lambda u: fused(u, targets, False, False, None, rows=3)), tied, upstream)
    assert_within(got, want, 1e-6)


class LargestOutputs(TorchDispatchMode):
    """The elements of every tensor an op creates (not those it writes in place), by phase."""

    def __init__(self):
        super().__init__()
        self.created: dict[str, list[tuple[str, int]]] = {"forward": [], "backward": []}
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_place = func._schema.name.endswith("_") or "out" in (kwargs or {})
        if isinstance(out, torch.Tensor) and not in_place and not func.is_view:
            self.created[self.phase].append((str(func), out.numel()))
        return out


def test_no_op_creates_an_N_by_V_tensor_and_backward_creates_one_chunk_of_logits_per_chunk():
    t, targets, upstream = tensors()
    rows = 4
    mode = LargestOutputs()
    with mode:
        logprobs, _ = fused(t, targets, False, False, None, rows=rows)
        mode.phase = "backward"
        (logprobs * upstream).sum().backward()
    chunks = -(-N // rows)
    for phase, created in mode.created.items():
        assert max(n for _, n in created) <= max(rows * V, V * H), (phase, max(created, key=lambda c: c[1]))
    # Backward makes one [C, V] tensor per chunk (the recomputed logits, turned into their gradient
    # in place): no saved log-softmax, no log_softmax_backward, no scattered one-hot of its own.
    wide = [f for f, n in mode.created["backward"] if n in (rows * V, (N % rows) * V)]
    assert len(wide) == chunks, wide


def test_no_positions_give_empty_scores_and_zero_gradients():
    t, _, _ = tensors()
    t["hidden"] = t["hidden"][:0].detach().requires_grad_()
    logprobs, entropy = linear_logprobs(LinearHead(t["weight"]), t["hidden"], torch.zeros(0, dtype=torch.long), entropy=True)
    assert logprobs.shape == entropy.shape == (0,)
    logprobs.sum().backward()
    assert t["hidden"].grad.shape == (0, H) and not t["weight"].grad.any()


def test_entropy_is_none_unless_asked_and_never_differentiable():
    t, targets, _ = tensors()
    assert linear_logprobs(LinearHead(t["weight"]), t["hidden"], targets)[1] is None
    _, entropy = linear_logprobs(LinearHead(t["weight"]), t["hidden"], targets, entropy=True)
    assert not entropy.requires_grad


def test_bad_shapes_are_refused_naming_them():
    t, targets, _ = tensors()
    with pytest.raises(ValueError, match=r"\[N, H\] and targets \[N\]; got \(37, 16\) and \(36,\)"):
        linear_logprobs(LinearHead(t["weight"]), t["hidden"], targets[:-1])


def test_chunks_are_sized_by_bytes_cpu_constant_and_cuda_from_free_memory(monkeypatch):
    assert chunk_rows(151_936, torch.device("cpu")) == (1 << 26) // (4 * 151_936) == 110
    assert chunk_rows(10**9, torch.device("cpu")) == 1  # never none
    free = {"bytes": 8 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80 << 30))
    # 8 GiB free: 1 GiB of float32 logits, the cap.
    assert chunk_rows(151_936, torch.device("cuda")) == (1 << 30) // (4 * 151_936) == 1766
    free["bytes"] = 1 << 30  # 1 GiB free: an eighth of it
    assert chunk_rows(151_936, torch.device("cuda")) == (1 << 27) // (4 * 151_936) == 220
    monkeypatch.setattr(fused_logprobs, "CUDA_CHUNK_BYTES_CAP", 1 << 20)
    free["bytes"] = 8 << 30
    assert chunk_rows(1024, torch.device("cuda")) == 256


# --- wired into the local backend ----------------------------------------------------------------


def checkpointed_chunks(forward, hidden_N_E, targets_N, entropy=False):
    """The logprob head before the fused one (commit ba3c771): checkpointed chunks of 64 MiB of logits."""
    from torch.utils.checkpoint import checkpoint

    def chunk(hidden_C_E, targets_C):
        logprobs_C_V = forward.head(hidden_C_E).float().log_softmax(-1)
        detached_C_V = logprobs_C_V.detach()
        return logprobs_C_V.gather(-1, targets_C[:, None])[:, 0], -(detached_C_V.exp() * detached_C_V).sum(-1)

    rows = max(1, (1 << 26) // (4 * forward.model.config.vocab_size))
    parts = [
        checkpoint(chunk, hidden_N_E[s : s + rows], targets_N[s : s + rows], use_reentrant=False) for s in range(0, len(targets_N), rows)
    ]
    return torch.cat([lp for lp, _ in parts]), torch.cat([e for _, e in parts]) if entropy else None


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_trainer_step_on_the_tiny_model_equals_the_checkpointed_chunks(tiny_model_dir, monkeypatch, padding_free):
    """End to end through the local trainer (tied embeddings): every parameter's gradient, the
    logprobs the loss saw and the entropy equal the former head's to float32 rounding."""
    from grpo_core import SamplingParams
    from grpo_core.backend import sample_to_datum
    from grpo_core.engine import logprobs as engine_logprobs
    from tests.plugins.backends.local_parts import make, prompts_of, to_samples

    _, _, trainer, sampler = make(tiny_model_dir, padding_free=padding_free)
    assert trainer.model.lm_head.weight is trainer.model.get_input_embeddings().weight
    prompts = prompts_of(trainer.tokenizer)
    datums = [sample_to_datum(s) for s in to_samples(prompts, sampler.sample(prompts, 2, SamplingParams(max_tokens=6)))]

    def step():
        trainer.model.zero_grad()
        seen = []
        out = trainer.forward_backward_custom(
            datums, lambda d, lps: seen.extend(lp.detach() for lp in lps) or (sum((lp * lp).sum() for lp in lps), {})
        )
        return seen, out.metrics["policy/entropy"], {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    got = step()
    monkeypatch.setattr(engine_logprobs, "token_logprobs", checkpointed_chunks)
    want = step()
    assert_within(dict(enumerate(got[0])), dict(enumerate(want[0])), 1e-6)
    assert got[1] == pytest.approx(want[1], rel=1e-6)
    assert_within(got[2], want[2], 1e-6)


def untied_lora_model(rank=4):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grpo_core.engine.lora import add_lora

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)  # fmt: skip
    model = add_lora(Qwen3ForCausalLM(config), rank, 8.0, ["lm_head"])
    with torch.no_grad():
        model.lm_head.lora_B["default"].weight.normal_()  # B starts at zero: make the adapter count
    return model


def test_lora_on_the_output_layer_gets_the_layers_own_gradients():
    from grpo_core.engine.forward import TransformersForward
    from grpo_core.engine.logprobs import token_logprobs
    from grpo_core.engine.lora import adapters_disabled

    model = untied_lora_model()
    forward = TransformersForward(model)
    adapter = [model.lm_head.lora_A["default"].weight, model.lm_head.lora_B["default"].weight]
    hidden_N_H = torch.randn(N, H, requires_grad=True)
    targets_N, upstream_N = torch.randint(V, (N,)), torch.randn(N)

    def run(compute):
        for x in [hidden_N_H, *adapter]:
            x.grad = None
        logprobs_N, _ = compute()
        (logprobs_N * upstream_N).sum().backward()
        return {"logprobs": logprobs_N.detach(), "hidden": hidden_N_H.grad, "A": adapter[0].grad, "B": adapter[1].grad}

    want = run(lambda: (model.lm_head(hidden_N_H).float().log_softmax(-1).gather(-1, targets_N[:, None])[:, 0], None))
    got = run(lambda: token_logprobs(forward, hidden_N_H, targets_N))
    assert_within(got, want, 1e-6)
    with torch.no_grad(), adapters_disabled(model):
        base = token_logprobs(forward, hidden_N_H, targets_N)[0]
        assert_within(
            {"base": base}, {"base": model.lm_head(hidden_N_H).float().log_softmax(-1).gather(-1, targets_N[:, None])[:, 0]}, 1e-6
        )
    assert not torch.allclose(base, got["logprobs"])  # the adapter counted


def test_an_output_layer_that_is_not_linear_is_refused_by_name():
    from grpo_core.engine.forward import TransformersForward
    from grpo_core.engine.logprobs import token_logprobs
    from grpo_core.errors import PluginError

    model = untied_lora_model()
    forward = TransformersForward(model)
    model.lm_head.lora_dropout["default"] = torch.nn.Dropout(0.1)
    with pytest.raises(PluginError, match="LoRA adapter has dropout or a bias"):
        token_logprobs(forward, torch.randn(2, H), torch.zeros(2, dtype=torch.long))
    model.set_output_embeddings(torch.nn.Bilinear(H, H, V))
    with pytest.raises(PluginError, match="the output layer is a Bilinear, not a linear layer"):
        token_logprobs(forward, torch.randn(2, H), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, on_cuda])])
def test_the_bf16_weight_gradient_is_summed_over_chunks_exactly_in_float32(device):
    """Each chunk's bf16 product goes into the float32 sum unrounded (TRL 1.16: rounding each to bf16
    biases training): the sum equals float64's to float32 rounding, where the bf16-rounded sum is
    a bf16 unit off."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(V, 64, generator=g).to(device, torch.bfloat16) for _ in range(16)]
    inputs = [torch.randn(64, H, generator=g).to(device, torch.bfloat16) for _ in range(16)]
    exact = sum(a.double() @ b.double() for a, b in zip(grads, inputs))
    total = torch.zeros(V, H, device=device)
    rounded = torch.zeros(V, H, device=device)
    for a, b in zip(grads, inputs):
        fused_logprobs._accumulate(total, a, b)
        rounded += a @ b  # the old sum: each product rounded to bf16 first
    scale = float(exact.abs().max())
    assert total.dtype == torch.float32
    assert float((total.double() - exact).abs().max()) <= 1e-6 * scale
    assert float((rounded.double() - exact).abs().max()) > 1e-3 * scale
