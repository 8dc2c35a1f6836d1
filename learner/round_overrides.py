"""A schedule's round settings: overrides of the learner's ``TANDEM_LEARN_*`` settings for the rounds it fires.

The keys are the learner settings' names (``settings.learner.learning_rate``, ``reward``,
``samples_per_prompt``, ``kl_coef``...: the ``learn_*`` flat names without the prefix), less the few
that decide when or where rounds run rather than how (``NOT_ROUND_SETTINGS``), so a new learner setting
is a schedule setting at once. Values are
checked by Settings' own validators, and the result by building the round's config through
``learner.round_settings.round_config`` as a worker will (a reward plugin path must load, a custom
reward needs its path...). A worker applies them on top of its own settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from learner.plugins import PluginError
from learner.round_settings import round_config
from tandem.settings import LearnerSettings, Settings

__all__ = ["ROUND_SETTINGS", "RoundSettingsError", "check_round_settings", "with_round_settings"]

PREFIX = "learn_"
# When rounds run (the default schedule's knobs, beat's tick), the worker machine's threads, and a
# fault injection for tests: not a round's settings.
NOT_ROUND_SETTINGS = frozenset({"check_interval_s", "min_feedback", "min_interval_s", "threads"})
ROUND_SETTINGS = tuple(
    sorted(
        name
        for name, info in LearnerSettings.model_fields.items()
        if (info.serialization_alias or "").startswith(PREFIX) and name not in NOT_ROUND_SETTINGS
    )
)


class RoundSettingsError(ValueError):
    """Round settings that cannot be used; ``param`` names the key (``round_settings.<key>``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def with_round_settings(settings: Settings, overrides: Mapping[str, Any]) -> Settings:
    """``settings`` with ``overrides`` applied.

    Raises:
        RoundSettingsError: an unknown key, or a value the setting refuses.
    """
    for key in overrides:
        if key not in ROUND_SETTINGS:
            raise RoundSettingsError(
                f"round_settings.{key}", f"Unknown round setting {key!r}; known: {', '.join(ROUND_SETTINGS)}."
            )
    if not overrides:
        return settings
    try:
        return settings.with_overrides(**{PREFIX + key: value for key, value in overrides.items()})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][-1]).removeprefix(PREFIX) if first["loc"] else ""
        key = field if field in overrides else next(iter(overrides))
        raise RoundSettingsError(f"round_settings.{key}", f"round_settings.{key}: {first['msg']}.") from exc


def check_round_settings(settings: Settings, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides, checked as a worker with ``settings`` would use them, as JSON values to store.

    Raises:
        RoundSettingsError: as ``with_round_settings``, or the round config they make is refused.
    """
    applied = with_round_settings(settings, overrides)
    try:
        # The URL and key only have to look right: nothing is contacted.
        round_config(applied, server_url=applied.local_server_url, admin_key="check", trigger="schedule")
    except (ValueError, PluginError) as exc:
        raise RoundSettingsError("round_settings", f"These round settings make an invalid round: {exc}") from exc
    dumped = applied.learner.model_dump(mode="json")
    return {key: dumped[key] for key in overrides}
