"""The list envelope every admin listing answers with: one page, newest first, and its cursor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Query

Limit = Annotated[int, Query(ge=1, le=500, description="Page size.")]


def page(items: Sequence[Any], limit: int, cursor: Any) -> dict[str, Any]:
    """``items`` holds up to ``limit + 1`` rows: the extra one only says there is another page."""
    shown = list(items[:limit])
    more = len(items) > limit
    return {"object": "list", "data": shown, "has_more": more, "next_before": cursor(shown[-1]) if more else None}
