"""Only the engine thread runs torch's multi-threaded (OpenMP) kernels; other threads run torch with one.

libgomp keeps a pool of worker threads for every thread that ever ran a parallel region, and once
the pools' threads outnumber the CPUs it stops spinning between regions: each of the hundreds of
small kernels of a decode step then waits for a sleeping worker to wake. Measured on the 2-core
machine: a 576 x 576 oneDNN matmul takes 37 us with one pool and 89 us with a second one, and a
SmolLM2 decode step is 1.4x slower. So torch work off the engine thread (model loading, checkpoint
reads, delta applies, adapter loads) runs on a worker thread limited to one OpenMP thread, which
never starts a pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

__all__ = ["off_engine_thread"]


async def off_engine_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a worker thread, with torch limited to one thread there (see the module doc)."""
    return await asyncio.to_thread(_single_threaded, fn, *args)


def _single_threaded(fn: Callable[..., T], *args: object) -> T:
    torch.set_num_threads(1)  # per thread: OpenMP's and MKL's counts of the calling thread only
    return fn(*args)
