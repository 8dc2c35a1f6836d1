"""When a training schedule fires: the slot due now, the next firing time, and what a valid timing is.

Pure functions of a schedule's timing and ``now`` (and, for the feedback kind, of what the database
says about the model's feedback), so every beat process computes the same slots:

- ``cron``: a 5-field cron expression (or ``@hourly``, ``@daily``...) in the schedule's timezone.
- ``interval``: every ``interval_s`` seconds, at multiples of it since the Unix epoch.
- ``feedback``: when at least ``min_feedback`` rated answers arrived since the model's watermark, no
  round of the model is queued or running, and (``interval_s`` set) at least that long since the
  schedule last fired. The slot names the watermark and how often the schedule already fired at it,
  so beats that read the same database name the same slot; a firing whose round failed (the
  watermark stays) is retried ``FEEDBACK_RETRY_S`` later.

Missed firings do not pile up: only the latest slot at or before ``now`` is ever due, so a beat back
after a long outage fires once. A slot from before the schedule's last edit never fires (an edit, or
enabling it again, does not fire a slot that passed meanwhile). Quiet hours ("HH:MM" to "HH:MM" in
the schedule's timezone, across midnight when the start is later than the end) skip every slot
inside them, and nothing fires while they last.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from storage.times import from_unix

__all__ = [
    "FEEDBACK_RETRY_S",
    "KIND_FIELDS",
    "TIMING_FIELDS",
    "USED_BY",
    "FeedbackState",
    "ScheduleKind",
    "Slot",
    "Timing",
    "TimingError",
    "check_timing",
    "due_slot",
    "in_quiet_hours",
    "next_fire_at",
]

ScheduleKind = Literal["cron", "interval", "feedback"]
FEEDBACK_RETRY_S = 60.0  # a feedback firing whose round failed or never ran is repeated after this
MAX_SCAN = 1000  # slots looked at past quiet hours before deciding that a schedule never fires
MIN_TASK_TTL_S = 1.0
_HH_MM = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")
KIND_FIELDS = ("cron", "interval_s", "min_feedback")  # the fields that only some kinds use
USED_BY: dict[str, tuple[str, ...]] = {"cron": ("cron",), "interval": ("interval_s",), "feedback": KIND_FIELDS[1:]}
TIMING_FIELDS = ("kind", *KIND_FIELDS, "quiet_start", "quiet_end", "timezone")


class TimingError(ValueError):
    """A schedule's timing is invalid; ``param`` names the field to fix."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True, slots=True)
class Timing:
    """The fields that decide when a schedule fires; ``since``: its last edit (no earlier slot fires)."""

    kind: str
    cron: str | None = None
    interval_s: int | None = None
    min_feedback: int | None = None
    quiet_start: str | None = None
    quiet_end: str | None = None
    timezone: str = "UTC"
    since: datetime = datetime(1970, 1, 1, tzinfo=UTC)

    @classmethod
    def of(cls, schedule: Any) -> Timing:
        """The timing of a stored schedule (``storage.schedules.ScheduleView``)."""
        return cls(**{name: getattr(schedule, name) for name in TIMING_FIELDS}, since=schedule.updated_at)


@dataclass(frozen=True, slots=True)
class FeedbackState:
    """What a feedback schedule's due check reads from the database, for the serving model."""

    watermark: int  # the model's last succeeded round consumed feedback up to here
    new_feedback: int  # rated answers since the watermark
    round_active: bool  # a round of the model is queued or running
    firings_at_watermark: int  # how often this schedule already fired at this watermark
    last_fired_at: datetime | None  # this schedule's latest firing, any kind of slot


@dataclass(frozen=True, slots=True)
class Slot:
    """A firing: its claim key, its time, and when its task goes stale (the next firing may come)."""

    key: str
    at: datetime
    expires_at: datetime


