"""Per-user weights of a base round: the share cap and the agreement rule, from samples alone."""

from __future__ import annotations

import pytest

from learner.collect import learnable
from learner.sample import Sample
from learner.user_weights import UserWeighting, user_weights


def rated(user: str | None, prompt: str, reward: float, tenant: str = "t") -> Sample:
    return Sample(
        prompt=[{"role": "user", "content": prompt}],
        response_token_ids=[1, 2],
        reward=reward,
        user_id=user,
        metadata={"tenant_id": tenant},
    )


def test_one_user_trains_at_full_weight() -> None:
    weights = user_weights([rated("solo", f"q{i}", 1.0) for i in range(50)], UserWeighting())
    assert weights.weights == {"solo": 1.0} and weights.capped == ()


def test_a_heavy_rater_is_cut_to_the_share_cap_and_the_others_keep_full_weight() -> None:
    samples = [rated("heavy", f"h{i}", 1.0) for i in range(300)]
    for user in ("a", "b", "c", "d", "e"):
        samples += [rated(user, f"{user}{i}", -1.0) for i in range(10)]
    weights = user_weights(samples, UserWeighting(max_user_share=0.25))
    assert weights.capped == ("heavy",)
    assert {u: weights.weights[u] for u in "abcde"} == dict.fromkeys("abcde", 1.0)
    heavy = 300 * weights.weights["heavy"]
    assert heavy / (heavy + 50) == pytest.approx(0.25)  # the water level: exactly the cap, not more
    assert weights.metrics()["users/capped"] == 1.0


def test_the_cap_is_never_below_an_equal_share() -> None:
    samples = [rated("a", f"a{i}", 1.0) for i in range(20)] + [rated("b", f"b{i}", 1.0) for i in range(10)]
    weights = user_weights(samples, UserWeighting(max_user_share=0.1))  # two users: each may have half
    assert weights.weights["b"] == 1.0
    assert 20 * weights.weights["a"] == pytest.approx(10)


def test_a_user_who_disagrees_with_everyone_on_shared_prompts_is_down_weighted() -> None:
    samples = []
    for i in range(6):
        prompt = f"shared {i}"
        samples += [rated(user, prompt, 1.0) for user in "abc"] + [rated("contrarian", prompt, -1.0)]
    samples += [rated("quiet", "shared 0", -1.0)]  # one shared prompt: too few to judge
    config = UserWeighting(max_user_share=1.0, min_shared_prompts=5, disagreeing_weight=0.25)
    weights = user_weights(samples, config)
    assert weights.disagreeing == ("contrarian",)
    assert weights.weights["contrarian"] == 0.25 and weights.weights["a"] == weights.weights["quiet"] == 1.0
    assert weights.agreement["contrarian"] == 0.0 and weights.agreement["a"] == 1.0
    assert "quiet" not in weights.agreement


def test_answers_without_a_user_share_one_voice() -> None:
    samples = [rated(None, f"x{i}", 1.0) for i in range(40)] + [rated("a", f"a{i}", 1.0) for i in range(10)]
    weights = user_weights(samples, UserWeighting(max_user_share=0.25))
    assert weights.of(samples[0]) == weights.weights[""] < 1.0  # cut to an equal half, the floor


def test_flagged_users_are_dropped_per_tenant() -> None:
    samples = [rated("mallory", "q", 1.0, tenant="t1"), rated("mallory", "q", 1.0, tenant="t2"), rated("a", "q", 1.0)]
    kept = learnable(samples, frozenset({("t1", "mallory")}))
    assert [(s.metadata["tenant_id"], s.user_id) for s in kept] == [("t2", "mallory"), ("t", "a")]


@pytest.mark.parametrize("changes", [{"max_user_share": 0.0}, {"min_agreement": 1.5}, {"min_shared_prompts": 0}])
def test_wrong_settings_fail_at_once(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        UserWeighting(**changes)  # type: ignore[arg-type]
