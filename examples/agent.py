"""An agent for `grpo-core run --rollout agent`: it answers the row's question and, when the answer
is wrong, is told so and answers again. Its reward is 1 for a right first answer, 0.5 for a right
second one, 0.1 for a wrong one that still ends in a "#### N" line. Any OpenAI client would do;
this one is httpx alone, and nothing in it is grpo-core's."""

import json
import os
import re

import httpx

row = json.loads(os.environ["GRPO_ROW"])  # the dataset row: id, text or messages, answer, metadata
client = httpx.Client(
    base_url=os.environ["OPENAI_BASE_URL"],  # the run's gateway, on 127.0.0.1
    headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},  # the run's key
    timeout=600,
)


def ask(messages):
    response = client.post("/chat/completions", json={"model": os.environ["OPENAI_MODEL"], "messages": messages})
    response.raise_for_status()  # an error exits non-zero: a failed sample, counted in agent/failed
    return response.json()["choices"][0]["message"]["content"]


expected = row["answer"].split("####")[-1].strip()


def score(answer, right):
    found = re.findall(r"####\s*(-?[\d,.]+)", answer)
    return 0.0 if not found else right if found[-1].replace(",", "") == expected else 0.1


# A wrong first answer gets a second try. The conversation goes back with the reply appended, so
# the second call continues the first one's trajectory: the policy is trained on both answers.
messages = [{"role": "user", "content": row["text"]}]
answer = ask(messages)
reward = score(answer, 1.0)
if reward < 1:
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Incorrect, try again.\n" + row["text"]}]
    reward = score(ask(messages), 0.5)
print(json.dumps({"reward": reward}))  # the last stdout line
