"""A two-turn agent written with httpx alone: it answers, is asked to check, answers again, and
scores its own last answer (1 when it holds a digit)."""

import json
import os

import httpx

row = json.loads(os.environ["GRPO_ROW"])
client = httpx.Client(
    base_url=os.environ["OPENAI_BASE_URL"], headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}, timeout=600
)
messages = [{"role": "user", "content": row["text"]}]
for _ in range(2):
    response = client.post("/chat/completions", json={"model": os.environ["OPENAI_MODEL"], "messages": messages})
    response.raise_for_status()
    reply = response.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Check it.\nAnswer:"}]
print(json.dumps({"reward": float(any(c.isdigit() for c in reply))}))
