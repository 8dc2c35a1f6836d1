"""Wait for a condition instead of sleeping and hoping: one helper for threads, one for event loops."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


def wait_until(condition: Callable[[], object], *, timeout_s: float, what: str, interval_s: float = 0.05) -> float:
    """Poll ``condition`` until it holds; return the seconds it took. Fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        time.sleep(interval_s)
    return time.monotonic() - started


async def async_wait_until(
    condition: Callable[[], object | Awaitable[object]], *, timeout_s: float, what: str, interval_s: float = 0.02
) -> float:
    """``wait_until`` for code on an event loop: sleeps without blocking the loop, so tasks on it
    (the engine's consumers, the pool's probes) make the progress being waited for. ``condition``
    may be a coroutine function (a health probe)."""
    started = time.monotonic()
    while not await _holds(condition):
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        await asyncio.sleep(interval_s)
    return time.monotonic() - started


async def _holds(condition: Callable[[], object | Awaitable[object]]) -> bool:
    result = condition()
    return bool(await result if inspect.isawaitable(result) else result)
