"""A reward service for `--reward http` in 20 lines (stdlib only): 1.0 when the completion holds
the reference answer's last word, else 0.0; null for a row without an answer.

    python examples/reward_server.py 8100 &
    grpo-core run --reward http --reward-opt url=http://127.0.0.1:8100/score
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def score(sample: dict) -> float | None:
    if not sample["answer"]:
        return None
    return 1.0 if sample["answer"].split()[-1] in sample["completion"] else 0.0


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps({"scores": [score(s) for s in body["samples"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 8100), Handler).serve_forever()
