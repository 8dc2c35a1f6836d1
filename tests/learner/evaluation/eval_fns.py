"""Eval functions for the tests, loaded by dotted path as a user's would be."""

from __future__ import annotations

from typing import Any

from learner.sample import Sample


async def response_length(args: Any, sample: Sample) -> float:
    return float(sample.response_length)


async def sampling_echo(args: Any, sample: Sample) -> float:
    """Shows which sampling parameters and label reached the function."""
    return args.temperature + args.max_tokens + (100.0 if sample.label == "x" else 0.0)


async def fails(args: Any, sample: Sample) -> float:
    raise RuntimeError("the eval judge is down")


async def returns_dict(args: Any, sample: Sample) -> dict[str, float]:
    return {"score": 1.0}


def not_async(args: Any, sample: Sample) -> float:
    return 0.0
