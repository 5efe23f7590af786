from __future__ import annotations

import json
import subprocess
import sys
import zlib
from types import SimpleNamespace

import pytest
import torch

from grpo_core.remote import vllm_worker
from grpo_core.remote.vllm_worker import PayloadMismatch, WeightSyncExtension, apply, encode, typed, write


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(8, 4, generator=generator),
        "layer.bias": torch.randn(8, generator=generator),
        "embed.weight": torch.randn(16, 4, generator=generator).to(torch.bfloat16),
        "norm.weight": torch.ones(4),
    }


def stepped(tensors: dict[str, torch.Tensor], seed: int, keep: tuple[str, ...] = ("norm.weight",)) -> dict[str, torch.Tensor]:
    """Every tensor but ``keep`` moved a little (an optimizer step)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t if name in keep else (t.float() + 1e-3 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in tensors.items()
    }


def written(tmp_path, name, tensors, version, base=None, base_checksum=None):
    header, body, result = encode(tensors, version, base, base_checksum)
    path = tmp_path / name
    size = write(str(path), header, body)
    assert size == path.stat().st_size
    return str(path), result


def as_typed(flat, path):
    with open(path, "rb") as f:
        header = vllm_worker.read_header(f)
    return dict(typed(flat, header))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape and torch.equal(got[name], want[name]), name


def test_a_full_payload_gives_the_tensors_bit_for_bit_with_their_checksum(tmp_path):
    v1 = weights()
    path, result = written(tmp_path, "full", v1, version=1)
    flat, found, header = apply(path, None, None)
    assert found == result and header["version"] == 1 and header["base_checksum"] is None
    assert {e["mode"] for e in header["tensors"]} == {"raw"}
    assert_same(as_typed(flat, path), v1)


def test_a_delta_applies_to_the_previous_version_and_carries_only_what_changed(tmp_path):
    v1, v2 = weights(), stepped(weights(), seed=1)
    full, c1 = written(tmp_path, "full", v1, version=1)
    held, found, _ = apply(full, None, None)
    delta, c2 = written(tmp_path, "delta", v2, version=2, base=v1, base_checksum=c1)
    flat, found, header = apply(delta, held, c1)
    assert found == c2 != c1
    assert_same(as_typed(flat, delta), v2)
    modes = {e["name"]: e["mode"] for e in header["tensors"]}
    assert modes == {"layer.weight": "xor", "layer.bias": "xor", "embed.weight": "xor", "norm.weight": "same"}
    assert next(e for e in header["tensors"] if e["name"] == "norm.weight")["length"] == 0
    # The next delta chains on what this one gave.
    v3 = stepped(v2, seed=2)
    delta3, c3 = written(tmp_path, "delta3", v3, version=3, base=v2, base_checksum=c2)
    flat3, found3, _ = apply(delta3, flat, found)
    assert found3 == c3
    assert_same(as_typed(flat3, delta3), v3)


def test_a_small_change_compresses_far_below_the_full_payload(tmp_path):
    big = {"w": torch.randn(256, 256)}
    moved = {"w": big["w"].clone()}
    moved["w"][:4] += 1.0  # a few rows change, as a sparse update or a bf16 step leaves most values as they were
    full, c1 = written(tmp_path, "full", big, version=1)
    delta, _ = written(tmp_path, "delta", moved, version=2, base=big, base_checksum=c1)
    assert (tmp_path / "delta").stat().st_size < (tmp_path / "full").stat().st_size / 20


def test_a_tensor_new_or_reshaped_since_the_base_goes_whole(tmp_path):
    v1 = weights()
    v2 = {**stepped(v1, seed=1), "extra.weight": torch.arange(6.0), "layer.bias": torch.zeros(9)}
    full, c1 = written(tmp_path, "full", v1, version=1)
    held, _, _ = apply(full, None, None)
    delta, c2 = written(tmp_path, "delta", v2, version=2, base=v1, base_checksum=c1)
    flat, found, header = apply(delta, held, c1)
    assert found == c2
    assert {e["name"]: e["mode"] for e in header["tensors"]}["extra.weight"] == "raw"
    assert {e["name"]: e["mode"] for e in header["tensors"]}["layer.bias"] == "raw"
    assert_same(as_typed(flat, delta), v2)


def test_a_delta_of_other_weights_than_those_held_is_refused(tmp_path):
    v1, v2 = weights(), stepped(weights(), seed=1)
    full, c1 = written(tmp_path, "full", v1, version=1)
    held, _, _ = apply(full, None, None)
    delta, _ = written(tmp_path, "delta", v2, version=2, base=v1, base_checksum=c1)
    with pytest.raises(PayloadMismatch, match="delta to version 2 applies to weights of checksum .*this server holds none it was sent"):
        apply(delta, None, None)  # a restarted server
    other_full, other = written(tmp_path, "other", weights(seed=5), version=1)
    other_held, _, _ = apply(other_full, None, None)
    with pytest.raises(PayloadMismatch, match=f"this server holds {other[:12]}"):
        apply(delta, other_held, other)


def corrupt_first_change(path) -> None:
    with open(path, "rb") as f:
        header = vllm_worker.read_header(f)
        body = bytearray(f.read())
    entry = next(e for e in header["tensors"] if e["mode"] == "xor")
    changed = bytearray(zlib.decompress(bytes(body[entry["offset"] : entry["offset"] + entry["length"]])))
    changed[len(changed) // 2] ^= 0x10
    data = zlib.compress(bytes(changed))
    body[entry["offset"] : entry["offset"] + entry["length"]] = data
    for other in header["tensors"]:
        if other["offset"] > entry["offset"]:
            other["offset"] += len(data) - entry["length"]
    entry["length"] = len(data)
    encoded = json.dumps(header).encode()
    write(str(path), vllm_worker.HEADER_SIZE.pack(len(encoded)) + encoded, bytes(body))


def test_a_corrupted_delta_fails_its_checksum_and_gives_nothing(tmp_path):
    v1, v2 = weights(), stepped(weights(), seed=1)
    full, c1 = written(tmp_path, "full", v1, version=1)
    held, _, _ = apply(full, None, None)
    delta, _ = written(tmp_path, "delta", v2, version=2, base=v1, base_checksum=c1)
    corrupt_first_change(delta)
    with pytest.raises(PayloadMismatch, match="rebuilt from its payload have checksum [0-9a-f]{12}, the trainer's have"):
        apply(delta, held, c1)
    # Bytes that do not even decompress: said as such.
    with open(delta, "rb") as f:
        header = vllm_worker.read_header(f)
    entry = next(e for e in header["tensors"] if e["mode"] == "xor")
    raw = bytearray((tmp_path / "delta").read_bytes())
    start = len(raw) - sum(e["length"] for e in header["tensors"]) + entry["offset"]
    raw[start : start + 4] = b"\x00\x00\x00\x00"
    (tmp_path / "delta").write_bytes(bytes(raw))
    with pytest.raises(PayloadMismatch, match="does not decompress"):
        apply(delta, held, c1)


def test_the_checksum_covers_names_dtypes_and_shapes_not_only_bytes():
    t = {"a": torch.arange(4.0)}
    layout = vllm_worker.layout_of(t)
    flat = {"a": vllm_worker.as_bytes(t["a"])}
    base = vllm_worker.checksum(flat, layout)
    assert vllm_worker.checksum({"b": flat["a"]}, {"b": layout["a"]}) != base
    assert vllm_worker.checksum(flat, {"a": ("torch.float32", [2, 2])}) != base
    assert vllm_worker.checksum(flat, {"a": ("torch.int32", [4])}) != base
    assert vllm_worker.checksum(flat, layout) == base


def test_a_payload_of_another_format_is_refused(tmp_path):
    path, _ = written(tmp_path, "full", weights(), version=1)
    raw = (tmp_path / "full").read_bytes()
    (length,) = vllm_worker.HEADER_SIZE.unpack(raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["format"] = 99
    encoded = json.dumps(header).encode()
    write(path, vllm_worker.HEADER_SIZE.pack(len(encoded)) + encoded, raw[8 + length :])
    with pytest.raises(PayloadMismatch, match="payload format 99, this reader reads 1: update the server's copy"):
        apply(path, None, None)


class FakeWorker(WeightSyncExtension):
    """What the extension uses of a vLLM worker: its in-place reload from a weights iterator."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.loaded.append({name: t.clone() for name, t in weights_iterator})


