"""``slime.utils.types``: the ``Sample`` plugins read and write is tandem's (``learner.sample``)."""

from learner.sample import Sample

__all__ = ["Sample"]
