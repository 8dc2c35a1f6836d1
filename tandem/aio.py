"""asyncio helpers shared by the gateway and the learner."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

__all__ = ["gather_or_cancel"]

T = TypeVar("T")


async def gather_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Their results, in order; on the first failure the rest are cancelled and awaited, then it is raised.

    Unlike a bare ``asyncio.gather``, nothing is left running after a failure (or after this call is
    cancelled): the cancelled tasks have finished their cleanup (closed requests, released slots)
    before the exception reaches the caller.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
