"""Which LoRA adapters an SGLang server holds: loaded on first use through ``/load_lora_adapter``,
the least recently used idle one unloaded (``/unload_lora_adapter``) past ``max_loaded``.

SGLang serves a request's adapter by name (``lora_path`` in ``/generate``) only once loaded; an
adapter with requests in flight is never unloaded, so the count may exceed ``max_loaded`` while
every resident adapter is busy. Loads of one adapter are single-flight.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from server.engines.base import AdapterRef

Post = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class ResidentAdapters:
    def __init__(self, post: Post, *, max_loaded: int) -> None:
        self._post = post
        self._max_loaded = max_loaded
        self._in_use: OrderedDict[str, int] = OrderedDict()  # loaded adapters, least recently used first
        self._loading: dict[str, asyncio.Task[None]] = {}

    @property
    def loaded(self) -> list[str]:
        return list(self._in_use)

    @asynccontextmanager
    async def using(self, adapter: AdapterRef) -> AsyncIterator[str]:
        """The name to send as ``lora_path``, held resident while the block runs."""
        while adapter.key not in self._in_use:
            task = self._loading.get(adapter.key)
            if task is None:
                task = self._loading[adapter.key] = asyncio.create_task(self._load(adapter))
                task.add_done_callback(lambda _: self._loading.pop(adapter.key, None))
            await asyncio.shield(task)
        self._in_use[adapter.key] += 1
        self._in_use.move_to_end(adapter.key)
        try:
            yield adapter.key
        finally:
            self._in_use[adapter.key] -= 1

    async def _load(self, adapter: AdapterRef) -> None:
        await self._make_room()
        await self._post("/load_lora_adapter", {"lora_name": adapter.key, "lora_path": adapter.path})
        self._in_use[adapter.key] = 0

    async def _make_room(self) -> None:
        idle = [key for key, users in self._in_use.items() if users == 0]
        for key in idle[: max(0, len(self._in_use) + 1 - self._max_loaded)]:
            del self._in_use[key]
            await self._post("/unload_lora_adapter", {"lora_name": key})

    async def drop(self, key: str) -> None:
        """Unload ``key`` now if it is idle (its scope was deleted or rolled back); a busy one is left to eviction."""
        if self._in_use.get(key) == 0:
            del self._in_use[key]
            await self._post("/unload_lora_adapter", {"lora_name": key})
