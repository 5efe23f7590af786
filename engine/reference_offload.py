"""The frozen KL reference held off the compute path between its forwards (reference offload).

A full fine-tune's reference is a second copy of the initial weights, used once per step for a
forward before the trainer's backward. Held in memory it adds 4 bytes per parameter in float32
(2 in bf16) to the step's peak, beside the weights, gradients and Adam moments; offloaded, its
parameters are empty tensors except during :meth:`OffloadedWeights.loaded`.

Where the weights wait: on a CPU, in safetensors files (the model folder's own when they hold
exactly the initial weights in the run's dtype, else one snapshot written at start into the
temporary directory and unlinked at once, so nothing is left behind even if the process is
killed) mapped copy-on-write for the call and unmapped after it: between calls their pages
belong to the page cache, not to the process. On CUDA, in pinned host memory, copied to the
device for the call (what verl calls the reference's param_offload).
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import torch

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""The floating-point dtypes of the safetensors format, by their name in a file's header."""


@attrs.frozen
class FileEntry:
    """Where one tensor's bytes lie: a file (its index in a list) and a byte range in it."""

    file: int
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def read_safetensors_header(file: BinaryIO, index: int = 0) -> dict[str, FileEntry]:
    """The floating-point tensors of a safetensors file by name (the format: an 8-byte
    little-endian header length, a JSON header of byte ranges relative to its end, the data)."""
    file.seek(0)
    length = int.from_bytes(file.read(8), "little")
    header = json.loads(file.read(length))
    entries = {}
    for name, entry in header.items():
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype", "")) if name != "__metadata__" else None
        if dtype is not None:
            entries[name] = FileEntry(index, 8 + length + entry["data_offsets"][0], dtype, tuple(entry["shape"]))
    return entries


@attrs.define(eq=False)
class MappedFiles:
    """Weights in safetensors files, one entry per parameter: each call maps the files
    (private, copy-on-write: nothing reaches the files) and unmaps them after."""

    files: list[BinaryIO]
    entries: list[FileEntry]

    @contextmanager
    def tensors(self) -> Iterator[list[torch.Tensor]]:
        maps = [mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) for f in self.files]
        tensors: list[torch.Tensor] = []
        try:
            tensors = self._views(maps)
            yield tensors
        finally:
            tensors.clear()
            for m in maps:
                # BufferError here: a tensor over the mapping outlived the call (a leak to fix).
                m.close()

    def _views(self, maps: Sequence[mmap.mmap]) -> list[torch.Tensor]:
        buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        return [buffers[e.file][e.start : e.start + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def close(self) -> None:
        for f in self.files:
            f.close()


@attrs.define(eq=False)
class HostTensors:
    """Weights in host memory (pinned where CUDA can use that), copied to ``device`` for each call."""

    host: list[torch.Tensor]
    device: torch.device

    @contextmanager
    def tensors(self) -> Iterator[list[torch.Tensor]]:
        yield [h.to(self.device, non_blocking=True) for h in self.host]

    def close(self) -> None:
        self.host = []


WeightStore = MappedFiles | HostTensors


@attrs.define(eq=False)
class OffloadedWeights:
    """A frozen model's parameters, empty except within :meth:`loaded`, where they hold the
    store's weights (tied parameters are one parameter: loaded once)."""

    params: list[torch.nn.Parameter]
    store: WeightStore
    where: str
    """One line saying where the weights wait (for the run's first lines)."""

    @contextmanager
    def loaded(self) -> Iterator[None]:
        placeholders = [p.data for p in self.params]
        with self.store.tensors() as tensors:
            try:
                for p, tensor in zip(self.params, tensors):
                    p.data = tensor
                del tensors
                yield
            finally:
                for p, placeholder in zip(self.params, placeholders):
                    p.data = placeholder

    def resident_bytes(self) -> int:
        """What the parameters hold now (0 between calls)."""
        return sum(p.nbytes for p in self.params)

    def close(self) -> None:
        self.store.close()


def offload(frozen: Any, initial: Any, folder: str | Path | None) -> OffloadedWeights:
    """``frozen``'s weights (its parameters are empty placeholders, see ``local.frozen_copy``)
    taken off the compute path; ``initial`` is the model they are copied from, with the same
    parameters in the same order. ``folder`` is where ``initial`` was loaded from: on a CPU its
    safetensors files serve when they hold exactly these weights, else a snapshot is written."""
    params = list(frozen.parameters())
    names = _names_by_parameter(initial)
    sources = [p.detach() for p in initial.parameters()]
    device = sources[0].device
    if device.type != "cpu":
        host = [torch.empty(s.shape, dtype=s.dtype, pin_memory=torch.cuda.is_available()).copy_(s) for s in sources]
        return OffloadedWeights(params, HostTensors(host, device), f"offloaded to host memory, copied to {device} for each forward")
    own = _own_files(folder, names, sources) if folder is not None else None
    if own is not None:
        return OffloadedWeights(params, own, f"offloaded to the model's own weight files ({folder}), mapped for each forward")
    where = "offloaded to a snapshot of the initial weights in the temporary directory, mapped for each forward"
    return OffloadedWeights(params, _snapshot(names, sources), where)


def _names_by_parameter(model: Any) -> list[list[str]]:
    """Every name of each of ``model.parameters()`` (a tied weight has two), in that order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [by_id[id(p)] for p in model.parameters()]


def weight_files(folder: Path) -> list[Path]:
    """A transformers folder's safetensors files: those its index names, else model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _own_files(folder: str | Path, names: Sequence[Sequence[str]], sources: Sequence[torch.Tensor]) -> MappedFiles | None:
    """The folder's own files as the store, when each parameter is in them under one of its
    names with its dtype and shape and with the very values ``sources`` hold (a conversion at
    load, or a dtype cast, makes them differ: then None)."""
    paths = weight_files(Path(folder))
    if not paths:
        return None
    files = [open(path, "rb") for path in paths]  # noqa: SIM115 (kept open: the store maps them)
    stored: dict[str, FileEntry] = {}
    for i, f in enumerate(files):
        stored.update(read_safetensors_header(f, i))
    entries = []
    for param_names, source in zip(names, sources):
        entry = next((stored[n] for n in param_names if n in stored), None)
        if entry is None or entry.dtype != source.dtype or entry.shape != tuple(source.shape) or entry.start % source.dtype.itemsize:
            entries = None
            break
        entries.append(entry)
    store = MappedFiles(files, entries) if entries is not None else None
    if store is not None:
        with store.tensors() as tensors:
            same = all(torch.equal(t, s) for t, s in zip(tensors, sources))
            del tensors
        if same:
            return store
    for f in files:
        f.close()
    return None


def _snapshot(names: Sequence[Sequence[str]], sources: Sequence[torch.Tensor]) -> MappedFiles:
    """One safetensors file of ``sources`` in the temporary directory, open and already unlinked."""
    from safetensors.torch import save_file

    handle, path = tempfile.mkstemp(prefix="grpo-core-reference-", suffix=".safetensors")
    os.close(handle)
    try:
        save_file({n[0]: s.contiguous() for n, s in zip(names, sources)}, path)
        file = open(path, "rb")  # noqa: SIM115 (kept open: the store maps it)
    finally:
        os.unlink(path)
    stored = read_safetensors_header(file)
    return MappedFiles([file], [stored[n[0]] for n in names])
