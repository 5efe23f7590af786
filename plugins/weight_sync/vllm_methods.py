"""The four ways ``--weight-sync vllm`` brings a version of the policy to a vLLM server, one
class each, with the state each one keeps between syncs; the plugin (``vllm.py``) chooses one,
then loads and checks every server through it.

Each has ``write(trainer)`` (this version, once, for every server) and ``load(client, version,
again)`` (one server; ``again``: whatever that server holds now, after a restart or a mismatch).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, ClassVar, Protocol

import attrs

from grpo_core import PluginError
from grpo_core.hookspecs import declared
from grpo_core.metrics import record
from grpo_core.remote import vllm_worker
from grpo_core.remote.server_client import ServerClient, ServerResponseError

TIED_OUTPUT_FILE = "lm_head.safetensors"
PAYLOAD_PREFIX = "grpo-core-weights-v"
ADAPTER_PREFIX = "adapter-v"
FULL_EVERY = 10
"""method=delta: versions between two full payloads by default (a chain of deltas the server must all have applied)."""


class SyncMethod(Protocol):
    name: ClassVar[str]
    rewrite_to_repair: ClassVar[bool]
    """A repair writes the version again (a delta repairs with a full payload of what it holds)."""

    def write(self, trainer: Any) -> None: ...

    def load(self, client: ServerClient, version: int, again: bool) -> None: ...

    def served_model(self, base_model: str, version: int) -> str:
        """The model name the server serves ``version`` under."""
        ...


@attrs.define
class Files:
    """The folder versions are written to, and that folder as the server sees it."""

    folder: Path
    server_root: str = ""

    def server_path(self, name: str = "") -> str:
        """``name`` in the folder (the folder itself without one) as the server sees it."""
        root = self.server_root or str(self.folder.resolve())
        return f"{root}/{name}" if name else root


@attrs.define
class FullSync:
    """The whole policy as safetensors, reloaded in place (POST /collective_rpc reload_weights)."""

    files: Files
    name: ClassVar[str] = "full"
    rewrite_to_repair: ClassVar[bool] = True

    def write(self, trainer: Any) -> None:
        self.files.folder.mkdir(parents=True, exist_ok=True)
        record("sync/bytes", write_policy(trainer, self.files.folder), "sum")

    def load(self, client: ServerClient, version: int, again: bool) -> None:
        client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.files.server_path()}}, resync=False)

    def served_model(self, base_model: str, version: int) -> str:
        return base_model


@attrs.define
class AdapterSync:
    """The LoRA adapters alone, loaded as an adapter of a new name per version."""

    files: Files
    tag: str = attrs.field(factory=lambda: uuid.uuid4().hex[:8])
    """Part of every adapter name: two runs on one server load adapters of different names."""
    base_model: str = ""
    loaded: dict[str, str] = attrs.field(factory=dict)
    """The adapter each server was last given, by address."""
    name: ClassVar[str] = "adapter"
    rewrite_to_repair: ClassVar[bool] = True

    def served_model(self, base_model: str, version: int) -> str:
        return f"{base_model}-grpo-{self.tag}-v{version}"

    def write(self, trainer: Any) -> None:
        folder = self.files.folder
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"{ADAPTER_PREFIX}*"):
            shutil.rmtree(old)  # a server reads an adapter when it loads it, never after
        adapter = folder / f"{ADAPTER_PREFIX}{trainer.version}"
        declared(trainer, "trainer object", "save_adapter_for_sampler")(str(adapter))
        record("sync/bytes", sum(f.stat().st_size for f in adapter.iterdir()), "sum")

    def load(self, client: ServerClient, version: int, again: bool) -> None:
        name = self.served_model(self.base_model, version)
        previous = self.loaded.get(client.base_url)
        body: dict[str, Any] = {"lora_name": name, "lora_path": self.files.server_path(f"{ADAPTER_PREFIX}{version}")}
        if again or previous == name:
            body["load_inplace"] = True  # a restarted server has none; a running one replaces its copy
        client.post("/v1/load_lora_adapter", body, resync=False, text=True)
        self.loaded[client.base_url] = name
        if previous is not None and previous != name:
            try:
                client.post("/v1/unload_lora_adapter", {"lora_name": previous}, resync=False, text=True)
            except ServerResponseError as exc:
                if "HTTP 404" not in str(exc):  # a restarted server never had it
                    raise


@attrs.define
class DeltaSync:
    """What changed since the version a server holds, as one payload file the server's worker
    extension applies (a full payload at the first sync, every ``full_every`` versions, and for a
    server that refuses a delta)."""

    files: Files
    full_every: int = FULL_EVERY
    staging_dir: Path | None = None
    """Where a version is written before it is encoded (the run folder)."""
    policy: dict[str, Any] | None = None
    """The written version's tensors: the next delta's base (with their checksum)."""
    policy_checksum: str | None = None
    delta_base: str | None = None
    """The checksum of the weights the written version's delta applies to (None: no delta was written)."""
    full_version: int | None = None
    """The version of the last full payload written."""
    held: dict[str, str] = attrs.field(factory=dict)
    """The checksum of the weights each server holds, by address."""
    name: ClassVar[str] = "delta"
    rewrite_to_repair: ClassVar[bool] = False

    def served_model(self, base_model: str, version: int) -> str:
        return base_model

    def write(self, trainer: Any) -> None:
        """This version's payload: a delta against the written version's weights, or whole when
        none was written or a full one is due."""
        staging = Path(tempfile.mkdtemp(prefix="grpo-core-policy-", dir=self.staging_dir))
        try:
            write_policy(trainer, staging)
            tensors = read_checkpoint(staging)
        finally:
            shutil.rmtree(staging)
        due = self.policy is None or self.full_version is None or trainer.version - self.full_version >= self.full_every
        base, base_checksum = (None, None) if due else (self.policy, self.policy_checksum)
        header, body, result = vllm_worker.encode(tensors, trainer.version, base, base_checksum)
        self.files.folder.mkdir(parents=True, exist_ok=True)
        for old in self.files.folder.glob(f"{PAYLOAD_PREFIX}*"):
            old.unlink()
        name = payload_name(trainer.version, full=due)
        record("sync/bytes", vllm_worker.write(str(self.files.folder / name), header, body), "sum")
        record("sync/full_payloads", int(due), "sum")
        self.policy, self.policy_checksum = tensors, result
        self.delta_base = base_checksum
        if due:
            self.full_version = trainer.version

    def load(self, client: ServerClient, version: int, again: bool) -> None:
        """The written delta where this server holds its base (and nothing says otherwise), else
        or when the server refuses it, the written version's full payload."""
        url = client.base_url
        if not again and self.delta_base is not None and self.held.get(url) == self.delta_base:
            error = self.send_payload(client, payload_name(version, full=False))
            if error is None:
                return
            print(
                f"weight sync: the server at {url} refused the delta to version {version} ({error}); sending it in full",
                file=sys.stderr,
            )
        full = payload_name(version, full=True)
        if not (self.files.folder / full).exists():
            header, body, _ = vllm_worker.encode(self.policy, version)
            record("sync/bytes", vllm_worker.write(str(self.files.folder / full), header, body), "sum")
            record("sync/full_payloads", 1, "sum")
        error = self.send_payload(client, full)
        if error is not None:
            raise PluginError(f"the server at {url} could not load the full weights of version {version}: {error}")

    def send_payload(self, client: ServerClient, name: str) -> str | None:
        """Have every worker of the server apply the payload ``name``: None, or why one refused it."""
        self.held.pop(client.base_url, None)
        answer = client.post(
            "/collective_rpc", {"method": "grpo_core_load_payload", "kwargs": {"path": self.files.server_path(name)}}, resync=False
        )
        results = (answer or {}).get("results") or []
        refused = [r.get("error", str(r)) if isinstance(r, dict) else str(r) for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if not results or refused:
            return refused[0] if refused else f"no answer from its workers ({answer})"
        self.held[client.base_url] = self.policy_checksum
        return None


@attrs.define
class BroadcastSync:
    """The weights streamed from memory into the server's workers through a process group of
    this trainer and them (the worker extension's), in buckets; no file."""

    host: str
    backend: str
    bucket_mb: float
    timeout: float
    policy: dict[str, Any] | None = None
    """The written version's tensors, to stream."""
    groups: dict[str, tuple[str, Any, Any, Any]] = attrs.field(factory=dict)
    """Each server's group (name, process group, the TCP store it was formed on, the device
    buckets are sent from), by address."""
    name: ClassVar[str] = "broadcast"
    rewrite_to_repair: ClassVar[bool] = True

    def served_model(self, base_model: str, version: int) -> str:
        return base_model

    def write(self, trainer: Any) -> None:
        self.policy = policy_in_memory(trainer)

    def load(self, client: ServerClient, version: int, again: bool, retry: bool = True) -> None:
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
            self.load(client, version, again=True, retry=False)
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
        if self.backend == "nccl" and not on_cuda:
            workers = ", ".join(sorted({str(place.get("device", "cpu")) for place in places}))
            raise PluginError(
                f"--weight-sync-opt group_backend=nccl streams GPU to GPU; the trainer's weights are on {trainer_device}, the "
                f"server's workers on {workers}: use group_backend=gloo (or auto)"
            )
        return "nccl" if self.backend == "nccl" or (self.backend == "auto" and on_cuda) else "gloo"

    def join_group(self, client: ServerClient, world_size: int, backend: str) -> tuple[str, Any, Any, Any]:
        """A new group of this trainer (rank 0) and the server's workers: (its name, the process
        group, the TCP store it was formed on, the device its buckets are sent from)."""
        import datetime

        import torch
        import torch.distributed as dist

        self.groups.pop(client.base_url, None)
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=self.timeout))
        name = f"grpo-core-{uuid.uuid4().hex[:12]}"
        kwargs = {"host": self.host, "port": str(store.port), "group": name, "timeout": str(self.timeout)}
        if backend != "gloo":  # a server's copy of the extension from before nccl takes gloo groups without the argument
            kwargs["backend"] = backend
        device = self.policy_device() if backend == "nccl" else torch.device("cpu")
        answer = Background(lambda: collective_rpc(client, "grpo_core_join_group", kwargs))
        try:
            if backend == "nccl":
                torch.cuda.set_device(device)
            group = vllm_worker.open_group(store, name, 0, world_size, self.timeout, backend)
        except RuntimeError as exc:
            answer.join()
            raise PluginError(
                f"the server at {client.base_url} did not join the weight broadcast group on {self.host}:{store.port} "
                f"within {self.timeout:g}s ({exc}; its workers said {answer.value or answer.error}): group_host must be this "
                "machine's address as the server reaches it"
            ) from None
        refused = [r for r in answer.result() if not r.get("ok")]
        if refused:
            raise PluginError(f"the server at {client.base_url} could not join the weight broadcast group: {refused[0].get('error')}")
        self.groups[client.base_url] = (name, group, store, device)
        print(f"weight sync: a {backend} group with the server at {client.base_url} ({world_size - 1} worker(s))", file=sys.stderr)
        return self.groups[client.base_url]


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
