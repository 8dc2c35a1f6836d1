"""Batch slots shared fairly between tenants (cache salts) in the local engine.

Admission takes, of the highest waiting priority, the oldest request of the tenant with the fewest
requests running. That alone does not help a tenant arriving at a batch that one tenant's long
requests fill: they were admitted together and finish together, so no slot frees for many steps.
So while the batch is full and a waiting tenant holds fewer slots than an even share, the newest
request of the tenant holding the most slots above its share is retracted: back to the front of the
queue without its KV, re-prefilled later (prompt and output so far) and continued where it stopped,
as SGLang retracts requests under memory pressure. Work-conserving: a tenant alone uses every slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq
from typing import Protocol


class Slotted(Protocol):
    cache_salt: str
    priority: int


def next_to_admit(waiting: Seq[Slotted], running: Seq[Slotted]) -> int:
    """Index in ``waiting`` (ordered by priority, then age) of the request to admit next."""
    load = Counter(seq.cache_salt for seq in running)
    top = waiting[0].priority
    best, fewest = 0, None
    for index, seq in enumerate(waiting):
        if seq.priority != top:
            break
        if fewest is None or load[seq.cache_salt] < fewest:
            best, fewest = index, load[seq.cache_salt]
            if fewest == 0:
                break
    return best


def preemption_victim(waiting: Seq[Slotted], running: Seq[Slotted], max_batch: int) -> int | None:
    """Index in ``running`` of the request to retract so a waiting tenant gets its share, if any."""
    if not waiting or len(running) < max_batch:
        return None
    load = Counter(seq.cache_salt for seq in running)
    top = waiting[0].priority
    starved = [seq for seq in waiting if seq.priority == top and load[seq.cache_salt] == 0]
    if not starved:
        return None
    share = max(1, max_batch // len(load.keys() | {seq.cache_salt for seq in starved}))
    heaviest, held = load.most_common(1)[0]
    if held <= share:
        return None
    # The newest of the heaviest tenant's requests at or below the waiting priority: least work lost.
    for index in range(len(running) - 1, -1, -1):
        seq = running[index]
        if seq.cache_salt == heaviest and seq.priority <= top:
            return index
    return None
