"""learner.schedule_slots: cron and interval slots, quiet hours across midnight, missed firings that
collapse into one, the feedback kind, and timing validation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from learner.schedule_slots import (
    FEEDBACK_RETRY_S,
    FeedbackState,
    Timing,
    TimingError,
    check_timing,
    due_slot,
    in_quiet_hours,
    next_fire_at,
)

CREATED = datetime(2026, 12, 1, 0, 0, tzinfo=UTC)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def test_interval_slots_are_epoch_multiples_and_only_the_latest_is_due() -> None:
    every_15_min = Timing(kind="interval", interval_s=900, since=CREATED)
    slot = due_slot(every_15_min, at("2026-12-03T10:07:30+00:00"))
    assert slot is not None and slot.key == "2026-12-03T10:00:00Z" and slot.at == at("2026-12-03T10:00:00+00:00")
    assert slot.expires_at == at("2026-12-03T10:15:00+00:00")  # a task not started by the next slot is stale
    # Down for ten hours: the forty missed slots collapse into the latest one, fired once.
    late = due_slot(every_15_min, at("2026-12-03T20:14:59+00:00"))
    assert late is not None and late.key == "2026-12-03T20:00:00Z"
    assert due_slot(every_15_min, at("2026-12-03T20:15:00+00:00")).key == "2026-12-03T20:15:00Z"  # type: ignore[union-attr]
    assert next_fire_at(every_15_min, at("2026-12-03T20:15:00+00:00")) == at("2026-12-03T20:30:00+00:00")
    # A firing is never stale before it could be sent, however close the next slot.
    every_second = Timing(kind="interval", interval_s=1, since=CREATED)
    brief = due_slot(every_second, at("2026-12-03T10:00:00.999+00:00"))
    assert brief is not None and brief.expires_at == at("2026-12-03T10:00:01.999+00:00")


def test_no_slot_from_before_the_last_edit_fires() -> None:
    edited = Timing(kind="interval", interval_s=3600, since=at("2026-12-03T10:07:00+00:00"))
    assert due_slot(edited, at("2026-12-03T10:59:59+00:00")) is None  # 10:00 was before the edit
    assert due_slot(edited, at("2026-12-03T11:00:00+00:00")).key == "2026-12-03T11:00:00Z"  # type: ignore[union-attr]
    assert next_fire_at(edited, at("2026-12-03T10:30:00+00:00")) == at("2026-12-03T11:00:00+00:00")
    # An edit in the future (another machine's clock ahead): nothing before it.
    assert next_fire_at(edited, at("2026-12-03T09:00:00+00:00")) == at("2026-12-03T11:00:00+00:00")


def test_cron_slots_follow_the_schedules_timezone_across_daylight_saving() -> None:
    three_am_berlin = Timing(kind="cron", cron="0 3 * * *", timezone="Europe/Berlin", since=CREATED)
    winter = due_slot(three_am_berlin, at("2026-12-03T05:00:00+00:00"))
    assert winter is not None and winter.at == at("2026-12-03T02:00:00+00:00")  # 03:00 CET
    assert winter.expires_at == at("2026-12-04T02:00:00+00:00")
    summer = Timing(kind="cron", cron="0 3 * * *", timezone="Europe/Berlin", since=at("2026-06-01T00:00:00+00:00"))
    assert next_fire_at(summer, at("2026-06-10T12:00:00+00:00")) == at("2026-06-11T01:00:00+00:00")  # 03:00 CEST
    # A slot exactly at now is due (croniter's previous match alone would be the one before it).
    hourly = Timing(kind="cron", cron="@hourly", since=CREATED)
    assert due_slot(hourly, at("2026-12-03T10:00:00+00:00")).key == "2026-12-03T10:00:00Z"  # type: ignore[union-attr]
    assert due_slot(hourly, at("2026-12-03T10:59:59.999+00:00")).key == "2026-12-03T10:00:00Z"  # type: ignore[union-attr]


def test_quiet_hours_across_midnight_skip_slots_and_hold_firing() -> None:
    night = Timing(
        kind="interval", interval_s=3600, quiet_start="22:00", quiet_end="06:30", timezone="America/New_York"
    )
    # 22:00 to 06:30 in New York is 03:00 to 11:30 UTC in December.
    assert not in_quiet_hours(night, at("2026-12-03T02:59:59+00:00"))
    assert in_quiet_hours(night, at("2026-12-03T03:00:00+00:00"))  # start included
    assert in_quiet_hours(night, at("2026-12-03T05:00:00+00:00"))  # after local midnight
    assert not in_quiet_hours(night, at("2026-12-03T11:30:00+00:00"))  # end excluded
    assert due_slot(night, at("2026-12-03T04:10:00+00:00")) is None
    assert next_fire_at(night, at("2026-12-03T02:10:00+00:00")) == at("2026-12-03T12:00:00+00:00")
    assert due_slot(night, at("2026-12-03T12:00:01+00:00")).key == "2026-12-03T12:00:00Z"  # type: ignore[union-attr]

    # A slot outside the window that was missed is fired once, but not while the window lasts.
    nightly = Timing(kind="cron", cron="50 21 * * *", quiet_start="22:00", quiet_end="06:00", since=CREATED)
    assert due_slot(nightly, at("2026-12-03T23:00:00+00:00")) is None
    caught_up = due_slot(nightly, at("2026-12-04T06:00:00+00:00"))
    assert caught_up is not None and caught_up.key == "2026-12-03T21:50:00Z"

    daytime = Timing(kind="interval", interval_s=600, quiet_start="09:00", quiet_end="17:00", since=CREATED)
    assert in_quiet_hours(daytime, at("2026-12-03T16:59:00+00:00"))
    assert not in_quiet_hours(daytime, at("2026-12-03T17:00:00+00:00"))
    assert not in_quiet_hours(daytime, at("2026-12-03T08:59:00+00:00"))
    assert next_fire_at(daytime, at("2026-12-03T09:00:00+00:00")) == at("2026-12-03T17:00:00+00:00")


def state(**overrides: object) -> FeedbackState:
    values: dict[str, object] = {
        "watermark": 41,
        "new_feedback": 8,
        "round_active": False,
        "firings_at_watermark": 0,
        "last_fired_at": None,
    }
    return FeedbackState(**{**values, **overrides})  # type: ignore[arg-type]


def test_feedback_kind_fires_on_enough_ratings_keyed_by_the_watermark() -> None:
    now = at("2026-12-03T10:00:00+00:00")
    enough = Timing(kind="feedback", min_feedback=8, interval_s=600)
    slot = due_slot(enough, now, state())
    assert slot is not None and slot.key == "feedback:41:0" and slot.at == now
    assert slot.expires_at == now + timedelta(seconds=600)
    assert due_slot(enough, now, state(new_feedback=7)) is None
    assert due_slot(enough, now, state(round_active=True)) is None
    # interval_s is the least time between two firings, whatever the watermark.
    assert due_slot(enough, now, state(last_fired_at=now - timedelta(seconds=599))) is None
    assert due_slot(enough, now, state(last_fired_at=now - timedelta(seconds=600))) is not None
    # Fired at this watermark already and the round did not move it: a retry, under the next key.
    again = state(firings_at_watermark=1, last_fired_at=now - timedelta(seconds=600))
    assert due_slot(enough, now, again).key == "feedback:41:1"  # type: ignore[union-attr]
    assert next_fire_at(enough, now) is None
    with pytest.raises(ValueError, match="FeedbackState"):
        due_slot(enough, now)


def test_feedback_retry_at_the_same_watermark_waits_without_an_interval() -> None:
    now = at("2026-12-03T10:00:00+00:00")
    eager = Timing(kind="feedback", min_feedback=3, quiet_start="09:00", quiet_end="09:30")
    assert due_slot(eager, now, state(last_fired_at=now - timedelta(seconds=1))) is not None  # a new watermark
    soon = state(firings_at_watermark=2, last_fired_at=now - timedelta(seconds=FEEDBACK_RETRY_S - 1))
    assert due_slot(eager, now, soon) is None
    later = state(firings_at_watermark=2, last_fired_at=now - timedelta(seconds=FEEDBACK_RETRY_S))
    assert due_slot(eager, now, later).key == "feedback:41:2"  # type: ignore[union-attr]
    assert due_slot(eager, at("2026-12-03T09:15:00+00:00"), state()) is None  # quiet hours


@pytest.mark.parametrize(
    ("timing", "param"),
    [
        (Timing(kind="weekly"), "kind"),
        (Timing(kind="cron"), "cron"),
        (Timing(kind="cron", cron="61 * * * *"), "cron"),
        (Timing(kind="cron", cron="* * * * * *"), "cron"),
        (Timing(kind="cron", cron="0 3 * * *", interval_s=60), "interval_s"),
        (Timing(kind="cron", cron="0 0 31 2 *"), "cron"),
        (Timing(kind="interval"), "interval_s"),
        (Timing(kind="interval", interval_s=0), "interval_s"),
        (Timing(kind="interval", interval_s=60, min_feedback=3), "min_feedback"),
        (Timing(kind="feedback"), "min_feedback"),
        (Timing(kind="feedback", min_feedback=0), "min_feedback"),
        (Timing(kind="feedback", min_feedback=3, cron="0 3 * * *"), "cron"),
        (Timing(kind="interval", interval_s=60, quiet_start="22:00"), "quiet_end"),
        (Timing(kind="interval", interval_s=60, quiet_end="06:00"), "quiet_start"),
        (Timing(kind="interval", interval_s=60, quiet_start="24:00", quiet_end="06:00"), "quiet_start"),
        (Timing(kind="interval", interval_s=60, quiet_start="22:00", quiet_end="6:00"), "quiet_end"),
        (Timing(kind="interval", interval_s=60, quiet_start="22:00", quiet_end="22:00"), "quiet_end"),
        (Timing(kind="interval", interval_s=60, timezone="Mars/Olympus"), "timezone"),
        (Timing(kind="interval", interval_s=60, timezone="../etc/passwd"), "timezone"),
        # Every slot inside the quiet hours: it would never fire.
        (Timing(kind="cron", cron="0 23 * * *", quiet_start="22:00", quiet_end="06:00"), "quiet_start"),
    ],
)
def test_invalid_timings_name_the_field(timing: Timing, param: str) -> None:
    with pytest.raises(TimingError) as caught:
        check_timing(timing, now=CREATED)
    assert caught.value.param == param, caught.value.message


@pytest.mark.parametrize(
    "timing",
    [
        Timing(kind="cron", cron="*/5 9-17 * * 1-5", timezone="Asia/Tokyo"),
        Timing(kind="cron", cron="@daily", quiet_start="01:00", quiet_end="23:00"),
        Timing(kind="interval", interval_s=1),
        Timing(kind="feedback", min_feedback=1),
        Timing(kind="feedback", min_feedback=8, interval_s=60, quiet_start="08:00", quiet_end="20:00"),
    ],
)
def test_valid_timings_pass(timing: Timing) -> None:
    check_timing(timing, now=CREATED)
