"""``slime.rollout.rm_hub``: ``async_rm`` and ``batched_async_rm``, for plugins that call them.

A custom reward function (the sample's own ``custom_rm_path``, else ``args.custom_rm_path``) is
called as slime calls it. slime's built-in ``rm_type`` scorers (deepscaler, dapo, math, f1, ...)
are not part of tandem: name the scorer as a reward plugin instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from learner.plugins import load_function
from learner.sample import Sample

__all__ = ["async_rm", "batched_async_rm"]


def _reward_path(args: Any, sample: Sample | None) -> str:
    path = (sample.custom_rm_path if sample is not None else None) or args.custom_rm_path
    if not path:
        rm_type = (sample.metadata.get("rm_type") if sample is not None else None) or args.rm_type
        raise ValueError(
            f"rm_type {rm_type!r}: slime's built-in reward models are not part of tandem; "
            "set a reward plugin (RoundConfig.reward_path, slime's --custom-rm-path)"
        )
    return str(path)


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    return await load_function(_reward_path(args, sample))(args, sample, **kwargs)


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    if args.custom_rm_path:
        return list(await load_function(args.custom_rm_path)(args, samples, **kwargs))
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))
