"""An agent that makes one call, then crashes."""

import os

import httpx

headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
httpx.post(f"{os.environ['OPENAI_BASE_URL']}/completions", json={"prompt": "Question: 1\nAnswer:"}, headers=headers, timeout=600)
raise SystemExit("the agent broke down")
