"""Where journal segments live: numbered append-only files, plus the flush checkpoint."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

logger = logging.getLogger("tandem.log")

_PREFIX = "segment-"
_SUFFIX = ".jsonl"


@dataclass(frozen=True, order=True, slots=True)
class Position:
    """A byte offset into a segment; everything before it is stored in the database."""

    segment: int
    offset: int


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"{_PREFIX}{number:012d}{_SUFFIX}"


def segment_numbers(directory: Path) -> list[int]:
    numbers = []
    for path in directory.glob(f"{_PREFIX}*{_SUFFIX}"):
        digits = path.name[len(_PREFIX) : -len(_SUFFIX)]
        if digits.isdigit():
            numbers.append(int(digits))
    return sorted(numbers)


def delete_segments_before(directory: Path, number: int) -> None:
    for old in segment_numbers(directory):
        if old >= number:
            break
        segment_path(directory, old).unlink(missing_ok=True)
        logger.debug("deleted committed journal segment %d", old)


class Checkpoint:
    """The flushed-up-to position, replaced atomically.

    Not fsynced on purpose: losing it only means replaying records that are already stored, and
    storing is idempotent.
    """

    def __init__(self, directory: Path) -> None:
        self._path = directory / "checkpoint.json"
        self._tmp = directory / "checkpoint.json.tmp"

    def load(self) -> Position:
        try:
            fields = orjson.loads(self._path.read_bytes())
            return Position(int(fields["segment"]), int(fields["offset"]))
        except FileNotFoundError:
            return Position(0, 0)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            logger.warning("unreadable journal checkpoint %s; replaying the whole journal", self._path)
            return Position(0, 0)

    def save(self, position: Position) -> None:
        self._tmp.write_bytes(orjson.dumps({"segment": position.segment, "offset": position.offset}))
        os.replace(self._tmp, self._path)
