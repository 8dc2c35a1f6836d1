"""``slime.utils.misc``: ``load_function`` by dotted path, tandem's (``learner.plugins``)."""

from learner.plugins import load_function

__all__ = ["load_function"]
