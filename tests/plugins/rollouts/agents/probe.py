"""An agent that makes one chat call with a tool and temperature 0.5, waits a little, and appends
what it saw to the file PROBE names: when it ran, its model name, the answer's status and body."""

import json
import os
import time

import httpx

started = time.time()
tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}}}]
response = httpx.post(
    f"{os.environ['OPENAI_BASE_URL']}/chat/completions",
    json={"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": "2 plus 3?"}], "tools": tools, "temperature": 0.5},
    headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
    timeout=600,
)
time.sleep(0.3)
seen = {
    "started": started,
    "ended": time.time(),
    "model": os.environ["OPENAI_MODEL"],
    "status": response.status_code,
    "body": response.json(),
}
with open(os.environ["PROBE"], "a") as probe:
    probe.write(json.dumps(seen) + "\n")
