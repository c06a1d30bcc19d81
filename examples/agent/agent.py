"""A plain `openai`-SDK agent that tidal trains unchanged (docs/agents.md): a tool, two turns, nothing tidal-specific.

tidal runs it once per rollout with OPENAI_BASE_URL / OPENAI_API_KEY pointing at the rollout's session and the
example in TIDAL_AGENT_EXAMPLE; run by hand, point those at any OpenAI-compatible server."""

import json
import os

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "reverse", "description": "Reverse a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]

client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
model = os.environ.get("TIDAL_AGENT_MODEL", "policy")
example = json.loads(os.environ["TIDAL_AGENT_EXAMPLE"])
messages = list(example["prompt"])
for _ in range(2):
    msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
    messages.append(msg)  # the answer exactly as returned: the next call extends the same training row
    for call in msg.tool_calls or []:  # run the tool the model called
        text = json.loads(call.function.arguments).get("text", "")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": text[::-1]})
    if not msg.tool_calls:
        messages.append({"role": "user", "content": "Check your answer and give it again."})
print(msg.content)
