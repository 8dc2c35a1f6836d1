from __future__ import annotations

import torch

from server.engines.local.kv import RowKV
from server.engines.local.prefix_cache import PrefixCache, common_prefix_length


def row(tokens: int) -> RowKV:
    """Two layers of [1, 2 heads, tokens, 4] float32: 128 bytes per token."""
    return RowKV([(torch.ones(1, 2, tokens, 4), torch.ones(1, 2, tokens, 4)) for _ in range(2)])


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_take_reuses_the_common_prefix_but_never_the_whole_prompt() -> None:
    cache = PrefixCache(1 << 20)
    cache.put("s", [1, 2, 3, 4, 5], row(4))  # the KV covers the first 4 tokens
    reuse, kv = cache.take("s", [1, 2, 3, 4, 5, 6])
    assert reuse == 4 and kv is not None and kv.length == 4
    assert cache.take("s", [1, 2, 3]) == (0, None)  # taken: the entry left the cache

    cache.put("s", [1, 2, 3, 4, 5], row(4))
    reuse, kv = cache.take("s", [1, 2, 3, 4])  # identical prompt: one token must still be prefilled
    assert reuse == 3 and kv is not None and kv.length == 3
    cache.put("t", [7, 8], row(2))
    assert cache.take("t", [9, 9, 9]) == (0, None)


def test_lru_is_bounded_by_bytes() -> None:
    cache = PrefixCache(capacity_bytes=3 * 10 * 128)  # room for three 10-token rows
    for key in "abc":
        cache.put(key, list(range(10)), row(10))
    assert len(cache) == 3 and cache.nbytes == 3 * 10 * 128
    cache.take("a", list(range(11)))  # use a; b is now the least recent
    cache.put("a", list(range(10)), row(10))
    cache.put("d", list(range(10)), row(10))
    assert len(cache) == 3 and cache.nbytes <= cache.capacity_bytes
    assert cache.take("b", list(range(11))) == (0, None)
    assert cache.take("c", list(range(11)))[0] == 10
    cache.put("huge", list(range(100)), row(100))  # larger than the whole budget: not kept
    assert cache.take("huge", list(range(101))) == (0, None)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
