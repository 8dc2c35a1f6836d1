"""The background thread that moves journaled records into the database, in order, in batches.

One transaction per batch, then the checkpoint moves past it. Storing is idempotent, so a crash
between commit and checkpoint only replays stored records. While the database is away it retries
with capped exponential backoff; nothing is dropped. A record the database refuses for its content
(not for being away) is set aside in ``rejected.jsonl`` so it cannot block the records behind it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session

from server.conversation_log.reader import Batch, Entry, read_batch
from server.conversation_log.segments import Checkpoint, Position, delete_segments_before
from storage.conversation_writes import write_records
from storage.records import CompletionRecord, FeedbackRecord

logger = logging.getLogger("tandem.log")


def is_transient(exc: BaseException) -> bool:
    """Errors that mean "the database is away or not ready", not "this record is bad".

    ProgrammingError counts: a missing table is fixed by migrating, not by dropping records.
    """
    if isinstance(exc, OperationalError | InterfaceError | ProgrammingError | PoolTimeoutError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


class Flusher(threading.Thread):
    def __init__(
        self,
        *,
        engine: Engine,
        directory: Path,
        start: Position,
        batch_size: int,
        flush_interval_s: float,
        retry_initial_s: float,
        retry_max_s: float,
        on_committed: Callable[[list[Entry]], None],
    ) -> None:
        super().__init__(name="tandem-log-flusher", daemon=True)
        self._engine = engine
        self._directory = directory
        self._checkpoint = Checkpoint(directory)
        self._position = start
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._on_committed = on_committed
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.db_available = True
        self._checkpoint_failing = False

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                progressed = self._step()
            except Exception:
                logger.exception("conversation log flusher failed; retrying")
                self._stopping.wait(self._retry_max_s)
                continue
            if not progressed:
                self._wake.wait(self._flush_interval_s)
                self._wake.clear()

    def _step(self) -> bool:
        """Store and checkpoint the next batch; False if there was nothing to do."""
        batch = read_batch(self._directory, self._position, self._batch_size)
        if not batch.entries and batch.end == self._position:
            return False
        if batch.entries and not self._store_with_retry(batch.entries):
            return False
        self._advance(batch)
        return True

    def _advance(self, batch: Batch) -> None:
        try:
            self._checkpoint.save(batch.end)
        except OSError as exc:
            # A full disk must not stop the flusher (and every lookup waiting on it): a lost
            # checkpoint only replays stored records. The segments stay until one is saved.
            if not self._checkpoint_failing:
                logger.warning("journal checkpoint not saved (%s); storing goes on", exc)
            self._checkpoint_failing = True
        else:
            if self._checkpoint_failing:
                logger.info("journal checkpoint saved again")
            self._checkpoint_failing = False
            if batch.end.segment > self._position.segment:
                delete_segments_before(self._directory, batch.end.segment)
        self._position = batch.end
        self._on_committed(batch.entries)

    def _store_with_retry(self, entries: list[Entry]) -> bool:
        """Store the batch; False if asked to stop while the database was away."""
        delay = self._retry_initial_s
        while True:
            try:
                self._store(entries)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if self.db_available:
                    logger.warning("database unavailable, records stay in the journal: %s", _first_line(exc))
                self.db_available = False
                if self._stopping.is_set():
                    return False
                self._wake.wait(delay)
                self._wake.clear()
                delay = min(delay * 2, self._retry_max_s)
                continue
            if not self.db_available:
                logger.info("database available again, replaying the journal")
            self.db_available = True
            return True

    def _store(self, entries: list[Entry]) -> None:
        try:
            self._write(entries)
        except Exception as exc:
            if is_transient(exc):
                raise
            if len(entries) == 1:
                self._reject(entries[0], exc)
                return
            # Some record in the batch is refused: store one by one to set only that one aside.
            for entry in entries:
                self._store([entry])

    def _write(self, entries: list[Entry]) -> None:
        completions = [e.record for e in entries if isinstance(e.record, CompletionRecord)]
        feedback = [e.record for e in entries if isinstance(e.record, FeedbackRecord)]
        with Session(self._engine) as session, session.begin():
            result = write_records(session, completions, feedback)
        logger.debug(
            "stored %d completions, %d feedback events (%d orphaned)",
            result.completions_inserted,
            result.feedback_applied,
            result.feedback_orphaned,
        )

    def _reject(self, entry: Entry, exc: Exception) -> None:
        logger.error("the database refused a journal record; kept in rejected.jsonl: %s", _first_line(exc))
        fd = os.open(self._directory / "rejected.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, entry.line + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