def check_timing(timing: Timing, *, now: datetime) -> None:
    """Refuse a timing that is invalid or can never fire.

    Raises:
        TimingError: the first problem, with the field it is about.
    """
    if timing.kind not in get_args(ScheduleKind):
        raise TimingError("kind", f"kind must be one of {', '.join(get_args(ScheduleKind))}, not {timing.kind!r}.")
    for name in KIND_FIELDS:
        if getattr(timing, name) is not None and name not in USED_BY[timing.kind]:
            raise TimingError(name, f"{name} does not apply to a {timing.kind} schedule; leave it out.")
    _check_kind(timing)
    _check_quiet_hours(timing)
    try:
        ZoneInfo(timing.timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise TimingError("timezone", f"Unknown timezone {timing.timezone!r}: use an IANA name like 'UTC'.") from exc
    if timing.kind != "feedback" and next_fire_at(timing, now) is None:
        param = "quiet_start" if timing.quiet_start else timing.kind if timing.kind == "cron" else "interval_s"
        raise TimingError(
            param, "This schedule would never fire: every slot falls inside the quiet hours or none exists."
        )


def _check_kind(timing: Timing) -> None:
    if timing.kind == "cron":
        expression = (timing.cron or "").strip()
        fields = expression.split()
        if not ((len(fields) == 5 or expression.startswith("@")) and croniter.is_valid(expression)):
            raise TimingError("cron", f"{timing.cron!r} is not a cron expression like '0 3 * * *' (5 fields).")
    if timing.kind == "interval" and timing.interval_s is None:
        raise TimingError("interval_s", "An interval schedule needs interval_s (seconds, at least 1).")
    if timing.kind == "feedback" and timing.min_feedback is None:
        raise TimingError("min_feedback", "A feedback schedule needs min_feedback (rated answers, at least 1).")
    for name in ("interval_s", "min_feedback"):
        value = getattr(timing, name)
        if value is not None and value < 1:
            raise TimingError(name, f"{name} must be at least 1, not {value}.")


def _check_quiet_hours(timing: Timing) -> None:
    start, end = timing.quiet_start, timing.quiet_end
    if (start is None) != (end is None):
        raise TimingError("quiet_end" if end is None else "quiet_start", "Set quiet_start and quiet_end together.")
    for name, value in (("quiet_start", start), ("quiet_end", end)):
        if value is not None and not _HH_MM.match(value):
            raise TimingError(name, f"{name} must be a time of day as HH:MM (00:00 to 23:59), not {value!r}.")
    if start is not None and start == end:
        raise TimingError("quiet_end", "quiet_end must differ from quiet_start.")


def due_slot(timing: Timing, now: datetime, feedback: FeedbackState | None = None) -> Slot | None:
    """The slot to fire now, or None. ``feedback`` is required for the feedback kind."""
    if in_quiet_hours(timing, now):
        return None
    if timing.kind == "feedback":
        if feedback is None:
            raise ValueError("a feedback schedule's due check needs the model's FeedbackState")
        return _feedback_slot(timing, now, feedback)
    at = _latest_slot(timing, now)
    if at is None or at < timing.since or in_quiet_hours(timing, at):
        return None
    # Stale once the next slot is due (a late firing's too), and never before it could be sent.
    following = _slot_after(timing, now) or now + timedelta(days=366)
    expires_at = max(following, now + timedelta(seconds=MIN_TASK_TTL_S))
    return Slot(key=at.strftime("%Y-%m-%dT%H:%M:%SZ"), at=at, expires_at=expires_at)


def _feedback_slot(timing: Timing, now: datetime, state: FeedbackState) -> Slot | None:
    if state.new_feedback < (timing.min_feedback or 1) or state.round_active:
        return None
    spacing = float(timing.interval_s or 0)
    gap = max(spacing, FEEDBACK_RETRY_S) if state.firings_at_watermark else spacing
    if state.last_fired_at is not None and (now - state.last_fired_at).total_seconds() < gap:
        return None
    key = f"feedback:{state.watermark}:{state.firings_at_watermark}"
    return Slot(key=key, at=now, expires_at=now + timedelta(seconds=max(spacing, FEEDBACK_RETRY_S)))


def next_fire_at(timing: Timing, now: datetime) -> datetime | None:
    """The next slot after ``now`` outside quiet hours; None for the feedback kind (it fires on
    feedback, not at a time) and for a schedule that never fires."""
    if timing.kind == "feedback":
        return None
    after = now
    for _ in range(MAX_SCAN):
        at = _slot_after(timing, max(after, timing.since - timedelta(microseconds=1)))
        if at is None:
            return None
        if not in_quiet_hours(timing, at):
            return at
        after = _quiet_end_after(timing, at) - timedelta(microseconds=1)  # a slot right at the end is not quiet
    return None


def in_quiet_hours(timing: Timing, at: datetime) -> bool:
    """Whether ``at`` falls inside the schedule's quiet hours (start included, end excluded)."""
    if timing.quiet_start is None or timing.quiet_end is None:
        return False
    local = at.astimezone(ZoneInfo(timing.timezone)).time()
    start, end = _time_of_day(timing.quiet_start), _time_of_day(timing.quiet_end)
    if start < end:
        return start <= local < end
    return local >= start or local < end  # the window crosses midnight


def _quiet_end_after(timing: Timing, at: datetime) -> datetime:
    zone = ZoneInfo(timing.timezone)
    local = at.astimezone(zone)
    end = _time_of_day(timing.quiet_end or "00:00")
    candidate = datetime.combine(local.date(), end, tzinfo=zone)
    if candidate <= at:
        candidate = datetime.combine(local.date() + timedelta(days=1), end, tzinfo=zone)
    return candidate.astimezone(UTC)


def _time_of_day(value: str) -> time:
    hours, minutes = value.split(":")
    return time(int(hours), int(minutes))


def _latest_slot(timing: Timing, now: datetime) -> datetime | None:
    """The latest slot at or before ``now``."""
    if timing.kind == "interval":
        every = _interval(timing)
        return from_unix(math.floor(now.timestamp() / every) * every)
    try:  # croniter's previous match is strictly earlier than its start
        found = _cron(timing, now + timedelta(microseconds=1)).get_prev(datetime)
    except CroniterBadDateError:  # an expression that matches no date (February 31st)
        return None
    return found.astimezone(UTC)


def _slot_after(timing: Timing, after: datetime) -> datetime | None:
    """The first slot strictly after ``after``."""
    if timing.kind == "interval":
        every = _interval(timing)
        return from_unix((math.floor(after.timestamp() / every) + 1) * every)
    try:
        return _cron(timing, after).get_next(datetime).astimezone(UTC)
    except CroniterBadDateError:
        return None


def _interval(timing: Timing) -> int:
    if timing.interval_s is None or timing.interval_s < 1:
        raise ValueError("an interval schedule needs interval_s >= 1")
    return timing.interval_s


def _cron(timing: Timing, start: datetime) -> croniter:
    # In the schedule's timezone, so "0 3 * * *" is 3 o'clock there, summer and winter.
    return croniter(timing.cron or "", start.astimezone(ZoneInfo(timing.timezone)))
