"""A plain `openai`-SDK agent with a calculator tool (docs/agents.md, bench/AGENT-LEARN.md): nothing tidal-specific.

It asks the model, runs the `add` tool the model calls, sends the result back and asks again, until the model
answers without a call (at most 3 calls). As a command it reads OPENAI_BASE_URL / OPENAI_API_KEY and the example in
TIDAL_AGENT_EXAMPLE; as a function (`function: examples.agent.calc_agent:main`) it gets them as arguments."""

import json
import os

from openai import OpenAI

SYSTEM = ('You have a calculator. To add two numbers, write <tool_call>{"name": "add", "arguments": {"a": 12, '
          '"b": 30}}</tool_call> and wait for the result. Then answer with the number.')
TOOLS: list = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def add(a=None, b=None, **_):
    try:
        return str(int(a) + int(b))
    except (TypeError, ValueError):
        return "error: a and b must be integers"


def main(base_url=None, api_key=None, example=None):
    client = OpenAI(base_url=base_url, api_key=api_key)  # None: OPENAI_BASE_URL / OPENAI_API_KEY
    example = example or json.loads(os.environ["TIDAL_AGENT_EXAMPLE"])
    messages = [{"role": "system", "content": SYSTEM}, *example["prompt"]]
    for _ in range(3):
        msg = client.chat.completions.create(model=os.environ.get("TIDAL_AGENT_MODEL", "policy"), messages=messages,
                                             tools=TOOLS).choices[0].message
        messages.append(msg)  # as returned: the next call extends the same training row
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:  # run the tools the model called
            if call.type != "function":
                continue
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": add(**json.loads(call.function.arguments))})
    print(msg.content)


if __name__ == "__main__":
    main()
