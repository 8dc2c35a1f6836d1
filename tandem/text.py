"""Text helpers shared by the gateway and the learner."""

from __future__ import annotations


def holdback(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``stops``: text that must
    not be released yet (a stop string, or a tool-call tag, may be on its way)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
