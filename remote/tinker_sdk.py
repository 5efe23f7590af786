"""The one place that calls the ``tinker`` SDK's clients, for the SDK versions grpo-core supports.

Open servers that run on a CPU (skyrl 0.3.0) speak the protocol of ``tinker==0.24.1``: from 0.25
on the SDK sends protobuf bodies they cannot parse. The hosted service speaks the current SDK
(0.38). The calls grpo-core makes differ between the two only where this module handles them:
0.38 hands back a future where 0.24.1 handed back a sampling client, deprecates loading a
checkpoint into a training client in favour of creating a new client from it, and downloads
weights differently: 0.24.1 (and skyrl) serve a saved sampler checkpoint as one archive (a PEFT
LoRA adapter); 0.38 serves no sampler checkpoint, but exports the current weights as "external
weights" whose files it signs one URL each.
"""

from __future__ import annotations

import io
import os
import tarfile
import threading
import urllib.request
from collections.abc import Callable, Sequence
from importlib.metadata import version as distribution_version
from pathlib import Path
from typing import Any, TypeVar

import tinker

from grpo_core.errors import PluginError

T = TypeVar("T")
SDK_VERSION = tuple(int(part) for part in distribution_version("tinker").split(".")[:2])
MIN_SDK = (0, 24)


def sdk_version() -> tuple[int, ...]:
    return SDK_VERSION


def check_sdk() -> None:
    if SDK_VERSION < MIN_SDK:
        raise PluginError(f"the tinker backend needs tinker>=0.24.1, found {distribution_version('tinker')}")


def training_client(base_url: str, api_key: str, base_model: str, rank: int, seed: int) -> tuple[tinker.ServiceClient, Any]:
    """A service client and a LoRA training client on it; an empty base_url is the SDK's default
    (TINKER_BASE_URL or the hosted service)."""
    check_sdk()
    kwargs: dict[str, Any] = {"api_key": api_key}
    if base_url:
        kwargs["base_url"] = base_url
    try:
        service = tinker.ServiceClient(**kwargs)
        return service, resolved(service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed))
    except tinker.TinkerError as exc:
        # The SDK's messages name the problem (a key without the tml- prefix), never the key itself.
        raise PluginError(f"cannot open a training client on the Tinker service at {base_url or 'the SDK default'}: {exc}") from None


def call_within(seconds: float, what: str, call: Callable[[], T]) -> T:
    """``call()``, given up after ``seconds``: the SDK's client creation has no deadline of its own
    (at a closed port, or at the hosted service without DNS, it waits on, silently). It runs in a
    daemon thread, which a process that gives up leaves behind."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="grpo-core-tinker-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise PluginError(
            f"{what} did not answer within {seconds:g}s (--trainer-opt connect_deadline); check that the service is running, "
            "that base_url (or TINKER_BASE_URL) is its address, and the network (DNS, proxy) for the hosted one"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def resolved(value: Any) -> Any:
    """The object a call produced: 0.38 returns futures (also of sampling clients), 0.24.1 some objects directly."""
    result = getattr(value, "result", None)
    return result() if callable(result) else value


def sampling_client(service: tinker.ServiceClient, model_path: str | None = None, base_model: str | None = None) -> Any:
    return resolved(service.create_sampling_client(model_path=model_path, base_model=base_model))


def load_state(service: tinker.ServiceClient, training: tinker.TrainingClient, path: str) -> tinker.TrainingClient:
    """The training client holding the weights and optimizer state saved at ``path``."""
    if SDK_VERSION >= (0, 38):
        return resolved(service.create_training_client_from_state_with_optimizer(path))
    resolved(training.load_state_with_optimizer(path))
    return training


EXPORT_TTL_SECONDS = 3600
"""How long a 0.38 export of the weights outlives its download if deleting it fails (the SDK's minimum)."""


def download_weights(service: tinker.ServiceClient, training: tinker.TrainingClient, name: str, sampler_path: str, folder: Path) -> None:
    """The current weights' files in ``folder``, as the service serves them (a LoRA adapter in
    PEFT's layout, or a model): through the archive of the sampler checkpoint ``sampler_path``
    (tinker<0.38), or through a temporary export named ``name`` (0.38)."""
    folder.mkdir(parents=True, exist_ok=True)
    rest = service.create_rest_client()
    if SDK_VERSION >= (0, 38):
        export = resolved(training.save_weights_external(name, ttl_seconds=EXPORT_TTL_SECONDS)).path
        try:
            for file, url in resolved(rest.get_external_weights_urls(export)).urls.items():
                target = (folder / file).resolve()
                if not target.is_relative_to(folder.resolve()):
                    raise PluginError(f"the service's export {export} names a file outside its folder: {file!r}")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(_fetch(url))
        finally:
            resolved(rest.delete_checkpoint_from_tinker_path(export))
        return
    # tinker://RUN/sampler_weights/NAME, or tinker://RUN/NAME as skyrl 0.3.0 names it (which the
    # SDK's own path parser refuses).
    run, *_, checkpoint = sampler_path.removeprefix("tinker://").split("/")
    archive = _fetch(resolved(rest.get_checkpoint_archive_url(run, checkpoint)).url)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:*") as tar:
        tar.extractall(folder, filter="data")


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=600) as response:
        return response.read()


def logprobs_of(output: Any) -> list[list[float]]:
    """The target-token logprobs of each datum of a forward (or forward_backward) output."""
    return [record["logprobs"].tolist() for record in output.loss_fn_outputs]


def sampling_params(
    max_tokens: int, temperature: float, top_p: float, top_k: int, stop: Sequence[str], stop_token_ids: Sequence[int], seed: int
) -> tinker.SamplingParams:
    # One kind of stop per request (the SDK's field takes strings or ids): strings are what a
    # task states, ids are the tokenizer's end-of-sequence markers.
    return tinker.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1,
        stop=list(stop) if stop else (list(stop_token_ids) or None),
        seed=seed,
    )


def api_key_from(option_value: str, variable: str) -> str:
    key = option_value or os.environ.get(variable, "")
    if not key:
        raise PluginError(f"no Tinker API key: set {variable} or give --backend-opt api_key=env:NAME")
    return key
