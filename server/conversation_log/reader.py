"""The read side of the journal: records in journal order from a position, in batches.

A segment is final once a later segment exists (the writer never goes back). Only then is a last
line without its newline known to be torn (a crash mid-write) and skipped; in the live segment it
may still be being written, so it is left for the next read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from server.conversation_log.lines import CorruptLine, Record, decode
from server.conversation_log.segments import Position, segment_numbers, segment_path

logger = logging.getLogger("tandem.log")

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    record: Record
    line: bytes


@dataclass(frozen=True, slots=True)
class Batch:
    entries: list[Entry]
    end: Position


def read_batch(directory: Path, start: Position, max_records: int) -> Batch:
    """Up to ``max_records`` complete records from ``start``; ``end`` is where the next read begins."""
    entries: list[Entry] = []
    position = _existing_from(directory, start)
    while position is not None and len(entries) < max_records:
        later = _later_segment(directory, position.segment)  # checked before reading: see module doc
        offset, at_eof, tail = _read_lines(directory, position, max_records - len(entries), entries)
        position = Position(position.segment, offset)
        if not at_eof or later is None:
            break
        if tail:
            logger.warning("skipping a torn last line (%d bytes) in journal segment %d", tail, position.segment)
        position = Position(later, 0)
    return Batch(entries, position or start)


def _existing_from(directory: Path, start: Position) -> Position | None:
    """``start``, or the first segment after it if its segment is gone (deleted once committed)."""
    if segment_path(directory, start.segment).exists():
        return start
    later = _later_segment(directory, start.segment)
    return Position(later, 0) if later is not None else None


def _later_segment(directory: Path, segment: int) -> int | None:
    return next((n for n in segment_numbers(directory) if n > segment), None)


def _read_lines(directory: Path, position: Position, limit: int, into: list[Entry]) -> tuple[int, bool, int]:
    """Append up to ``limit`` entries; returns (new offset, reached end of file, bytes of a partial tail)."""
    offset = position.offset
    with segment_path(directory, position.segment).open("rb") as file:
        file.seek(offset)
        pending = b""
        while limit > 0:
            chunk = file.read(_CHUNK_BYTES)
            if not chunk:
                return offset, True, len(pending)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if limit == 0:
                    return offset, False, 0
                offset += len(line) + 1
                try:
                    into.append(Entry(decode(line), line))
                except CorruptLine as exc:
                    logger.error("skipping a corrupt line in journal segment %d: %s", position.segment, exc)
                    continue
                limit -= 1
    return offset, False, 0
