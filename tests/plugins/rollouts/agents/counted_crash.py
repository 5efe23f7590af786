"""An agent that crashes on every other start (counted in the file COUNTER names), else answers in one call."""

import fcntl
import json
import os

import httpx

with open(os.environ["COUNTER"], "a+") as counter:
    fcntl.flock(counter, fcntl.LOCK_EX)
    counter.seek(0)
    started = len(counter.read())
    counter.write("x")
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
reply = httpx.post(
    f"{os.environ['OPENAI_BASE_URL']}/completions",
    json={"prompt": json.loads(os.environ["GRPO_ROW"])["text"]},
    headers=headers,
    timeout=600,
).json()
if started % 2:
    raise SystemExit("the agent broke down")
print(json.dumps({"reward": float(any(c.isdigit() for c in reply["choices"][0]["text"]))}))
