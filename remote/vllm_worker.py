"""The weight payloads of ``--weight-sync vllm`` (``method=delta``), and the vLLM worker extension
that applies them inside the server.

This one file is both sides of the format: the trainer encodes with it, the server's workers
decode with it. It imports nothing but the standard library and torch, so that it runs in the
server's own environment as a single file, without grpo-core or its dependencies installed there:
copy it onto the server's ``PYTHONPATH`` under a name of its own (``grpo_core_vllm_worker.py``,
which shadows no module of the server's) and start the server with
``--worker-extension-cls grpo_core_vllm_worker.WeightSyncExtension``. Both sides then read one
format version, checked in every payload's header.

``method=broadcast`` sends no file: the trainer (rank 0) and the server's workers (ranks 1...) form
a process group of their own over a TCP store the trainer holds (apart from any default group
either side has: vLLM's own, fsdp's), gloo through host memory or nccl GPU to GPU, and the weights
stream through it in buckets bounded in bytes, each loaded as it arrives.

A payload is one file: 8 bytes (little-endian header length), a JSON header, then each tensor's
bytes. A full payload holds every tensor's raw bytes; a delta holds, for each tensor that changed,
its bytes XOR the previous version's, byte-shuffled (all first bytes of the elements, then all
second bytes...: an update leaves the sign and exponent bytes mostly unchanged, which then compress
to almost nothing) and zlib-compressed. The header carries the checksum of the tensors the delta
applies to and of the tensors it gives: a server that holds other weights (restarted, a lost
payload) or reconstructs other bytes (a corrupted file) refuses it and loads nothing.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

FORMAT = 1
COMPRESSION_LEVEL = 1
"""zlib's fastest level: the XOR of two versions is mostly zero bytes, which any level compresses."""
HEADER_SIZE = struct.Struct("<Q")
DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class PayloadMismatch(ValueError):
    """A delta that does not apply to the weights held, or whose result is not the trainer's."""


def as_bytes(tensor: torch.Tensor, device: Any = "cpu") -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on ``device`` (whatever its dtype; no copy when it is there)."""
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def checksum(tensors: Mapping[str, torch.Tensor], layout: Mapping[str, tuple[str, list[int]]]) -> str:
    """SHA-256 of every tensor's bytes (flat uint8, see :func:`as_bytes`) with its name, dtype and shape, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(json.dumps([name, *layout[name]]).encode())
        digest.update(tensors[name].numpy().data)
    return digest.hexdigest()


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    return {name: (str(t.dtype), list(t.shape)) for name, t in tensors.items()}


