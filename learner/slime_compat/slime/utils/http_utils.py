"""``slime.utils.http_utils``: ``post`` and ``get`` with slime's signatures and behaviour.

``post`` answers the JSON body (or the text when it is not JSON) and, like slime's, tries again a
second later on any failure, raising after ``max_retries``. In tandem the router at
``args.sglang_router_ip``:``args.sglang_router_port`` is the learner's own (``learner.sglang_router``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

__all__ = ["get", "init_http_client", "post"]

log = logging.getLogger(__name__)


def init_http_client(args: object) -> None:
    """slime creates its shared client here; tandem opens one per call (plugins may still call it)."""


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict[str, str] | None = None) -> Any:
    for attempt in range(1, max_retries + 1):
        try:
            async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
                response = await client.post(url, json=payload or {}, headers=headers)
                response.raise_for_status()
            try:
                return json.loads(response.content)
            except ValueError:
                return response.text
        except Exception as exc:  # slime retries whatever failed: a refused request as a dropped one
            if attempt == max_retries:
                raise
            log.warning("POST %s failed (%r), try %d of %d", url, exc, attempt, max_retries)
            await asyncio.sleep(1)
    raise ValueError(f"max_retries must be at least 1, got {max_retries}")


async def get(url: str) -> Any:
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        response = await client.get(url)
        response.raise_for_status()
        return json.loads(response.content)
