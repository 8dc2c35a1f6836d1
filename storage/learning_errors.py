"""Errors of the learning state (rounds and model versions)."""


class LearningStateError(RuntimeError):
    """A round or version is not in a state that allows the requested change."""


class RoundBusyError(LearningStateError):
    """Another round of the same model is running."""


class NotFoundError(LookupError):
    """No round or version with that id."""
