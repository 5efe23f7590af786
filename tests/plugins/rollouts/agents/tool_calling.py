"""A tool-calling agent written with the openai package: it offers an add tool, runs the calls the
policy makes, sends the results back and streams the final answer; its reward is 1 when the
answer holds the sum."""

import json
import os

from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
model = os.environ["OPENAI_MODEL"]
tools = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]
messages = [{"role": "user", "content": json.loads(os.environ["GRPO_ROW"])["text"]}]
reply = client.chat.completions.create(model=model, messages=messages, tools=tools).choices[0].message
messages.append({"role": "assistant", "content": reply.content, "tool_calls": [c.model_dump() for c in reply.tool_calls or []]})
for call in reply.tool_calls or []:
    arguments = json.loads(call.function.arguments)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
stream = client.chat.completions.create(model=model, messages=messages, tools=tools, stream=True)
answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
print(answer)
print(json.dumps({"reward": float("5" in answer)}))
