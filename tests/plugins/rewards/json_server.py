"""A real HTTP server on 127.0.0.1 in a thread of the test process, answering JSON POSTs as a test says."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs


@attrs.define
class Reply:
    body: Any
    """JSON-encoded unless bytes (then sent as is: malformed answers)."""
    status: int = 200
    delay: float = 0.0


@attrs.define
class JsonServer:
    answer: Callable[[str, Any], Reply]
    """(path, the request's JSON; None for a GET) -> the reply."""
    url: str = ""
    requests: list[tuple[str, Any, dict[str, str]]] = attrs.field(factory=list)
    """(path, body, headers) of every request, in arrival order."""
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    release: threading.Event = attrs.field(factory=threading.Event)
    """Set at the end of the test: a delayed reply stops waiting."""


@contextmanager
def json_server(answer: Callable[[str, Any], Reply]) -> Iterator[JsonServer]:
    server = JsonServer(answer)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.do_POST()

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            with server.lock:
                server.requests.append((self.path, body, dict(self.headers)))
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
            try:
                reply = server.answer(self.path, body)
                if reply.delay:
                    server.release.wait(reply.delay)
                data = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
            finally:
                # Done before the reply leaves: a client that got it may send its next request
                # before this thread runs again, and that one must not count as a second in flight.
                with server.lock:
                    server.in_flight -= 1
            try:
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield server
    finally:
        server.release.set()
        httpd.shutdown()
        httpd.server_close()


def elapsed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result (or the exception it raised) and the seconds it took."""
    start = time.perf_counter()
    try:
        result: Any = fn()
    except Exception as exc:
        result = exc
    return result, time.perf_counter() - start
