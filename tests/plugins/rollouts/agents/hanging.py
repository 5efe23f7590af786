"""An agent that makes one call and starts a child that sleeps (its pid appended to the file CHILDREN
names). For row p it then sleeps itself, past any deadline; for any other row it prints its reward
and exits, its child still holding its output."""

import json
import os
import subprocess
import sys
import time

import httpx

headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
httpx.post(f"{os.environ['OPENAI_BASE_URL']}/completions", json={"prompt": "Question: 1\nAnswer:"}, headers=headers, timeout=600)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["CHILDREN"], "a") as children:
    children.write(f"{child.pid}\n")
if json.loads(os.environ["GRPO_ROW"])["id"] == "p":
    time.sleep(600)
print(json.dumps({"reward": 1.0}), flush=True)
