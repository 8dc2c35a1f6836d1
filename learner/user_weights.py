"""How much each user's ratings count in a round of the shared base: nobody moves it alone.

Two rules, applied to the round's rated answers before they train (each sample's advantage is
multiplied by its user's weight, which scales its share of the policy gradient):

- **a share cap**: together, one user's answers weigh at most ``max_user_share`` of the round's
  (never less than an equal share, 1 / users): a user with more answers has each one weighted down
  to fit. The cap is a water level: it is recomputed until no capped user is over it, so one
  heavy rater cannot lift the others' weights by being cut.
- **agreement**: on prompts that several users rated, a user agrees with the others on a prompt
  when the sign of their rating there is the sign of the others' mean rating there. A user with at
  least ``min_shared_prompts`` such prompts who agrees on fewer than ``min_agreement`` of them has
  every weight multiplied by ``disagreeing_weight``.

Users an admin flagged (``storage.flagged_users``) never reach this: the rounds drop their ratings.
A round with one user trains on that user's ratings at full weight (a personal deployment learns).
Answers without a user count as one user, "" (anonymous traffic shares one voice).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from learner.sample import Sample

__all__ = ["UserWeighting", "UserWeights", "user_weights"]

WATER_LEVEL_ROUNDS = 50


@dataclass(frozen=True, slots=True)
class UserWeighting:
    """The rules' settings (``TANDEM_LEARN_MAX_USER_SHARE`` and friends)."""

    max_user_share: float = 0.25
    min_agreement: float = 0.5
    min_shared_prompts: int = 5
    disagreeing_weight: float = 0.25

    def __post_init__(self) -> None:
        if not (0 < self.max_user_share <= 1 and 0 <= self.min_agreement <= 1):
            raise ValueError("max_user_share must be in (0, 1] and min_agreement in [0, 1]")
        if self.min_shared_prompts < 1 or not 0 <= self.disagreeing_weight <= 1:
            raise ValueError("min_shared_prompts must be >= 1 and disagreeing_weight in [0, 1]")


@dataclass(frozen=True, slots=True)
class UserWeights:
    """Each user's weight ("" for answers without a user), and who each rule touched."""

    weights: dict[str, float]
    capped: tuple[str, ...] = ()
    disagreeing: tuple[str, ...] = ()
    agreement: dict[str, float] = field(default_factory=dict)

    def of(self, sample: Sample) -> float:
        return self.weights.get(sample.user_id or "", 1.0)

    def metrics(self) -> dict[str, float]:
        return {
            "users": float(len(self.weights)),
            "users/capped": float(len(self.capped)),
            "users/disagreeing": float(len(self.disagreeing)),
            "users/weight_min": min(self.weights.values(), default=1.0),
        }


def user_weights(samples: Sequence[Sample], config: UserWeighting) -> UserWeights:
    """The weights for ``samples``, whose rewards are set (``reward_value()``)."""
    counts: dict[str, int] = defaultdict(int)
    for sample in samples:
        counts[sample.user_id or ""] += 1
    weights = dict.fromkeys(counts, 1.0)
    if len(counts) < 2:
        return UserWeights(weights)
    share = max(config.max_user_share, 1 / len(counts))
    level = share * sum(counts.values())
    for _ in range(WATER_LEVEL_ROUNDS):  # the level falls as heavy users are cut; it settles fast
        settled = share * sum(min(n, level) for n in counts.values())
        if abs(settled - level) < 1e-9:
            break
        level = settled
    capped = tuple(sorted(user for user, n in counts.items() if n > level))
    for user in capped:
        weights[user] = level / counts[user]
    agreement = _agreement(samples, config.min_shared_prompts)
    disagreeing = tuple(sorted(user for user, rate in agreement.items() if rate < config.min_agreement))
    for user in disagreeing:
        weights[user] *= config.disagreeing_weight
    return UserWeights(weights, capped, disagreeing, agreement)


def _agreement(samples: Sequence[Sample], min_shared: int) -> dict[str, float]:
    """Per user with at least ``min_shared`` prompts rated by others too: the share of them they agree on."""
    by_prompt: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for sample in samples:
        key = json.dumps(sample.prompt, sort_keys=True, ensure_ascii=False)
        by_prompt[key][sample.user_id or ""].append(sample.reward_value())
    agrees: dict[str, list[bool]] = defaultdict(list)
    for raters in by_prompt.values():
        if len(raters) < 2:
            continue
        means = {user: sum(values) / len(values) for user, values in raters.items()}
        for user, own in means.items():
            others = [m for other, m in means.items() if other != user]
            theirs = sum(others) / len(others)
            if own != 0 and theirs != 0:
                agrees[user].append((own > 0) == (theirs > 0))
    return {user: sum(votes) / len(votes) for user, votes in agrees.items() if len(votes) >= min_shared}
