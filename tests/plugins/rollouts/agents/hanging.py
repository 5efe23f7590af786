"""An agent that makes one call, starts a child that sleeps too (its pid appended to the file CHILDREN names), and never ends."""

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
time.sleep(600)
