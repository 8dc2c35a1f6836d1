"""Wait for a condition instead of sleeping and hoping."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str, interval_s: float = 0.05) -> float:
    """Poll ``condition`` until it holds; return the seconds it took. Fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        time.sleep(interval_s)
    return time.monotonic() - started
