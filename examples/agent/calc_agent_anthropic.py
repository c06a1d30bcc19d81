"""examples/agent/calc_agent.py on the `anthropic` SDK (docs/agents.md, bench/AGENT-LEARN.md): nothing tidal-specific.

The same calculator agent through Anthropic's Messages API: it asks the model, runs the `add` tool on each
`tool_use` block, sends the results back as `tool_result` blocks and asks again, until the model answers without a
call (at most 3 calls). As a command it reads ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY and the example in
TIDAL_AGENT_EXAMPLE; as a function (`function: examples.agent.calc_agent_anthropic:main`) it gets the OpenAI base
URL (`.../v1`) and the key as arguments.
"""

import json
import os

import anthropic

SYSTEM = ('You have a calculator. To add two numbers, write <tool_call>{"name": "add", "arguments": {"a": 12, '
          '"b": 30}}</tool_call> and wait for the result. Then answer with the number.')  # calc_agent.py's
TOOLS: list = [{"name": "add", "description": "Add two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}]


def add(a=None, b=None, **_):
    try:
        return str(int(a) + int(b))
    except (TypeError, ValueError):
        return "error: a and b must be integers"


def main(base_url=None, api_key=None, example=None):
    if base_url is not None:  # the function form gets the OpenAI base URL: the Anthropic one is the same without /v1
        base_url = base_url.removesuffix("/v1")
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key)  # None: ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY
    example = example or json.loads(os.environ["TIDAL_AGENT_EXAMPLE"])
    messages = [{"role": m["role"], "content": m["content"]} for m in example["prompt"] if m["role"] != "system"]
    text = ""
    for _ in range(3):
        msg = client.messages.create(model=os.environ.get("TIDAL_AGENT_MODEL", "policy"), system=SYSTEM,
                                     messages=messages, tools=TOOLS, max_tokens=256)  # the run caps each call
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        text = "".join(b.text for b in msg.content if b.type == "text")
        calls = [b for b in msg.content if b.type == "tool_use"]
        if not calls:
            break
        messages.append({"role": "user", "content": [  # run the tools the model called
            {"type": "tool_result", "tool_use_id": b.id, "content": add(**b.input)} for b in calls]})
    print(text)


if __name__ == "__main__":
    main()
