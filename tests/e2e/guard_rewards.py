"""Reward plugins for tests/e2e/test_capability_guard.py, loaded by dotted path (slime's ``--custom-rm-path``)."""

from __future__ import annotations

from learner.sample import Sample


async def short_answers(args: object, sample: Sample) -> float:
    """A reward any policy can hack: the fewer tokens, the better, whatever they say."""
    return 1.0 - sample.response_length / 8


async def one_letter(args: object, sample: Sample) -> float:
    """A narrow taste that keeps answers long: more 'k' in the answer."""
    return min(1.0, (sample.response or "").lower().count("k") / 4)
