"""Journal lines: one kind byte, the record as orjson, a newline (orjson never emits a raw newline)."""

from __future__ import annotations

from typing import Any

import orjson

from storage.records import ChoiceRecord, CompletionRecord, FeedbackRecord, WeightSpan

Record = CompletionRecord | FeedbackRecord

_COMPLETION = b"C"
_FEEDBACK = b"F"


class CorruptLine(ValueError):
    """A complete journal line that does not decode to a record."""


def encode_completion(rec: CompletionRecord) -> bytes:
    return _COMPLETION + orjson.dumps(rec) + b"\n"


def encode_feedback(rec: FeedbackRecord) -> bytes:
    return _FEEDBACK + orjson.dumps(rec) + b"\n"


def decode(line: bytes) -> Record:
    """The record in one line (without its newline)."""
    kind, body = line[:1], line[1:]
    try:
        fields: dict[str, Any] = orjson.loads(body)
        if kind == _COMPLETION:
            fields["choices"] = [_choice(choice) for choice in fields["choices"]]
            return CompletionRecord(**fields)
        if kind == _FEEDBACK:
            return FeedbackRecord(**fields)
    except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
        raise CorruptLine(f"undecodable journal line: {exc}") from exc
    raise CorruptLine(f"unknown journal record kind {kind!r}")


def _choice(fields: dict[str, Any]) -> ChoiceRecord:
    fields["weight_versions"] = [WeightSpan(**span) for span in fields["weight_versions"]]
    return ChoiceRecord(**fields)
