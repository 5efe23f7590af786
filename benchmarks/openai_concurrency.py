"""Throughput of the ``openai`` sampler's fixed and adapted (``concurrency=auto``) windows on a
fake server that saturates at 8 requests in flight (docs/scaling-out.md, "The concurrency window").

```bash
python benchmarks/openai_concurrency.py    # about 2 minutes
```

Two servers: one that thrashes past 8 in flight (a request's time x (k/8)^2) and one that only
queues (x k/8); 50 ms a request otherwise. Each window samples 3 steps of 96 one-prompt requests;
reported: requests per second and the window the run ended with.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import build_tiny_model  # noqa: E402
from tests.plugins.samplers.fake_server import FakeVLLM, LocalHTTPServer  # noqa: E402
from tests.plugins.samplers.test_openai_concurrency import SaturatingServer, requests_per_second  # noqa: E402


def main() -> None:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(folder)))
    for name, exponent in (("thrashes", 2), ("queues", 1)):
        server = LocalHTTPServer(SaturatingServer(FakeVLLM(tokenizer), capacity=8, seconds_per_token=0.025, exponent=exponent))
        try:
            for concurrency in (2, 8, 32, 64, "auto"):
                rate, window = requests_per_second(tokenizer, server.url, concurrency, steps=3, requests_per_step=96)
                print(f"{name:9} concurrency={concurrency!s:5} {rate:6.1f} requests/s  final window {window:.1f}", flush=True)
        finally:
            server.close()


if __name__ == "__main__":
    main()