def test_the_worker_extension_loads_payloads_and_refuses_a_bad_one_keeping_what_it_holds(tmp_path):
    worker = FakeWorker()
    v1, v2 = weights(), stepped(weights(), seed=1)
    full, c1 = written(tmp_path, "full", v1, version=1)
    assert worker.grpo_core_load_payload(full) == {"ok": True, "checksum": c1, "version": 1}
    assert_same(worker.loaded[-1], v1)
    delta, c2 = written(tmp_path, "delta", v2, version=2, base=v1, base_checksum=c1)
    corrupt_first_change(delta)
    answer = worker.grpo_core_load_payload(delta)
    assert answer["ok"] is False and "checksum" in answer["error"] and len(worker.loaded) == 1
    delta, c2 = written(tmp_path, "delta", v2, version=2, base=v1, base_checksum=c1)
    assert worker.grpo_core_load_payload(delta) == {"ok": True, "checksum": c2, "version": 2}
    assert_same(worker.loaded[-1], v2)
    missing = worker.grpo_core_load_payload(str(tmp_path / "nowhere"))
    assert missing["ok"] is False and "nowhere" in missing["error"]


def test_the_module_runs_alone_without_grpo_core(tmp_path):
    """The server imports it as a file of its own: nothing but the standard library and torch."""
    (tmp_path / "grpo_core_vllm_worker.py").write_text(open(vllm_worker.__file__).read())
    code = (
        "import sys; sys.modules['grpo_core'] = None\n"  # importing grpo-core would fail
        "import grpo_core_vllm_worker as w, torch\n"
        "h, b, c = w.encode({'x': torch.ones(3)}, 1)\n"
        "print(c == w.checksum({'x': w.as_bytes(torch.ones(3))}, w.layout_of({'x': torch.ones(3)})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_buckets_are_bounded_in_bytes_and_hold_every_tensor_once_in_order():
    layout = {"a": ("torch.float32", [10]), "b": ("torch.float32", [30]), "c": ("torch.float32", [5]), "d": ("torch.float32", [5])}
    sizes = {"a": 40, "b": 120, "c": 20, "d": 20}
    plan = vllm_worker.bucket_plan(layout, sizes, bucket_bytes=60)
    assert [[entry[0] for entry in bucket] for bucket in plan] == [["a"], ["b"], ["c", "d"]]  # b alone: larger than a bucket
    assert plan[2][0] == ["c", "torch.float32", [5]]
    assert vllm_worker.bucket_plan(layout, sizes, bucket_bytes=1000) == [[[n, *layout[n]] for n in layout]]


def test_weights_stream_through_a_group_of_their_own_bucket_by_bucket():
    """Rank 0 (the trainer) and rank 1 (a worker, here a thread) on a gloo group formed on a TCP
    store, with no default process group: every tensor arrives bit for bit, in its dtype and shape."""
    import threading

    import torch.distributed as dist

    tensors = weights()
    layout = vllm_worker.layout_of(tensors)
    plan = vllm_worker.bucket_plan(layout, {n: t.numel() * t.element_size() for n, t in tensors.items()}, bucket_bytes=100)
    assert len(plan) > 1
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    got = {}

    def worker():
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        group = vllm_worker.open_group(client, "g", 1, 2, 30.0)
        got.update({name: t.clone() for name, t in vllm_worker.received(group, plan)})

    thread = threading.Thread(target=worker)
    thread.start()
    group = vllm_worker.open_group(store, "g", 0, 2, 30.0)
    for bucket in plan:
        vllm_worker.broadcast(group, torch.cat([vllm_worker.as_bytes(tensors[n]) for n, _, _ in bucket]))
    thread.join()
    assert not dist.is_initialized()
    assert_same(got, tensors)


def test_an_nccl_group_needs_cuda_and_an_unknown_backend_is_refused(monkeypatch):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a CPU machine says, here on any machine
    with pytest.raises(RuntimeError, match="an nccl group needs a CUDA device and a torch built with NCCL.*use gloo"):
        vllm_worker.open_group(store, "g", 0, 2, 5.0, "nccl")
    with pytest.raises(ValueError, match="group backend 'mpi': use one of gloo, nccl"):
        vllm_worker.open_group(store, "g", 0, 2, 5.0, "mpi")


def test_a_worker_on_a_cpu_answers_that_it_cannot_join_an_nccl_group(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    worker = FakeWorker()
    worker.rank, worker.device = 0, torch.device("cpu")
    worker.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1))
    assert worker.grpo_core_group() == {"group": None, "rank": 1, "world_size": 2, "device": "cpu"}
    answer = worker.grpo_core_join_group("127.0.0.1", "1", "g", "5", backend="nccl")
    assert answer["ok"] is False and answer["error"].startswith("could not join the trainer's nccl group at 127.0.0.1:1: ")
    assert worker.grpo_core_group()["group"] is None
