"""The decode loop against a one-token-at-a-time reference (the sampler as it was: no cache, the
finished rows leaving the batch, one uniform per live row per step), its host synchronisations,
the graph path's selection and fallback (a fake graph on the CPU), and the fused decoder in bf16."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_core import SamplingParams
from grpo_core.config import RunConfig
from grpo_core.engine import compile as compile_module
from grpo_core.engine import decoding
from grpo_core.engine.decoding import (
    FusedStepper,
    TransformersStepper,
    attended_width,
    batch_buckets,
    decode_mode,
    draw,
    round_capacity,
)
from grpo_core.engine.fast_decoder import FastDecoder
from grpo_core.engine.forward import TransformersForward
from grpo_core.errors import PluginError
from grpo_core.metrics import scope
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSampler, LocalSamplerPlugin

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]  # different lengths: the shorter one is left-padded
STOP_IDS = list(range(40, 90))  # about a sixth of the vocabulary: rows end at different steps


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir), seed=5))


def make_sampler(trainer, fast_forward=True, **options):
    sampler = LocalSamplerPlugin(**options).make_sampler(config=RunConfig(seed=5), trainer=trainer)
    if not fast_forward:
        sampler.forward_fn = TransformersForward(sampler.model)
    return sampler


def reference(trainer, prompts, G, params, seed, stop_ids, stop=()):
    """Completions as the sampler drew them one step at a time: each live row's next-token logits
    from a whole forward of its tokens, one uniform per live row per step (rows in order), a row
    leaving the batch at a stop token or when its text passes a stop string."""
    generator = torch.Generator().manual_seed(seed)
    rows = [list(p) for p in prompts for _ in range(G)]
    tokens = [[] for _ in rows]
    logprobs = [[] for _ in rows]
    live = list(range(len(rows)))
    tokenizer = trainer.tokenizer
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = torch.stack([trainer.model(input_ids=torch.tensor([rows[r] + tokens[r]])).logits[0, -1].float() for r in live])
            u = None if params.temperature == 0 else torch.rand(len(live), 1, generator=generator)
            token, logprob = draw(logits, params.temperature, params.top_k, params.top_p, u)
            still = []
            for j, r in enumerate(live):
                tokens[r].append(int(token[j]))
                logprobs[r].append(float(logprob[j]))
                text = tokenizer.decode(tokens[r][-(max((len(s) for s in stop), default=0) + 8) :], skip_special_tokens=False)
                if int(token[j]) not in stop_ids and not any(s in text for s in stop):
                    still.append(r)
            live = still
            if not live:
                break
    return tokens, logprobs, generator.get_state()


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fused", "transformers"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9), (0.0, 0, 1.0)], ids=["plain", "top-k-top-p", "greedy"])
def test_tokens_logprobs_and_the_generator_equal_the_one_step_at_a_time_sampler(trainer, fast_forward, temperature, top_k, top_p):
    params = SamplingParams(max_tokens=7, temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=STOP_IDS)
    sampler = make_sampler(trainer, fast_forward, check_every=3)
    groups = sampler.sample(PROMPTS, 3, params)
    want_tokens, want_logprobs, want_state = reference(trainer, PROMPTS, 3, params, 5, set(sampler._stop_token_ids(params)))
    got = [c for group in groups for c in group]
    assert [c.tokens for c in got] == want_tokens
    # Sampled rows end at different steps: the masking is exercised (greedy ones repeat their prompt's).
    assert len({len(t) for t in want_tokens}) > 1 or temperature == 0
    for c, want in zip(got, want_logprobs):
        assert c.logprobs == pytest.approx(want, abs=1e-5)
        assert c.finish_reason == ("stop" if c.tokens[-1] in STOP_IDS else "length")
    # The generator ends where drawing only the used uniforms leaves it: a resumed run repeats.
    assert torch.equal(sampler.generator.get_state(), want_state)


def test_stop_strings_checked_each_step_equal_the_one_step_at_a_time_sampler(trainer):
    params = SamplingParams(max_tokens=6, stop=["1"])
    sampler = make_sampler(trainer, check_every=1)
    got = [c for group in sampler.sample(PROMPTS, 3, params) for c in group]
    want_tokens, want_logprobs, _ = reference(trainer, PROMPTS, 3, params, 5, set(sampler._stop_token_ids(params)), stop=["1"])
    assert [c.tokens for c in got] == want_tokens
    assert any(c.finish_reason == "stop" for c in got) and any(len(c.tokens) < 6 for c in got)


def test_stop_strings_checked_every_k_steps_cut_where_the_string_is_passed_and_keep_exact_logprobs(trainer):
    # Checked every 4 steps: a row past "1" draws until the check, so later rows' uniforms shift (a
    # fresh one each: the same distribution). Per position the token must be where the text first
    # passes the stop string, and its logprob the exact one of the distribution sampled from.
    params = SamplingParams(max_tokens=9, stop=["1"], temperature=0.9, top_k=20)
    sampler = make_sampler(trainer, check_every=4)
    completions = [c for group in sampler.sample(PROMPTS * 2, 4, params) for c in group]
    assert sum(c.finish_reason == "stop" for c in completions) >= 3
    for prompt, c in zip([p for p in PROMPTS * 2 for _ in range(4)], completions):
        passed = [sampler._hit_stop_string(c.tokens[: t + 1], ["1"]) for t in range(len(c.tokens))]
        assert passed[:-1] == [False] * (len(c.tokens) - 1)
        assert passed[-1] == (c.finish_reason == "stop")
        with torch.no_grad():
            logits_T_V = trainer.model(input_ids=torch.tensor([prompt + c.tokens])).logits[0, len(prompt) - 1 : -1].double()
        z_T_V = logits_T_V / 0.9
        z_T_V = z_T_V.masked_fill(z_T_V < torch.topk(z_T_V, 20).values[:, -1:], -math.inf).log_softmax(-1)
        assert c.logprobs == pytest.approx(z_T_V.gather(-1, torch.tensor(c.tokens)[:, None])[:, 0].tolist(), abs=1e-5)


class SyncCounter(TorchDispatchMode):
    """Counts reads of a tensor's value on the host: the Python calls that copy off a device (on the
    CPU they copy nothing, so the call is what is counted) and the scalar reads beneath them."""

    HOST_READS = ("cpu", "item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        super().__init__()
        self.calls: list[str] = []
        self.scalar_reads = 0
        for name in self.HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        original_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
            if device is not None and torch.device(device).type == "cpu":
                self.calls.append("to(cpu)")
            return original_to(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stop", [[], ["1"]], ids=["stop-tokens", "stop-strings"])
@pytest.mark.parametrize("check_every", [1, 4, 16])
def test_the_decode_loop_reads_the_device_once_per_check_every_steps(trainer, monkeypatch, check_every, stop):
    max_tokens = 24
    sampler = make_sampler(trainer, check_every=check_every)
    counter = None
    run = decoding.DecodeLoop.run

    def counted_run(loop):
        nonlocal counter
        with SyncCounter(monkeypatch) as counter:
            result = run(loop)
        monkeypatch.undo()
        return result

    monkeypatch.setattr(decoding.DecodeLoop, "run", counted_run)
    # No stop token: every row runs all max_tokens steps, so the loop makes every check.
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, stop=stop)
    sampler.sample(PROMPTS, 2, params)
    checks = math.ceil(max_tokens / check_every)
    # One copy per check, one for the completions at the end.
    assert len(counter.calls) <= checks + 1, counter.calls
    assert counter.scalar_reads <= checks + 1


def test_decode_mode_is_compiled_on_cuda_where_it_can_be_eager_on_a_cpu_and_refuses_what_cannot_run(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(compile_module, "compile_problem", lambda device: None)
    assert decode_mode("auto", cpu) == "eager"
    assert decode_mode("eager", cpu) == "eager"
    assert decode_mode("auto", cuda) == "compiled"
    assert decode_mode("auto", cuda, fused="model type 'gpt2'") == "graphs"
    assert decode_mode("graphs", cuda) == "graphs"
    assert decode_mode("eager", cuda) == "eager"
    assert decode_mode("compiled", cpu) == decode_mode("compiled", cuda) == "compiled"
    with pytest.raises(PluginError, match="decode=compiled compiles the fused decoder's step, which does not run model type 'gpt2'"):
        decode_mode("compiled", cuda, fused="model type 'gpt2'")
    with pytest.raises(PluginError, match="decode=graphs captures .* the model is on cpu: use decode=eager"):
        decode_mode("graphs", cpu)
    with pytest.raises(PluginError, match="decode='fast' is not a decode path: choose one of auto, eager, graphs, compiled"):
        decode_mode("fast", cpu)
    monkeypatch.setattr(compile_module, "compile_problem", lambda device: "inductor needs Triton on CUDA and it is not installed")
    assert decode_mode("auto", cuda) == "graphs"
    with pytest.raises(PluginError, match="decode=compiled: inductor needs Triton .*; or decode=eager"):
        decode_mode("compiled", cuda)


def test_batch_buckets_and_capacity_rounding():
    assert batch_buckets(64) == (64, 32, 16, 8)
    assert batch_buckets(48) == (48, 32, 16, 8)
    assert batch_buckets(8) == (8,) and batch_buckets(3) == (3,)
    assert round_capacity(1) == 128 and round_capacity(128) == 128 and round_capacity(129) == 256
    assert decoding.ATTEND_BLOCK == 256
    assert [attended_width(slot, 640) for slot in (0, 254, 255, 256, 511, 512, 639)] == [256, 256, 256, 512, 512, 640, 640]
    assert attended_width(20, 21) == 21


@pytest.fixture
def attend_block(monkeypatch):
    """Attended widths in blocks of 8 slots, so a short decode crosses several."""
    monkeypatch.setattr(decoding, "ATTEND_BLOCK", 8)


def widths_reached(prompt_width, steps, capacity):
    return [min(capacity, -(-(prompt_width + s + 1) // 8) * 8) for s in range(steps)]


def test_attention_over_the_live_prefix_samples_what_attention_over_the_whole_capacity_does(trainer, monkeypatch):
    """The fused decoder's steps attend to their slot rounded up to a block (widths 8, 16, then the
    capacity of 5 + 22): the same tokens, logprobs within 2e-5 of the steps over the whole
    capacity (a block larger than any capacity)."""
    params = SamplingParams(max_tokens=22, temperature=0.9, top_k=40, stop_token_ids=STOP_IDS[:10])
    runs = {}
    for block in (10**6, 8):
        monkeypatch.setattr(decoding, "ATTEND_BLOCK", block)
        sampler = make_sampler(trainer, check_every=4)
        with scope() as metrics:
            runs[block] = flat(sampler.sample(PROMPTS, 3, params))
        runs[block, "width"] = metrics.as_dict()["perf/decode_attended_per_step"]
        runs[block, "steps"] = sampler.decode_steps
    assert [c.tokens for c in runs[8]] == [c.tokens for c in runs[10**6]]
    assert max(len(c.tokens) for c in runs[8]) > 16  # the decode reached a third block
    for got, want in zip(runs[8], runs[10**6]):
        assert got.logprobs == pytest.approx(want.logprobs, abs=2e-5)
    assert runs[10**6, "width"] == 27
    widths = widths_reached(5, runs[8, "steps"], 27)
    assert runs[8, "width"] == pytest.approx(sum(widths) / len(widths))


def test_transformers_static_cache_attends_to_the_whole_capacity(trainer, attend_block):
    with scope() as metrics:
        make_sampler(trainer, fast_forward=False).sample(PROMPTS, 1, SamplingParams(max_tokens=12, temperature=0))
    assert metrics.as_dict()["perf/decode_attended_per_step"] == 5 + 12


def test_a_graph_is_captured_per_rows_and_attended_width_reached(trainer, attend_block):
    params = SamplingParams(max_tokens=22, temperature=0.9, stop_token_ids=STOP_IDS[:10])
    eager = make_sampler(trainer, check_every=4).sample(PROMPTS, 3, params)
    sampler, graphs = graphed(trainer, FakeGraph)
    assert sampler.sample(PROMPTS, 3, params) == eager
    # Widths 8 (3 steps), 16, 24 (8 each) and 27 (3): after two warm-up steps each, a graph, at
    # most one per block of the capacity (27 slots: 4).
    widths = widths_reached(5, sampler.decode_steps, 27)
    assert len(graphs) == len({w for w in widths if widths.count(w) > decoding.GRAPH_WARMUP_STEPS}) <= -(-27 // 8)
    assert sum(g.replays for g in graphs) == len(widths) - decoding.GRAPH_WARMUP_STEPS * len(set(widths))


def test_the_sampler_refuses_graphs_on_the_cpu_and_names_its_decode_path(trainer):
    with pytest.raises(PluginError, match="decode=graphs"):
        make_sampler(trainer, decode="graphs")
    with pytest.raises(PluginError, match="decode=compiled compiles the fused decoder's step, which does not run the model with"):
        LocalSamplerPlugin(decode="compiled").make_sampler(config=RunConfig(seed=5), trainer=attrs.evolve(trainer, fast_forward=False))
    info = make_sampler(trainer).run_info
    assert info["decode"].startswith("eager (fused decoder") and "every 16 steps" in info["decode"]
    with pytest.raises(ValueError, match="check_every"):
        LocalSamplerPlugin(check_every=0)


class FakeGraph:
    """Stands in for a CUDA graph on the CPU: capture records the step without running it (as CUDA
    does), replay runs it."""

    def __init__(self):
        self.step = None
        self.replays = 0

    def capture(self, step):
        self.step = step

    def replay(self):
        self.replays += 1
        self.step()


class FailingGraph(FakeGraph):
    def capture(self, step):
        raise RuntimeError("operation not permitted when stream is capturing")


def graphed(trainer, graph_class):
    sampler = make_sampler(trainer, check_every=4)
    graphs = []

    def factory():
        graphs.append(graph_class())
        return graphs[-1]

    sampler.decode, sampler.graph_factory = "graphs", factory
    return sampler, graphs


def test_a_graphed_decode_repeats_the_eager_one_and_a_failed_capture_falls_back_and_says_why(trainer):
    params = SamplingParams(max_tokens=9, temperature=0.9, stop_token_ids=STOP_IDS)
    eager = make_sampler(trainer, check_every=4).sample(PROMPTS, 3, params)
    sampler, graphs = graphed(trainer, FakeGraph)
    assert sampler.run_info["decode"].startswith("graphs: the decode step replayed as a CUDA graph")
    assert sampler.sample(PROMPTS, 3, params) == eager
    # Two eager warm-up steps, then the capture (not run) and a replay per later step.
    assert graphs[0].replays == 9 - decoding.GRAPH_WARMUP_STEPS
    failing, graphs = graphed(trainer, FailingGraph)
    assert failing.sample(PROMPTS, 3, params) == eager
    assert failing.graph_problem == "the decode step could not be captured (RuntimeError: operation not permitted when stream is capturing)"
    assert failing.run_info["decode"].startswith("eager: the decode step could not be captured")
    failing.sample(PROMPTS, 3, params)
    assert len(graphs) == 1  # not tried again


def test_the_sampler_records_its_decode_speed(trainer):
    with scope() as metrics:
        completions = make_sampler(trainer).sample(PROMPTS, 2, SamplingParams(max_tokens=5))
    values = metrics.as_dict()
    assert values["perf/decode_ms_per_step"] > 0
    # The step's tokens per second are the core's (record_perf), for every sampler alike.
    assert "perf/sample_tokens_per_s" not in values and not any(k.startswith("time/") for k in values)
    assert sum(len(c.tokens) for g in completions for c in g) == 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_and_transformers_steppers_agree_in_float32_and_bfloat16(tiny_model_dir, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    U, P, G, C = 2, 5, 2, 9
    input_ids = torch.tensor([[1, 1, 5, 6, 7], [9, 10, 11, 12, 13]])
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    with torch.inference_mode():
        for stepper in (FusedStepper(FastDecoder(model), C), TransformersStepper(TransformersForward(model), C)):
            out = [stepper.prefill(input_ids, positions, valid)]
            stepper.expand(G)
            valid_B_C = torch.zeros(U * G, C, dtype=torch.bool)
            valid_B_C[:, :P] = valid.bool().repeat_interleave(G, 0)
            position = positions[:, -1:].repeat_interleave(G, 0).clone()
            slot = torch.tensor([P])
            for token in ([3, 4, 5, 6], [7, 8, 9, 10]):
                position += 1
                valid_B_C[:, slot] = True
                out.append(stepper.step(torch.tensor(token)[:, None], position, valid_B_C, slot))
                slot += 1
            logits[type(stepper)] = out
    # transformers' forward without a cache, row by row: what the steppers stand for.
    with torch.no_grad():
        rows = [[5, 6, 7], [9, 10, 11, 12, 13]]
        want = [model(input_ids=torch.tensor([r])).logits[0, -1].float() for r in rows]
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    fused, plain = logits[FusedStepper], logits[TransformersStepper]
    for f, t in zip(fused, plain):
        assert torch.allclose(f, t, atol=tolerance), (f - t).abs().max()
    assert torch.allclose(fused[0], torch.stack(want), atol=tolerance)


@pytest.fixture
def traced(monkeypatch):
    """The compiled step traced by dynamo in full (fullgraph: a graph break fails) and run by the
    eager backend: the compiled path's code, without inductor's code generation."""
    monkeypatch.setattr(decoding, "COMPILE_BACKEND", "eager")


def compiled_sampler(trainer, **options):
    return make_sampler(trainer, decode="compiled", **options)


def flat(groups):
    return [c for group in groups for c in group]


def assert_same_completions(got, want):
    """The same tokens and ends; logprobs equal to fp32 rounding (the one-pass sampler sums in
    another order than draw())."""
    got, want = flat(got), flat(want)
    assert [(c.tokens, c.finish_reason) for c in got] == [(c.tokens, c.finish_reason) for c in want]
    for c, w in zip(got, want):
        assert c.logprobs == pytest.approx(w.logprobs, abs=2e-5)


@pytest.mark.slow  # dynamo traces the whole step once per batch bucket
@pytest.mark.parametrize("stop", [[], ["1"]], ids=["stop-tokens", "stop-strings"])
def test_the_compiled_step_repeats_the_eager_decode_and_compacts_live_rows_into_buckets(trainer, traced, stop, capsys):
    # 32 rows, about a sixth of the vocabulary stops a row: the batch steps on as 16 and 8 rows.
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, stop_token_ids=STOP_IDS, stop=stop)
    eager = make_sampler(trainer, check_every=4)
    compiled = compiled_sampler(trainer, check_every=4)
    assert compiled.run_info["decode"].startswith("compiled: the fused step (forward, one-pass sampler, stop bookkeeping)")
    with scope() as metrics:
        got = compiled.sample(PROMPTS * 4, 4, params)
    assert_same_completions(got, eager.sample(PROMPTS * 4, 4, params))
    assert torch.equal(compiled.generator.get_state(), eager.generator.get_state())
    (session,) = compiled.sessions.values()
    assert sorted(session.compile_seconds) == [8, 16, 32]
    assert metrics.as_dict()["perf/decode_rows_per_step"] < 32
    assert "sampler decode: the step for 32 rows x 128 slots compiled in" in capsys.readouterr().err


@pytest.mark.slow  # dynamo traces the whole step once per batch bucket
def test_a_kept_session_serves_the_next_generation_with_other_prompts_and_updated_weights(trainer, traced):
    """Cache reuse across generations: the second generation, prefilled into the kept cache (other
    prompt widths, the same capacity bucket) after the weights moved in place, samples what a
    fresh eager sampler samples."""
    params = SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=STOP_IDS)
    compiled = compiled_sampler(trainer, check_every=3)
    eager = make_sampler(trainer, check_every=3)
    assert_same_completions(compiled.sample(PROMPTS * 2, 4, params), eager.sample(PROMPTS * 2, 4, params))
    (session,) = compiled.sessions.values()
    original = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        with torch.no_grad():
            for p in trainer.model.parameters():  # an optimizer step: in place
                p.mul_(1.5)
        other_prompts = [[3, 4, 5, 6, 7, 8, 9], [20, 21], [30, 31, 32], [40]]
        got = compiled.sample(other_prompts, 4, params)
        fresh = make_sampler(trainer, check_every=3)
        fresh.generator.set_state(eager.generator.get_state())
        want = fresh.sample(other_prompts, 4, params)
    finally:
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                p.copy_(original[n])
    assert_same_completions(got, want)
    assert list(compiled.sessions.values()) == [session]  # the same cache, buffers and compiled step


@pytest.mark.slow  # dynamo traces the whole step once per batch bucket
def test_sessions_are_kept_per_batch_capacity_and_rules_the_most_recent_first(trainer, traced):
    compiled = compiled_sampler(trainer)
    for max_tokens, G in ((3, 2), (200, 2), (3, 4), (3, 2)):
        compiled.sample(PROMPTS, G, SamplingParams(max_tokens=max_tokens, stop_token_ids=STOP_IDS))
    # (4 rows, 128 slots) came back last; (4 rows, 256 slots) was dropped for it.
    assert [key[:3] for key in compiled.sessions] == [(8, 128, 3), (4, 128, 3)]
    assert len(compiled.sessions) == decoding.KEPT_SESSIONS


@pytest.mark.slow  # dynamo traces the whole step once per batch bucket
def test_compiled_graphs_are_captured_once_per_bucket_and_width_and_replayed_by_later_generations(trainer, monkeypatch, attend_block):
    # As on CUDA: the compiled step captured (here in the fake graph).
    monkeypatch.setattr(LocalSampler, "captures", property(lambda self: self.decode != "eager" and self.graph_problem is None))
    compiles = []

    def counting_backend(graph_module, example_inputs):
        compiles.append(graph_module)
        return graph_module.forward

    monkeypatch.setattr(decoding, "COMPILE_BACKEND", counting_backend)
    sampler, graphs = graphed(trainer, FakeGraph)
    sampler.decode = "compiled"
    params = SamplingParams(max_tokens=20, temperature=0.9, stop_token_ids=STOP_IDS)
    eager = make_sampler(trainer, check_every=4)
    for _ in range(2):
        assert_same_completions(sampler.sample(PROMPTS * 4, 4, params), eager.sample(PROMPTS * 4, 4, params))
    (session,) = sampler.sessions.values()
    # One compile per bucket stepped, whatever the widths (5 prompt + 20 slots: 128, read 8 to 32).
    assert len(compiles) == len(session.compile_seconds) >= 2
    assert {rows for rows, _ in session.graphs} == set(session.compile_seconds)
    assert {width for _, width in session.graphs} >= {16, 24}
    assert all(width in (8, 16, 24, 32) for _, width in session.graphs)
    assert len(graphs) == len(session.graphs)  # the second generation captured nothing
    # Every step either warmed its (rows, width) up or replayed its graph.
    assert sum(g.replays for g in graphs) + sum(session.warm.values()) == sampler.decode_steps
    assert all(session.warm[key] == decoding.GRAPH_WARMUP_STEPS for key in session.graphs)


@pytest.mark.slow  # dynamo traces the step before the backend refuses it
def test_a_compile_that_fails_leaves_the_step_uncompiled_and_says_why(trainer, monkeypatch, capsys):
    def refusing_backend(graph_module, example_inputs):
        raise RuntimeError("no Triton here")

    monkeypatch.setattr(decoding, "COMPILE_BACKEND", refusing_backend)
    params = SamplingParams(max_tokens=8, temperature=0.9, stop_token_ids=STOP_IDS)
    compiled = compiled_sampler(trainer, check_every=4)
    assert_same_completions(compiled.sample(PROMPTS, 4, params), make_sampler(trainer, check_every=4).sample(PROMPTS, 4, params))
    assert compiled.compile_problem.startswith("the decode step could not be compiled (BackendCompilerFailed")
    assert "no Triton here" in compiled.compile_problem
    assert compiled.run_info["decode"].startswith("compiled: the decode step could not be compiled (")
    assert "sampler decode: compiled: the decode step could not be compiled" in capsys.readouterr().err
    compiled.sample(PROMPTS * 2, 4, params)  # another session: not compiled again
    assert all(s.compile_problem == compiled.compile_problem and not s.compile_seconds for s in compiled.sessions.values())