def _shuffle(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    return raw.view(-1, itemsize).t().contiguous().reshape(-1) if itemsize > 1 else raw


def _unshuffle(shuffled: torch.Tensor, itemsize: int) -> torch.Tensor:
    return shuffled.view(itemsize, -1).t().contiguous().reshape(-1) if itemsize > 1 else shuffled


def encode(
    tensors: Mapping[str, torch.Tensor],
    version: int,
    base: Mapping[str, torch.Tensor] | None = None,
    base_checksum: str | None = None,
) -> tuple[bytes, bytes, str]:
    """The payload of ``tensors`` as (header, body), and their checksum.

    ``base`` (the previous version's tensors, whose checksum is ``base_checksum``): a delta
    against it; None: a full payload. A tensor ``base`` lacks, or holds in another dtype or shape,
    goes whole."""
    layout = layout_of(tensors)
    held = {name: as_bytes(t) for name, t in tensors.items()}
    entries, chunks, offset = [], [], 0
    for name in sorted(held):
        raw, itemsize = held[name], tensors[name].element_size()
        entry = {"name": name, "dtype": layout[name][0], "shape": layout[name][1], "offset": offset}
        previous = None if base is None else base.get(name)
        if previous is not None and (str(previous.dtype), list(previous.shape)) == layout[name]:
            changed = torch.bitwise_xor(raw, as_bytes(previous))
            if not bool(changed.any()):
                entries.append({**entry, "mode": "same", "length": 0})
                continue
            data, entry["mode"] = zlib.compress(_shuffle(changed, itemsize).numpy().data, COMPRESSION_LEVEL), "xor"
        else:
            data, entry["mode"] = raw.numpy().tobytes(), "raw"
        entries.append({**entry, "length": len(data)})
        chunks.append(data)
        offset += len(data)
    result = checksum(held, layout)
    header = {
        "format": FORMAT,
        "version": version,
        "base_checksum": base_checksum if base is not None else None,
        "checksum": result,
        "tensors": entries,
    }
    encoded = json.dumps(header).encode()
    return HEADER_SIZE.pack(len(encoded)) + encoded, b"".join(chunks), result


def write(path: str, header: bytes, body: bytes) -> int:
    """Write a payload whole or not at all (a reader never sees half of one); its size in bytes."""
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        f.write(header)
        f.write(body)
    os.replace(partial, path)
    return len(header) + len(body)


def read_header(f: Any) -> dict[str, Any]:
    (length,) = HEADER_SIZE.unpack(f.read(HEADER_SIZE.size))
    header = json.loads(f.read(length))
    if header.get("format") != FORMAT:
        raise PayloadMismatch(f"payload format {header.get('format')}, this reader reads {FORMAT}: update the server's copy of this file")
    return header


def apply(
    path: str, held: Mapping[str, torch.Tensor] | None, held_checksum: str | None
) -> tuple[dict[str, torch.Tensor], str, dict[str, Any]]:
    """The tensors (flat bytes) the payload at ``path`` gives from ``held``, their checksum and the
    payload's header; :class:`PayloadMismatch` when the payload is a delta of other weights than
    ``held`` or its result is not the checksum it names."""
    with open(path, "rb") as f:
        header = read_header(f)
        body = f.read()
    if header["base_checksum"] is not None and (held is None or header["base_checksum"] != held_checksum):
        raise PayloadMismatch(
            f"the delta to version {header['version']} applies to weights of checksum {header['base_checksum'][:12]}, "
            f"this server holds {'none it was sent' if held is None else (held_checksum or '')[:12]}"
        )
    result, layout = {}, {}
    for entry in header["tensors"]:
        name, dtype = entry["name"], DTYPES[entry["dtype"]]
        layout[name] = (entry["dtype"], entry["shape"])
        data = body[entry["offset"] : entry["offset"] + entry["length"]]
        if entry["mode"] == "raw":
            result[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            continue
        previous = None if held is None else held.get(name)
        if previous is None:
            raise PayloadMismatch(f"the delta to version {header['version']} changes {name}, which this server does not hold")
        if entry["mode"] == "same":
            result[name] = previous
            continue
        itemsize = torch.empty(0, dtype=dtype).element_size()
        try:
            changed = _unshuffle(torch.frombuffer(bytearray(zlib.decompress(data)), dtype=torch.uint8), itemsize)
        except (zlib.error, RuntimeError) as exc:
            raise PayloadMismatch(f"the delta of {name} to version {header['version']} does not decompress: {exc}") from None
        if changed.numel() != previous.numel():
            raise PayloadMismatch(
                f"the delta of {name} to version {header['version']} has {changed.numel()} bytes, the weight {previous.numel()}"
            )
        result[name] = torch.bitwise_xor(previous, changed)
    found = checksum(result, layout)
    if found != header["checksum"]:
        raise PayloadMismatch(
            f"the weights of version {header['version']} rebuilt from its payload have checksum {found[:12]}, "
            f"the trainer's have {header['checksum'][:12]}"
        )
    return result, found, header


def typed(tensors: Mapping[str, torch.Tensor], header: dict[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors (flat bytes) of a payload in the dtypes and shapes its header names, as a
    model's ``load_weights`` takes them."""
    for entry in header["tensors"]:
        yield entry["name"], tensors[entry["name"]].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def bucket_plan(layout: Mapping[str, tuple[str, list[int]]], sizes: Mapping[str, int], bucket_bytes: int) -> list[list[list[Any]]]:
    """The tensors in buckets of at most ``bucket_bytes`` each (a larger tensor goes alone): per
    bucket, [name, dtype, shape] of each tensor, in order."""
    buckets: list[list[list[Any]]] = [[]]
    filled = 0
    for name in layout:
        if buckets[-1] and filled + sizes[name] > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append([name, *layout[name]])
        filled += sizes[name]
    return [b for b in buckets if b]


GROUP_BACKENDS = ("gloo", "nccl")
"""gloo: through host memory, any device; nccl: GPU to GPU, every rank on a CUDA device of its own."""


def open_group(store: Any, group: str, rank: int, world_size: int, timeout: float, backend: str = "gloo") -> Any:
    """A process group of its own on ``store`` (under the prefix ``group``): no default group needed.
    An nccl group binds this process's current CUDA device."""
    import torch.distributed as dist

    prefixed, deadline = dist.PrefixStore(group, store), datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, deadline)
    if backend != "nccl":
        raise ValueError(f"group backend {backend!r}: use one of {', '.join(GROUP_BACKENDS)}")
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError("an nccl group needs a CUDA device and a torch built with NCCL, which this process lacks: use gloo")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = deadline
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def broadcast(group: Any, buffer: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def received(group: Any, plan: list[list[list[Any]]], device: Any = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``plan`` as their buckets arrive from rank 0, on ``device`` (where the group's
    backend receives: the host for gloo, this process's GPU for nccl)."""
    for bucket in plan:
        sizes = [torch.empty(0, dtype=DTYPES[dtype]).element_size() * _numel(shape) for _, dtype, shape in bucket]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        broadcast(group, buffer)
        offset = 0
        for (name, dtype, shape), size in zip(bucket, sizes):
            yield name, buffer[offset : offset + size].view(DTYPES[dtype]).reshape(shape)
            offset += size


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WeightSyncExtension:
    """Mixed into each vLLM worker (``--worker-extension-cls``); called through ``POST /collective_rpc``.

    The worker keeps the last weights it loaded as bytes (a copy of the model in host memory):
    what the next delta applies to."""

    def grpo_core_load_payload(self, path: str) -> dict[str, Any]:
        """Apply the payload at ``path`` and load the weights it gives (vLLM's in-place reload).

        Answers ``{"ok": true, "checksum", "version"}``, or ``{"ok": false, "error"}`` with nothing
        loaded: an exception would reach the client as HTTP 500, which it retries."""
        held = getattr(self, "_grpo_core_held", None)
        try:
            tensors, found, header = apply(path, held, getattr(self, "_grpo_core_checksum", None))
        except (PayloadMismatch, OSError) as exc:
            return {"ok": False, "error": str(exc)}
        self.reload_weights(weights_iterator=typed(tensors, header), is_checkpoint_format=True)
        self._grpo_core_held, self._grpo_core_checksum = tensors, found
        return {"ok": True, "checksum": found, "version": header["version"]}

    def grpo_core_group(self) -> dict[str, Any]:
        """This worker's place in a broadcast group: the group it joined (None: none), its rank
        there, the group's size (the trainer and every worker of the server) and the device its
        model is on (an nccl group needs every worker on a GPU)."""
        return {
            "group": getattr(self, "_grpo_core_group_name", None),
            "rank": 1 + self.rank,
            "world_size": 1 + self.vllm_config.parallel_config.world_size,
            "device": str(getattr(self, "device", "cpu")),
        }

    def grpo_core_join_group(self, host: str, port: str, group: str, timeout: str, backend: str = "gloo") -> dict[str, Any]:
        """Join the trainer's broadcast group ``group`` (``backend``: :data:`GROUP_BACKENDS`) through
        its TCP store at ``host:port`` (a group joined before is left: a new one replaces it after a failure)."""
        import torch.distributed as dist

        place = self.grpo_core_group()
        try:
            if backend == "nccl":
                torch.cuda.set_device(torch.device(place["device"]))  # the GPU the group binds: this worker's
            store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=float(timeout)))
            self._grpo_core_process_group = open_group(store, group, place["rank"], place["world_size"], float(timeout), backend)
        except (RuntimeError, OSError, ValueError) as exc:
            self._grpo_core_group_name = None
            return {"ok": False, "error": f"could not join the trainer's {backend} group at {host}:{port}: {exc}"}
        self._grpo_core_group_name = group
        self._grpo_core_group_device = place["device"] if backend == "nccl" else "cpu"
        return {"ok": True, **place, "group": group}

    def grpo_core_receive(self, group: str, plan: str) -> dict[str, Any]:
        """Receive the weights ``plan`` (JSON: buckets of [name, dtype, shape]) lists, bucket by
        bucket from the trainer, and load each as it arrives."""
        if getattr(self, "_grpo_core_group_name", None) != group:
            return {"ok": False, "error": f"this worker is not in the group {group}"}
        try:
            streamed = received(self._grpo_core_process_group, json.loads(plan), self._grpo_core_group_device)
            self.reload_weights(weights_iterator=streamed, is_checkpoint_format=True)
        except RuntimeError as exc:  # the trainer went away mid-stream: the group is gone
            self._grpo_core_group_name = None
            return {"ok": False, "error": f"the broadcast failed: {exc}"}
        # What a delta would apply to is no longer what this worker serves.
        self._grpo_core_held = self._grpo_core_checksum = None
        return {"ok": True}
