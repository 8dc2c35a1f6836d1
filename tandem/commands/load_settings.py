"""Settings for a command: the environment and flags, checked by the rooms that use them, or exit 2.

The settings object validates its own fields; what only a room can judge (the learner's megatron
layout against its custom loss) is checked here, at start-up, by the room itself.
"""

from __future__ import annotations

import typer
from pydantic import ValidationError

from learner.round_settings import check_learner_settings
from tandem.settings import Settings


def load_settings(command: str, **overrides: object) -> Settings:
    """``Settings()`` with the flags given (None: not given); a readable refusal and exit code 2."""
    try:
        settings = Settings().with_overrides(**overrides)
        check_learner_settings(settings)
    except (ValidationError, ValueError) as exc:
        typer.secho(f"tandem {command}: invalid settings: {exc}", fg="red", err=True)
        raise typer.Exit(2) from exc
    return settings
