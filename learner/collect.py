"""Rated feedback from storage as learner ``Sample``s (storage knows nothing of the learner)."""

from __future__ import annotations

from collections.abc import Iterable

from learner.sample import Sample, SampleStatus, scored_temperature
from storage.feedback_collect import FeedbackItem

__all__ = ["feedback_sample", "feedback_samples", "learnable"]


def feedback_samples(items: Iterable[FeedbackItem]) -> list[Sample]:
    """One sample per rated choice; choices answering the same prompt share a ``group_index``.

    ``reward`` stays None: ``learner.rewards`` maps the feedback (kept in ``metadata["feedback"]``).
    """
    groups: dict[tuple[int, ...], int] = {}
    samples = []
    for index, item in enumerate(items):
        # Same prompt tokens, same question: several rated answers to it form a real group.
        group = groups.setdefault(tuple(item.prompt_token_ids), len(groups))
        samples.append(feedback_sample(item, index=index, group_index=group))
    return samples


def learnable(samples: Iterable[Sample], flagged: frozenset[tuple[str, str]]) -> list[Sample]:
    """The samples with an answer to learn from, less those of users an admin flagged (``(tenant, user)``)."""
    return [
        s for s in samples if s.response_length > 0 and (s.metadata.get("tenant_id"), s.user_id or "") not in flagged
    ]


def feedback_sample(item: FeedbackItem, *, index: int | None = None, group_index: int | None = None) -> Sample:
    return Sample(
        prompt_token_ids=list(item.prompt_token_ids),
        response_token_ids=list(item.response_token_ids),
        group_index=group_index,
        index=index,
        prompt=list(item.request_messages),
        response=item.response_text,
        rollout_log_probs=list(item.rollout_log_probs),
        rollout_temperature=scored_temperature(item.temperature),
        weight_versions=_versions_in_order(item),
        status=SampleStatus.TRUNCATED if item.finish_reason == "length" else SampleStatus.COMPLETED,
        user_id=item.user_id,
        session_id=item.session_id,
        completion_id=item.completion_id,
        metadata={
            "source": "feedback",
            "tenant_id": item.tenant_id,
            "choice_index": item.choice_index,
            "feedback_seq": item.seq,
            "feedback": {
                "rating": item.rating,
                "score": item.score,
                "corrected_answer": item.corrected_answer,
                "comment": item.comment,
                "revision": item.revision,
            },
        },
    )


def _versions_in_order(item: FeedbackItem) -> list[str]:
    versions: list[str] = []
    for span in sorted(item.weight_versions, key=lambda span: span.start):
        if not versions or versions[-1] != span.version:
            versions.append(span.version)
    return versions
