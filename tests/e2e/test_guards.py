"""Guarded learning in real rounds: a hacked reward is held back by the capability guard, a narrow
taste that keeps answers whole passes, and a drifting round stops before export and pauses its schedule.

A real gateway (in-thread uvicorn, the local engine on the tiny model, SQLite), ratings through the
official client and ``/v1/feedback``, real rollouts, training and evaluation in child processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from learner.evaluation import EvalConfig
from learner.evaluation.guard import GuardConfig
from learner.rollout import RolloutConfig
from learner.round import run_round
from learner.trainers.drift import DriftConfig
from storage import get_round
from storage.db import make_engine, make_session_factory
from storage.schedules import create_schedule, get_schedule
from tests.e2e.test_learning_round import chat_and_rate, round_config, serving
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

QUESTIONS = [f"Tell me about place {i}." for i in range(8)]
# The guard's own answers: shorter than its defaults, the tiny model has nothing long to say.
GUARD = GuardConfig(max_tokens=16, user_prompts=4)
GUARDED = EvalConfig(holdout_fraction=0.0, guard=GUARD)
UNWATCHED = DriftConfig(guard="off")  # the capability guard alone judges these rounds


@pytest.fixture
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway of its own per test: each round starts from the tiny model's own weights."""
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("guards"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


def rollout_round(gateway: Gateway, tmp_path: Path, reward_path: str, learning_rate: float, steps: int) -> object:
    chat_and_rate(gateway, [(q, "up") for q in QUESTIONS])
    config = round_config(
        gateway,
        tmp_path,
        reward="custom",
        reward_path=reward_path,
        rollout=RolloutConfig(n_samples_per_prompt=4, max_new_tokens=8, seed=5),
        learning_rate=learning_rate,
        num_steps=steps,
        evaluation=GUARDED,
        drift=UNWATCHED,
    )
    return run_round(config)


def test_a_reward_for_short_answers_is_hacked_and_the_guard_holds_the_candidate_back(
    gateway: Gateway, tmp_path: Path
) -> None:
    before = serving(gateway)["weight_version"]
    result = rollout_round(gateway, tmp_path, "tests.e2e.guard_rewards:short_answers", 5e-2, 6)
    assert result.status == "held_back", (result.status, result.error)
    reason = result.metrics["eval/reason"]
    assert reason.startswith("held back by the capability guard: ")
    # Six steps at a high rate on a reward blind to content: the policy left the root far behind
    # (measured: KL 1.02 per token, bound 0.2; four steps gave 0.38 once the rated answers were scored
    # at the temperature they were sampled at, 0.9, as slime scores rollouts) and lost the reference
    # answers (bound 0.3). The random model's answers were gibberish before and stay so: no
    # degeneration check can see this collapse, the KL and the reference answers do.
    assert "kl_to_root" in reason and "reference_loglik" in reason
    assert result.metrics["guard/kl_to_root"] > 2 * GUARD.max_kl
    assert serving(gateway)["weight_version"] == before  # nothing collapsed reached the users


def test_a_taste_that_keeps_answers_whole_passes_the_guard(gateway: Gateway, tmp_path: Path) -> None:
    result = rollout_round(gateway, tmp_path, "tests.e2e.guard_rewards:one_letter", 1e-2, 1)
    assert result.status == "succeeded", (result.status, result.error, result.metrics.get("eval/reason"))
    assert result.metrics["guard/passed"] == 1.0
    # It moved (measured KL 0.016 per token, reference answers -7.628 against -7.625), far inside the bounds.
    assert 0 < result.metrics["guard/kl_to_root"] < GUARD.max_kl / 4
    assert result.metrics["eval/reason"].endswith("capability guard passed (8 checks)")
    assert serving(gateway)["weight_version"] == result.version_id


def test_a_drifting_round_stops_before_export_and_pauses_its_schedule(gateway: Gateway, tmp_path: Path) -> None:
    engine = make_engine(gateway.settings.resolved_database_url)
    sessions = make_session_factory(engine)
    with sessions.begin() as session:
        schedule = create_schedule(
            session,
            {
                "name": "hourly",
                "kind": "interval",
                "cron": None,
                "interval_s": 3600,
                "min_feedback": None,
                "quiet_start": None,
                "quiet_end": None,
                "timezone": "UTC",
                "round_settings": {},
                "enabled": True,
            },
        )
    chat_and_rate(gateway, [(q, rating) for q in QUESTIONS for rating in ("up", "down")])
    config = round_config(
        gateway,
        tmp_path,
        num_steps=2,
        drift=DriftConfig(max_kl=1e-4),  # any real step crosses it
        trigger="schedule",
        schedule_id=schedule.id,
    )
    result = run_round(config)
    assert result.status == "failed"
    assert "training drifted: PolicyDrifted: step 1: KL to the lineage root" in (result.error or "")
    assert result.error.endswith(f"schedule {schedule.id} paused until an admin enables it")
    with sessions.begin() as session:
        paused = get_schedule(session, schedule.id)
        row = get_round(session, round_id=result.round_id)
    engine.dispose()
    assert paused.enabled is False and paused.paused_reason is not None
    assert paused.paused_reason.startswith(f"round {result.round_id}: training drifted")
    assert row.status == "failed" and row.watermark_to is None and row.produced_version_id is None
    assert not list((tmp_path / "checkpoints").glob("v*"))  # stopped before export


def test_a_flagged_user_trains_nothing_and_a_heavy_rater_counts_as_much_as_the_others(
    gateway: Gateway, tmp_path: Path
) -> None:
    flagged = httpx.put(
        f"{gateway.url}/admin/users/mallory/flag",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        params={"tenant": "e2e"},
        json={"reason": "rates to steer the model"},
    )
    assert flagged.status_code == 200, flagged.text
    chat_and_rate(gateway, [(q, "up") for q in QUESTIONS * 2], user="heavy")
    chat_and_rate(gateway, [(QUESTIONS[0], "down"), (QUESTIONS[1], "up")], user="alice")
    chat_and_rate(gateway, [(QUESTIONS[2], "down"), (QUESTIONS[3], "up")], user="bob")
    chat_and_rate(gateway, [(q, "up") for q in QUESTIONS[:4]], user="mallory")
    result = run_round(round_config(gateway, tmp_path, drift=UNWATCHED))
    assert result.status == "succeeded", result.error
    assert result.samples == 16 + 2 + 2 and result.metrics["flagged_excluded"] == 4
    # Three users, so each may weigh a third: heavy's 16 answers count as 2, like alice's and bob's.
    assert result.metrics["users"] == 3 and result.metrics["users/capped"] == 1
    assert result.metrics["users/weight_min"] == pytest.approx(2 / 16)
