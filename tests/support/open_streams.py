"""Streaming chat requests held open mid-generation: what a replica's load and queue depth count."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx

__all__ = ["streams_in_progress"]

# Long enough to be still generating when a test looks (ignore_eos: the model cannot stop early), and
# within the tiny model's 2,048-token context.
MAX_TOKENS = 1500


@contextmanager
def streams_in_progress(url: str, api_key: str, model: str, count: int) -> Iterator[None]:
    """``count`` streaming completions, each past its first token, until the block ends (then cancelled)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"}
    readers = []  # held: a line iterator dropped mid-stream closes its response (httpx)
    with ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=url, headers=headers, timeout=60))
        for _ in range(count):
            response = stack.enter_context(client.stream("POST", "/v1/chat/completions", json=body))
            assert response.status_code == 200, response.read()
            readers.append(lines := response.iter_lines())
            while '"delta":{"content":' not in next(lines):  # past the role chunk, to the first text
                pass
        yield
