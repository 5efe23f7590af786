"""The decode paths only CUDA runs (each test skips without a CUDA device: pytest -m cuda on a
GPU): the fused decoder in bf16/fp16 with packed GQA attention, the one-pass sampler on the device
and compiled by inductor, and decode=compiled (inductor, CUDA graphs per batch bucket, kept
sessions) against the eager decode. Their CPU counterparts: test_decoding.py, test_sampling.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from grpo_core import SamplingParams
from grpo_core.config import RunConfig
from grpo_core.engine.decoding import FusedStepper, TransformersStepper, draw
from grpo_core.engine.fast_decoder import FastDecoder, unsupported_reason
from grpo_core.engine.forward import TransformersForward
from grpo_core.engine.sampling import sample
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSamplerPlugin

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
STOP_IDS = list(range(40, 90))
QWEN_VOCAB = 151_936


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def trainer(request, tiny_model_dir):
    return LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir), seed=5, device="cuda", dtype=request.param))


def sampler(trainer, decode, **options):
    return LocalSamplerPlugin(decode=decode, **options).make_sampler(config=RunConfig(seed=5, device="cuda"), trainer=trainer)


def completions(groups):
    return [c for group in groups for c in group]


def trainer_logprobs(trainer, prompt, completion):
    """The trainer's own logprobs of a completion (transformers' forward, fp32 log-softmax)."""
    with torch.no_grad():
        ids = torch.tensor([prompt + completion.tokens], device="cuda")
        logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_decoder_runs_half_precision_on_cuda_and_agrees_with_transformers(tiny_model_dir, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).cuda().eval()
    assert unsupported_reason(model) is None
    assert unsupported_reason(model.cpu()) == "weights that are not float32 (bfloat16 and float16 run on CUDA)"
    model.cuda()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], device="cuda")
    positions = torch.arange(4, device="cuda").expand(2, 4)
    out = {}
    with torch.inference_mode():
        for stepper in (FusedStepper(FastDecoder(model), 8), TransformersStepper(TransformersForward(model), 8)):
            first = stepper.prefill(ids, positions, None)
            valid = torch.zeros(2, 8, dtype=torch.bool, device="cuda")
            valid[:, :5] = True
            step = stepper.step(ids[:, -1:], positions[:, -1:] + 1, valid, torch.tensor([4], device="cuda"))
            out[type(stepper)] = (first, step)
    for fused, plain in zip(out[FusedStepper], out[TransformersStepper]):
        assert (fused - plain).abs().max() < 0.05


def test_packed_gqa_attention_equals_sdpa_with_enable_gqa_on_cuda(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    decoder = FastDecoder(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval())
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, C, D = 64, decoder.num_heads, decoder.num_kv_heads, 384, decoder.head_dim
    assert H != Hkv
    q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, C, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.arange(C, device="cuda") < torch.randint(1, C, (B, 1), device="cuda", generator=g)
    got = decoder._attention(q, k, v, mask[:, None, None, :], False)
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :], scale=decoder.scaling, enable_gqa=True
    )
    assert (got.float() - want).abs().max() < 2e-2


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 50, 0.95), (0.0, 0, 1.0)])
def test_the_one_pass_sampler_on_cuda_draws_what_draw_draws_eager_and_compiled(temperature, top_k, top_p):
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(64, QWEN_VOCAB, device="cuda", generator=g) * 3
    u = torch.rand(64, 1, device="cuda", generator=g)
    logits = logits.bfloat16().float()  # what a bf16 model's logits read as fp32
    want_tokens, want_logprobs = draw(logits, temperature, top_k, top_p, u)
    for fn in (sample, torch.compile(sample, fullgraph=True, dynamic=False)):
        tokens, logprobs = fn(logits, temperature, top_k, top_p, u)
        assert torch.equal(tokens, want_tokens)
        assert (logprobs - want_logprobs).abs().max() < 1e-5


def test_the_one_pass_sampler_on_cuda_lands_on_each_token_as_often_as_its_probability():
    N, V = 4000, 3000
    g = torch.Generator(device="cuda").manual_seed(2)
    logits_V = torch.randn(V, device="cuda", generator=g) * 2
    logits_V[2100:2150] += 6
    z = (logits_V.double() / 0.9).masked_fill(logits_V < torch.topk(logits_V, 200).values[-1], -math.inf)
    want_V = z.softmax(-1)
    u = ((torch.arange(N, device="cuda") + 0.5) / N).unsqueeze(-1)
    tokens, _ = sample(logits_V.expand(N, V), 0.9, 200, 1.0, u)
    counts = torch.bincount(tokens, minlength=V).double()
    assert (counts[want_V == 0] == 0).all()
    assert ((counts - N * want_V).abs() <= 1 + 1e-6).all()


def test_auto_compiles_the_decode_step_on_cuda_and_says_so(trainer):
    s = sampler(trainer, "auto")
    assert s.decode == "compiled"
    assert s.run_info["decode"].startswith("compiled: the fused step") and "CUDA graph per batch bucket" in s.run_info["decode"]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (40, 0.9)])
def test_compiled_graphed_decode_equals_the_eager_decode_and_the_trainer(trainer, top_k, top_p, capsys):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=top_k, top_p=top_p, stop_token_ids=STOP_IDS)
    compiled, eager = sampler(trainer, "compiled", check_every=4), sampler(trainer, "eager", check_every=4)
    got, want = completions(compiled.sample(PROMPTS * 4, 4, params)), completions(eager.sample(PROMPTS * 4, 4, params))
    fp32 = next(trainer.model.parameters()).dtype == torch.float32
    prompts = [p for p in PROMPTS * 4 for _ in range(4)]
    if fp32:
        # The same math: the same tokens, logprobs to fp32 rounding, and the trainer's within 2e-5.
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for c, w in zip(got, want):
            assert c.logprobs == pytest.approx(w.logprobs, abs=2e-5)
    gaps = [(torch.tensor(c.logprobs) - trainer_logprobs(trainer, p, c)).abs().max().item() for p, c in zip(prompts, got) if top_p == 1]
    if gaps:
        print(f"sampler/trainer logprob mismatch, compiled decode, {'fp32' if fp32 else 'bf16'}: max {max(gaps):.2e}")
        assert max(gaps) <= (2e-5 if fp32 else 0.5)  # bf16: reported, bounded loosely
    (session,) = compiled.sessions.values()
    # Buckets, each compiled once and captured per attended width reached.
    assert len(session.compile_seconds) >= 2 and {rows for rows, _ in session.graphs} == set(session.compile_seconds)
    assert "compiled in" in capsys.readouterr().err


def test_a_kept_cuda_session_after_a_weight_update_samples_what_a_fresh_eager_decode_does(trainer):
    params = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=STOP_IDS)
    compiled = sampler(trainer, "compiled", check_every=4)
    compiled.sample(PROMPTS * 2, 4, params)
    saved = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.25)
        other = [[3, 4, 5, 6, 7, 8], [20, 21], [30, 31, 32], [40]]
        fresh = sampler(trainer, "eager", check_every=4)
        fresh.generator.set_state(compiled.generator.get_state())
        got, want = completions(compiled.sample(other, 4, params)), completions(fresh.sample(other, 4, params))
    finally:
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                p.copy_(saved[n])
    if next(trainer.model.parameters()).dtype == torch.float32:
        assert [c.tokens for c in got] == [c.tokens for c in want]
    else:  # bf16: the first token of each row comes from the same prefill logits
        assert [c.tokens[0] for c in got] == [c.tokens[0] for c in want]
    assert len(compiled.sessions) == 1


def test_graphs_decode_with_the_half_precision_fused_decoder_equals_eager(trainer):
    params = SamplingParams(max_tokens=10, temperature=0.9, stop_token_ids=STOP_IDS)
    graphs, eager = sampler(trainer, "graphs"), sampler(trainer, "eager")
    assert graphs.run_info["decode"].startswith("graphs: ") and "fused decoder" in graphs.run_info["decode"]
    assert graphs.graph_problem is None
    got, want = completions(graphs.sample(PROMPTS, 4, params)), completions(eager.sample(PROMPTS, 4, params))
    assert [c.tokens for c in got] == [c.tokens for c in want]


def test_compiled_decode_over_the_live_prefix_equals_it_over_the_whole_capacity(trainer, monkeypatch):
    """Attention over the slots up to the step's own, in blocks of 64 (widths 64 to the capacity
    of 256, all from one compile per bucket): the tokens and logprobs of the steps over the whole
    capacity (fp32: the same tokens, logprobs within 2e-5; bf16: the first token, from the same
    prefill)."""
    from grpo_core.engine import decoding

    params = SamplingParams(max_tokens=200, temperature=0.9, stop_token_ids=STOP_IDS[:4])
    runs = {}
    for block in (10**6, 64):
        monkeypatch.setattr(decoding, "ATTEND_BLOCK", block)
        s = sampler(trainer, "compiled", check_every=8)
        runs[block] = (completions(s.sample(PROMPTS * 4, 4, params)), s)
    (got, compiled), (want, _) = runs[64], runs[10**6]
    if next(trainer.model.parameters()).dtype == torch.float32:
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for c, w in zip(got, want):
            assert c.logprobs == pytest.approx(w.logprobs, abs=2e-5)
    else:
        assert [c.tokens[0] for c in got] == [c.tokens[0] for c in want]
    (session,) = compiled.sessions.values()
    assert {width for _, width in session.graphs} <= {64, 128, 192, 256} and len(session.graphs) > len(session.compile_seconds)
    assert {rows for rows, _ in session.graphs} == set(session.compile_seconds)
    assert compiled.graph_problem is None and compiled.compile_problem is None
