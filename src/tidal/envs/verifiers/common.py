"""What both verifiers adapters (`classic`, `v1`) share: running verifiers' coroutines from sync code, and a
verifiers message's content as tidal's (text, or text and image parts)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any

from tidal.envs.images import is_image_part


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion from sync code, also when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def message_content(content: Any) -> str | list[dict[str, Any]]:
    """A message's content for tidal: plain text, or (when it holds images) its text and image parts in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if any(is_image_part(p) for p in content):
            return [p for p in content if is_image_part(p) or (isinstance(p, dict) and p.get("type") == "text")]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
