"""The drift guard's rules, from numbers alone (the training child's probe: test_child.py)."""

from __future__ import annotations

import pytest

from learner.trainers.drift import DriftConfig, DriftWatch, PolicyDrifted, length_change


def watch(**bounds: float) -> DriftWatch:
    return DriftWatch(DriftConfig(**bounds), root_entropy=2.0)  # type: ignore[arg-type]


def test_steps_within_bounds_report_their_drift() -> None:
    metrics = watch().step(1, kl_to_root=0.2, entropy=1.5, grad_norm=3.0)
    assert metrics == {"drift/kl_to_root": 0.2, "drift/entropy": 1.5, "drift/entropy_ratio": 0.75}


@pytest.mark.parametrize(
    ("probe", "message"),
    [
        ({"kl_to_root": 1.5}, "step 3: KL to the lineage root 1.500 > 1 per token"),
        ({"kl_to_root": float("nan")}, "KL to the lineage root nan"),
        ({"entropy": 0.4}, "entropy 0.400 is 0.20 of the root's 2.000 (< 0.25: collapsing)"),
    ],
)
def test_a_step_past_a_bound_raises_naming_it(probe: dict[str, float], message: str) -> None:
    values = {"kl_to_root": 0.1, "entropy": 2.0, "grad_norm": 1.0} | probe
    with pytest.raises(PolicyDrifted, match=message.replace("(", r"\(").replace(")", r"\)")):
        watch().step(3, **values)


def test_a_gradient_spike_is_judged_against_the_rounds_own_steps() -> None:
    guard = watch(grad_spike=10.0)
    guard.step(1, kl_to_root=0.0, entropy=2.0, grad_norm=500.0)  # no history yet: a big first norm is the scale
    guard.step(2, kl_to_root=0.0, entropy=2.0, grad_norm=2.0)
    guard.step(3, kl_to_root=0.0, entropy=2.0, grad_norm=2.0)
    with pytest.raises(PolicyDrifted, match=r"gradient norm 3e\+03 > 10 x the round's median 2"):
        guard.step(4, kl_to_root=0.0, entropy=2.0, grad_norm=3000.0)


def test_length_change_either_way_against_earlier_rounds() -> None:
    config = DriftConfig(max_length_change=3.0)
    assert length_change(40.0, [], config) is None  # a first round has nothing to compare with
    assert length_change(40.0, [30.0, 50.0, 45.0], config) is None
    assert length_change(10.0, [45.0, 50.0, 40.0], config) == (
        "mean response length 10.0 tokens is 0.22x the earlier rounds' median 45.0 (bound 3x either way)"
    )
    assert "4.00x" in (length_change(180.0, [45.0], config) or "")


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"guard": "no"}, "guard must be one of"), ({"max_kl": 0.0}, "max_kl must be > 0"), ({"grad_spike": 1.0}, "> 1")],
)
def test_wrong_bounds_fail_at_once(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DriftConfig(**changes)  # type: ignore[arg-type]
