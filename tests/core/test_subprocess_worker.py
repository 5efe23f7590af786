"""grpo_core.subprocess_worker: a worker process answering requests, replaced after a timeout."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from grpo_core.subprocess_worker import ReplacedWorker, WorkerProcess

# A worker module: "double" doubles n, "sleep" hangs, anything else raises.
WORKER = textwrap.dedent(
    """
    import sys, time
    from grpo_core.subprocess_worker import serve

    def _load():
        def handle(request):
            if request["op"] == "double":
                return {"value": 2 * request["n"]}
            if request["op"] == "sleep":
                time.sleep(60)
            raise ValueError("bad op " + request["op"])
        return handle

    def main(argv):
        if len(argv) > 2:
            time.sleep(float(argv[2]))  # a slow start
        return serve(_load, memory_limit_mb=int(argv[1]), failure={"value": None})

    if __name__ == "__main__":
        sys.exit(main(sys.argv))
    """
)


@pytest.fixture
def module_dir(tmp_path: Path) -> Path:
    (tmp_path / "toy_worker.py").write_text(WORKER)
    return tmp_path


def start(module_dir: Path, *args: str, startup_timeout_s: float = 60.0) -> WorkerProcess:
    return WorkerProcess("toy_worker", args or ("0",), name="toy", startup_timeout_s=startup_timeout_s, pythonpath=str(module_dir))


def test_replies_match_requests_and_a_raising_check_gives_the_failure_reply(module_dir: Path) -> None:
    process = start(module_dir)
    try:
        assert process.request({"op": "double", "n": 21}, timeout_s=30) == {"id": 1, "value": 42}
        assert process.request({"op": "nope"}, timeout_s=30) == {"id": 2, "value": None, "error": "ValueError: bad op nope"}
        assert process.alive()
    finally:
        process.close()
    assert not process.alive()
    assert process.request({"op": "double", "n": 1}, timeout_s=5) is None  # a closed process answers None


def test_a_slow_start_names_the_worker(module_dir: Path) -> None:
    with pytest.raises(RuntimeError, match=r"the toy worker \(.* -m toy_worker\) did not start within 0.5 s"):
        start(module_dir, "0", "30", startup_timeout_s=0.5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_memory_limit_mb_is_set_in_the_child(module_dir: Path) -> None:
    process = start(module_dir, "4096")
    try:
        limits = Path(f"/proc/{process.proc.pid}/limits").read_text()
        assert any(line.startswith("Max address space") and str(4096 * 1024 * 1024) in line for line in limits.splitlines())
    finally:
        process.close()


def test_replaced_worker_starts_on_first_use_and_is_replaced_after_a_timeout(module_dir: Path) -> None:
    worker = ReplacedWorker(lambda: start(module_dir))
    assert worker.process is None
    assert worker.request({"op": "double", "n": 2}, timeout_s=30) == {"id": 1, "value": 4}
    first = worker.process
    assert worker.request({"op": "double", "n": 3}, timeout_s=30) == {"id": 2, "value": 6}
    assert worker.process is first  # reused
    began = time.monotonic()
    assert worker.request({"op": "sleep"}, timeout_s=0.5) is None
    assert time.monotonic() - began < 10
    assert worker.process is None and not first.alive()
    assert worker.request({"op": "double", "n": 5}, timeout_s=30) == {"id": 1, "value": 10}  # a fresh process
    worker.close()
    assert worker.process is None
