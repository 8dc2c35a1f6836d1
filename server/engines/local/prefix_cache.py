"""Per-session prefix reuse: the KV of a session's last prompt+output, LRU-bounded by bytes.

A session's next turn usually starts with the previous turn's tokens, so only the new tokens need
a prefill. KV at position i depends only on tokens <= i, so any common prefix can be reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from server.engines.local.kv import RowKV


@dataclass(slots=True)
class _Entry:
    token_ids: list[int]
    kv: RowKV
    nbytes: int


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, session_key: Hashable, input_ids: list[int]) -> tuple[int, RowKV | None]:
        """Remove the session's entry and return how many leading input tokens it covers."""
        entry = self._entries.pop(session_key, None)
        if entry is None:
            return 0, None
        self.nbytes -= entry.nbytes
        # At least one token must be prefilled to get logits for the next token.
        reuse = min(common_prefix_length(entry.token_ids, input_ids), entry.kv.length, len(input_ids) - 1)
        if reuse <= 0:
            return 0, None
        return reuse, entry.kv.truncated(reuse)

    def put(self, session_key: Hashable, token_ids: list[int], kv: RowKV) -> None:
        old = self._entries.pop(session_key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        nbytes = kv.nbytes
        if nbytes > self.capacity_bytes:
            return
        self._entries[session_key] = _Entry(token_ids[: kv.length], kv, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
