"""Dataset URLs, against a real HTTP server on 127.0.0.1: fetched once into the cache, whole or not at all."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from grpo_core import fetch as fetch_module
from grpo_core.config import RunConfig
from grpo_core.data import DataError, load_dataset
from grpo_core.errors import PluginError
from grpo_core.fetch import cached_path, fetch, file_sha256
from grpo_core.train import run
from tests.core.tiny_runs import config, length_reward, metrics_of  # noqa: F401 - length_reward: the 'length' reward
from tests.helpers import grpo_core_in_process

ROWS = b"".join(json.dumps({"question": f"what is {a} plus 1?", "answer": str(a + 1)}).encode() + b"\n" for a in range(8))


class Server(http.server.ThreadingHTTPServer):
    """Serves ``bodies[path] = (status, content type, body)``; counts the requests of each path."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: dict[str, tuple[int, str, bytes]] = {}
        self.requests: dict[str, int] = {}
        self.slow = 0.0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


class Handler(http.server.BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        self.server.requests[self.path] = self.server.requests.get(self.path, 0) + 1
        status, kind, body = self.server.bodies.get(self.path, (404, "text/plain", b"not found"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for start in range(0, len(body), 64):
            time.sleep(self.server.slow)
            self.wfile.write(body[start : start + 64])

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_CORE_CACHE", str(tmp_path / "cache"))
    httpd = Server()
    httpd.bodies["/rows.jsonl"] = (200, "application/jsonl", ROWS)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def cache_entries(tmp_path):
    root = tmp_path / "cache" / "datasets"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


def test_a_url_is_fetched_into_the_cache_and_read_from_it_after(server, tmp_path):
    url = server.url("/rows.jsonl")
    dataset = load_dataset(RunConfig(dataset=url), refetch=True)
    assert [p.answer for p in dataset.prompts] == [str(a + 1) for a in range(8)]
    assert dataset.name == url and dataset.prompts[0].id == "rows.jsonl:1"
    cached = cached_path(url)
    assert cached.read_bytes() == ROWS and cache_entries(tmp_path) == [cached.parent.name, f"{cached.parent.name}/rows.jsonl"]
    assert [f.record() for f in dataset.fetched] == [{"url": url, "sha256": file_sha256(cached), "cached": str(cached)}]
    assert server.requests == {"/rows.jsonl": 1}
    # Read from the cache: no request, even with the server gone.
    server.bodies.clear()
    assert len(load_dataset(RunConfig(dataset=url)).prompts) == 8 and server.requests == {"/rows.jsonl": 1}
    # Fetched again when asked (a new run): the URL may serve other rows now.
    server.bodies["/rows.jsonl"] = (200, "application/jsonl", ROWS.splitlines(keepends=True)[0])
    assert len(load_dataset(RunConfig(dataset=url), refetch=True).prompts) == 1 and server.requests == {"/rows.jsonl": 2}


def test_a_parquet_url_is_read_as_parquet(server, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "rows.parquet")
    server.bodies["/d/rows.parquet"] = (200, "application/octet-stream", (tmp_path / "rows.parquet").read_bytes())
    dataset = load_dataset(RunConfig(dataset=server.url("/d/rows.parquet")), refetch=True)
    assert [(p.id, p.text) for p in dataset.prompts] == [("rows.parquet[0]", "a"), ("rows.parquet[1]", "b")]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ((404, "text/plain", b"gone"), r"the server answered HTTP 404 Not Found; no dataset was fetched"),
        ((500, "text/plain", b"oops"), r"HTTP 500 Internal Server Error"),
        ((200, "text/html; charset=utf-8", b"<html>login</html>"), r"the server sent a web page \(text/html\)"),
        (
            (200, "text/plain", b"<!doctype html><p>moved</p>\n"),
            r"the body is not JSONL rows \(its first line is '<!doctype html><p>moved</p>'\)",
        ),
        ((200, "text/plain", b"   \n"), r"the body is empty"),
        ((200, "text/plain", b"[1, 2]\n"), r"the body is not JSONL rows"),
    ],
)
def test_a_url_that_serves_no_dataset_is_refused_and_leaves_nothing(server, tmp_path, body, message):
    server.bodies["/rows.jsonl"] = body
    with pytest.raises(DataError, match=message):
        load_dataset(RunConfig(dataset=server.url("/rows.jsonl")), refetch=True)
    assert cache_entries(tmp_path) == []


def test_a_bad_parquet_body_is_refused(server, tmp_path):
    server.bodies["/rows.parquet"] = (200, "application/octet-stream", b'{"question": "x"}\n')
    with pytest.raises(DataError, match=r"the body is not a Parquet file \(it does not start with PAR1\)"):
        fetch(server.url("/rows.parquet"), 10, refetch=True)
    assert cache_entries(tmp_path) == []


def test_a_failed_refetch_keeps_the_cached_copy_whole(server, tmp_path):
    url = server.url("/rows.jsonl")
    fetch(url, 10, refetch=True)
    server.bodies["/rows.jsonl"] = (503, "text/plain", b"busy")
    with pytest.raises(DataError, match="HTTP 503"):
        fetch(url, 10, refetch=True)
    assert cached_path(url).read_bytes() == ROWS and len(cache_entries(tmp_path)) == 2


def test_an_unreachable_host_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_CORE_CACHE", str(tmp_path / "cache"))
    closed = Server()
    url = closed.url("/rows.jsonl")
    closed.server_close()
    with pytest.raises(DataError, match=rf"{url}: cannot fetch it \(ConnectError: "):
        fetch(url, 10, refetch=True)
    assert cache_entries(tmp_path) == []


def test_the_deadline_stops_a_slow_download_and_leaves_nothing(server, tmp_path):
    server.slow = 0.05
    with pytest.raises(DataError, match=r"not fetched within --fetch-timeout 0.3 s"):
        load_dataset(RunConfig(dataset=server.url("/rows.jsonl"), fetch_timeout=0.3), refetch=True)
    assert cache_entries(tmp_path) == []


def test_a_large_download_shows_progress_and_a_small_one_does_not(server, monkeypatch, capfd):
    fetch(server.url("/rows.jsonl"), 10, refetch=True)
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(fetch_module, "PROGRESS_BYTES", 100)
    fetch(server.url("/rows.jsonl"), 10, refetch=True)
    err = capfd.readouterr().err
    assert f"fetching {server.url('/rows.jsonl')}" in err and f"{len(ROWS)} bytes" in err.replace("/", " ")


@pytest.mark.slow
def test_a_run_trains_on_a_url_records_it_and_its_resume_reads_the_cache(server, tiny_model_dir, tmp_path):
    url = server.url("/rows.jsonl")
    run_dir = tmp_path / "run"
    run(config(tiny_model_dir, url, run_dir, max_steps=2, checkpoint_every=1))
    recorded = json.loads((run_dir / "data.json").read_text())
    cached = cached_path(url)
    assert recorded["dataset"] == url and recorded["prompts"] == 8
    assert recorded["fetched"] == [{"url": url, "sha256": file_sha256(cached), "cached": str(cached)}]
    assert server.requests == {"/rows.jsonl": 1}
    server.bodies.clear()  # a resumed run does not fetch again
    run(config(tiny_model_dir, url, run_dir, max_steps=3, checkpoint_every=1), resume=True)
    assert [m["step"] for m in metrics_of(run_dir)] == [1, 2, 3] and server.requests == {"/rows.jsonl": 1}
    # A cached copy that changed is refused on resume, as a changed file is.
    cached.write_bytes(ROWS.replace(b"plus", b"minus"))
    with pytest.raises(PluginError, match=rf"the dataset {url} changed since the run started"):
        run(config(tiny_model_dir, url, run_dir, max_steps=4, checkpoint_every=1), resume=True)


def test_a_404_exits_1_with_one_line_and_no_traceback(server, tiny_model_dir, tmp_path):
    url = server.url("/missing.jsonl")
    result = grpo_core_in_process("run", "--model", str(tiny_model_dir), "--dataset", url, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert f"{url}: the server answered HTTP 404 Not Found" in result.stderr and "Traceback" not in result.stderr
    assert cache_entries(tmp_path) == [] and not (tmp_path / "run" / "data.json").exists()


def test_a_fetch_timeout_without_a_url_is_refused(tiny_model_dir, tiny_dataset, tmp_path):
    with pytest.raises(PluginError, match="--fetch-timeout 5 would do nothing: no dataset of the run is a URL"):
        run(config(tiny_model_dir, tiny_dataset, tmp_path / "run", fetch_timeout=5.0))


def test_without_a_cached_copy_a_url_is_fetched_even_when_not_asked_to(server):
    url = server.url("/rows.jsonl")
    assert len(load_dataset(RunConfig(dataset=url)).prompts) == 8 and server.requests == {"/rows.jsonl": 1}
