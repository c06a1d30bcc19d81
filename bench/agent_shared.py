"""The workloads' programs (examples/agent/calc_agent.py, bench/agent_reverse.py) with one `openai.OpenAI` client for
every session: the same loop, but each session's client is `BASE.with_options(base_url=..., api_key=...)`, which
shares the base client's HTTP client, instead of a new `OpenAI(...)` (for which httpx builds an SSL context: tens of
ms of CPU). bench/agent_overhead.py's side `endpoint-fn-shared` runs these as functions, so the difference to
`endpoint-fn` is the programs' own client construction, not the endpoint's."""

import json
import os

from openai import OpenAI

BASE = OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused")
"""Made once at import; sessions copy it with their own base URL and key."""


def run(base_url, api_key, messages, tools, tool, calls=3):
    client = BASE.with_options(base_url=base_url, api_key=api_key)
    for _ in range(calls):
        msg = client.chat.completions.create(model=os.environ.get("TIDAL_AGENT_MODEL", "policy"), messages=messages,
                                             tools=tools).choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            if call.type != "function":
                continue
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": tool(**json.loads(call.function.arguments))})
    return msg


def calc_main(base_url, api_key, example):
    """examples/agent/calc_agent.py's `main` with the shared client."""
    from examples.agent.calc_agent import SYSTEM, TOOLS, add

    run(base_url, api_key, [{"role": "system", "content": SYSTEM}, *example["prompt"]], TOOLS, add)


def reverse_main(base_url, api_key, example):
    """bench/agent_reverse.py's `main` with the shared client."""
    from agent_reverse import TOOLS, reverse

    run(base_url, api_key, list(example["prompt"]), TOOLS, reverse)
