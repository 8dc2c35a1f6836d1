"""Column types that store text with NUL characters on PostgreSQL, and give it back unchanged.

PostgreSQL refuses U+0000 in ``text``/``varchar`` and in JSONB strings, while models emit it (byte
tokens) and clients may send it (JSON allows ``\\u0000``). A refused record would be set aside
instead of stored, so on PostgreSQL these types escape it reversibly: U+FFFF (a noncharacter, which
PostgreSQL accepts) marks an escape, ``U+FFFF 0`` for NUL and ``U+FFFF 1`` for U+FFFF itself. Text
without either character is stored as is; SQLite stores every string as given.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import JSON, Dialect, String, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = ["NulSafeJson", "NulSafeString", "NulSafeText", "escape_nul", "unescape_nul"]

_MARK = "\uffff"
_ESCAPED = re.compile(_MARK + "([01])")


def escape_nul(text: str) -> str:
    """``text`` without U+0000; ``unescape_nul`` gives it back."""
    if "\0" not in text and _MARK not in text:
        return text
    return text.replace(_MARK, _MARK + "1").replace("\0", _MARK + "0")


def unescape_nul(text: str) -> str:
    if _MARK not in text:
        return text
    return _ESCAPED.sub(lambda match: "\0" if match[1] == "0" else _MARK, text)


def _map_strings(value: Any, convert: Any) -> Any:
    """``value`` (a JSON document) with ``convert`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return convert(value)
    if isinstance(value, list):
        return [_map_strings(item, convert) for item in value]
    if isinstance(value, dict):
        return {convert(key): _map_strings(item, convert) for key, item in value.items()}
    return value


def _on_postgres(dialect: Dialect) -> bool:
    return dialect.name == "postgresql"


class _NulSafe(TypeDecorator[Any]):
    """Escapes on the way into PostgreSQL and unescapes on the way out, through ``_map_strings``.

    Each concrete type sets ``cache_ok`` itself: SQLAlchemy reads it from the class, not its bases,
    and without it every statement using the type is compiled anew (with an SAWarning).
    """

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return _map_strings(value, escape_nul) if value is not None and _on_postgres(dialect) else value

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return _map_strings(value, unescape_nul) if value is not None and _on_postgres(dialect) else value


class NulSafeText(_NulSafe):
    impl = Text
    cache_ok = True


class NulSafeString(_NulSafe):
    """``String(length)``; an escaped string is longer by one character per NUL or U+FFFF."""

    impl = String
    cache_ok = True


class NulSafeJson(_NulSafe):
    """JSON (JSONB on PostgreSQL) whose strings, keys included, may hold NUL."""

    impl = JSON
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(JSONB() if _on_postgres(dialect) else JSON())
