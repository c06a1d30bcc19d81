"""A plain `openai`-SDK agent with a `reverse` tool (bench/agent_overhead.py's `reverse` workload), nothing tidal's.

It sends the example's prompt with the tool, runs every `reverse` call the model writes, sends the results back as
`tool` messages and asks again, until the model answers without a call (at most 3 calls). As a command it reads
OPENAI_BASE_URL / OPENAI_API_KEY and the example in TIDAL_AGENT_EXAMPLE; as a function
(`function: bench.agent_reverse:main`) it gets them as arguments."""

import json
import os

from openai import OpenAI

TOOLS: list = [{"type": "function", "function": {"name": "reverse", "description": "Reverse a text.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


def reverse(text=None, **_):
    return str(text)[::-1] if isinstance(text, str) else "error: text must be a string"


def main(base_url=None, api_key=None, example=None):
    client = OpenAI(base_url=base_url, api_key=api_key)  # None: OPENAI_BASE_URL / OPENAI_API_KEY
    example = example or json.loads(os.environ["TIDAL_AGENT_EXAMPLE"])
    messages = list(example["prompt"])
    for _ in range(3):
        msg = client.chat.completions.create(model=os.environ.get("TIDAL_AGENT_MODEL", "policy"), messages=messages,
                                             tools=TOOLS).choices[0].message
        messages.append(msg)  # as returned: the next call extends the same training row
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            if call.type != "function":
                continue
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": reverse(**json.loads(call.function.arguments))})
    print(msg.content)


if __name__ == "__main__":
    main()
