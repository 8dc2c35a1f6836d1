"""Incremental detokenization: text deltas for a growing list of token ids.

Byte-level BPE splits multi-byte characters across tokens, so a delta is only emitted once it
decodes to whole characters; decoding a short window (not the whole output) keeps each step O(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    # transformers types decode's result as str | list[str]; one sequence of ids gives one string.
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def decode_text(tokenizer: Decoder, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """The text of one sequence of token ids."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"decode gave {type(text).__name__} for one sequence of ids")
    return text


# Tokens decoded before the unread ones, so that merges and leading spaces come out right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return decode_text(self._tokenizer, ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty while a character is split)."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text of any tokens still held back (an incomplete character at the end)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :]
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
