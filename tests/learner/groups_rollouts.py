"""A ROLLOUT plugin for tests/learner/test_groups.py: fresh samples made locally, no server.

Response token ids encode the reward the test's scorer reads back (``[reward_code]``); prompt 0's
samples all tie on the first call and vary on the next (so the refill is visible), prompt 1's vary.
"""

from __future__ import annotations

from typing import Any

from learner.sample import Sample

CALLS: list[int] = []


def tied_then_varied(
    args: Any, rollout_id: int, data_source: list[Sample], evaluation: bool = False
) -> list[list[Sample]]:
    CALLS.append(len(data_source))
    groups = []
    for prompt in data_source:
        varied = prompt.group_index == 1 or len(CALLS) > 1
        codes = [0, 1, 2, 3] if varied else [2, 2, 2, 2]
        groups.append(
            [Sample(prompt_token_ids=list(prompt.prompt_token_ids), response_token_ids=[c + 10]) for c in codes]
        )
    return groups


ROLLOUT_IDS: list[int] = []


def reversed_groups(
    args: Any, rollout_id: int, data_source: list[Sample], evaluation: bool = False
) -> list[list[Sample]]:
    """Groups of unequal sizes (2, 3, ...), each sample carrying its prompt's group id, in reverse order."""
    ROLLOUT_IDS.append(rollout_id)
    groups = [
        [
            Sample(
                prompt_token_ids=list(prompt.prompt_token_ids),
                response_token_ids=[c + 10],
                group_index=prompt.group_index,
            )
            for c in range(size)
        ]
        for size, prompt in enumerate(data_source, start=2)
    ]
    return groups[::-1]
