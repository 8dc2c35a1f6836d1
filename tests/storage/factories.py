"""Record builders shared by the storage and conversation log tests."""

from __future__ import annotations

import random
import time
import uuid

from storage.records import ChoiceRecord, CompletionRecord, FeedbackRecord, WeightSpan


def new_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def completion(
    tenant_id: str,
    *,
    tokens: int = 200,
    session_key: str | None = None,
    end_user: str | None = None,
    created_at: float | None = None,
    seed: int | None = None,
) -> CompletionRecord:
    rng = random.Random(seed)
    created = time.time() if created_at is None else created_at
    output = [rng.randrange(0, 2**31 - 1) for _ in range(tokens)]
    return CompletionRecord(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        tenant_id=tenant_id,
        model="smollm2-135m-instruct",
        request_messages=[{"role": "user", "content": "What is 2+2? ünïcode ✓"}],
        sampling_params={"temperature": 0.7, "max_tokens": tokens},
        prompt_token_ids=[rng.randrange(0, 50_000) for _ in range(tokens)],
        choices=[
            ChoiceRecord(
                index=0,
                token_ids=output,
                logprobs=[-rng.random() * 5 for _ in range(tokens)],
                text="four",
                finish_reason="stop",
                weight_versions=[WeightSpan("v1", 0, tokens // 2), WeightSpan("v2", tokens // 2, tokens)],
            )
        ],
        weight_version="v2",
        engine_replica="replica-0",
        prompt_tokens=tokens,
        cached_tokens=3,
        completion_tokens=tokens,
        latency_ms=12.5,
        ttft_ms=3.25,
        created_at=created,
        finished_at=created + 0.5,
        end_user=end_user,
        session_key=session_key,
        metadata={"source": "test"},
    )


def feedback(
    rec: CompletionRecord, *, score: float, rating: str | None = None, created_at: float | None = None
) -> FeedbackRecord:
    return FeedbackRecord(
        id=f"fb-{uuid.uuid4().hex}",
        completion_id=rec.id,
        tenant_id=rec.tenant_id,
        choice_index=0,
        score=score,
        rating=rating,  # type: ignore[arg-type]
        comment=f"score {score}",
        corrected_answer=None,
        created_at=time.time() if created_at is None else created_at,
    )
