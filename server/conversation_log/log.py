"""The write-behind conversation log: journal first (the request path), database later (a thread).

``record_*`` return once the record is in the journal, so a response that reached the client is
never lost: not to a database outage, not to SIGKILL. With ``fsync="always"`` they also wait for a
group-commit fsync, which survives power loss. The flusher thread stores journaled records in the
database in order and idempotently; ``start`` replays whatever an earlier process left behind.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Literal

from sqlalchemy import Engine

from server.conversation_log.flusher import Flusher
from server.conversation_log.lines import encode_completion, encode_feedback
from server.conversation_log.reader import Entry, read_batch
from server.conversation_log.segments import Checkpoint, Position, segment_numbers
from server.conversation_log.writer import JournalWriteError, JournalWriter, Syncer
from storage.db import make_engine
from storage.records import CompletionRecord, FeedbackRecord

logger = logging.getLogger("tandem.log")

FsyncMode = Literal["interval", "always"]
_SCAN_BATCH = 4096
_FLUSH_POLL_S = 0.005


class ConversationLog:
    """Args:
    database: a database URL or an engine (an engine given here is not disposed on close).
    journal_dir: where the journal lives; one process at a time (it is locked).
    fsync: "always" makes ``record_*`` wait for an fsync; "interval" fsyncs in the background.
    fsync_interval_s: at most this long between background fsyncs.
    flush_interval_s: how long the flusher waits for more records when it has caught up.
    batch_size: records per database transaction.
    segment_bytes: a journal segment is rotated once it is this large.
    retry_initial_s, retry_max_s: backoff while the database is away.
    """

    def __init__(
        self,
        database: str | Engine,
        journal_dir: Path | str,
        *,
        fsync: FsyncMode = "interval",
        fsync_interval_s: float = 0.05,
        flush_interval_s: float = 0.05,
        batch_size: int = 256,
        segment_bytes: int = 64 << 20,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 5.0,
    ) -> None:
        if fsync not in ("interval", "always"):
            raise ValueError(f"fsync must be 'interval' or 'always', not {fsync!r}")
        self._owns_engine = isinstance(database, str)
        self._engine = make_engine(database) if isinstance(database, str) else database
        self._dir = Path(journal_dir)
        self._always = fsync == "always"
        self._fsync_interval_s = fsync_interval_s
        self._flush_interval_s = flush_interval_s
        self._batch_size = batch_size
        self._retry = (retry_initial_s, retry_max_s)
        self._writer = JournalWriter(self._dir, segment_bytes)
        self._syncer: Syncer | None = None
        self._flusher: Flusher | None = None
        self._lock_fd = -1
        self._pending: dict[str, str] = {}
        self._journaled = 0
        self._committed = 0
        self._open = False

    async def start(self) -> None:
        """Open the journal and start replaying what an earlier process left uncommitted."""
        start = await asyncio.to_thread(self._open_journal)
        self._syncer = Syncer(self._writer, self._fsync_interval_s)
        self._flusher = Flusher(
            engine=self._engine,
            directory=self._dir,
            start=start,
            batch_size=self._batch_size,
            flush_interval_s=self._flush_interval_s,
            retry_initial_s=self._retry[0],
            retry_max_s=self._retry[1],
            on_committed=self._on_committed,
        )
        self._syncer.start()
        self._flusher.start()
        self._open = True
        logger.info("conversation log started: %d journaled records to replay", self._journaled)

    async def record_completion(self, rec: CompletionRecord) -> None:
        """Return once ``rec`` is journaled (and fsynced, with fsync="always")."""
        self._check_open()
        self._pending[rec.id] = rec.tenant_id
        try:
            await self._append(encode_completion(rec))
        except JournalWriteError:
            self._pending.pop(rec.id, None)
            raise

    async def record_feedback(self, rec: FeedbackRecord) -> None:
        self._check_open()
        await self._append(encode_feedback(rec))

    def pending_completion_tenant(self, completion_id: str) -> str | None:
        """The tenant of a completion journaled but not yet stored. Check this before the database:
        a completion leaves this map only after its commit, so that order cannot miss it."""
        return self._pending.get(completion_id)

    def backlog(self) -> int:
        """Records journaled and not yet committed to the database."""
        return self._journaled - self._committed

    @property
    def db_available(self) -> bool:
        return self._flusher.db_available if self._flusher is not None else False

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything journaled so far is in the database; False on timeout."""
        target = self._journaled
        # While the database is away the backoff decides when to retry, not every caller of flush.
        if self._flusher is not None and self._flusher.db_available:
            self._flusher.wake()
        deadline = time.monotonic() + timeout_s
        while self._committed < target:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_FLUSH_POLL_S)
        return True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Flush what the database takes within ``timeout_s``; the rest stays journaled for replay."""
        if not self._open:
            return
        self._open = False
        flushed = await self.flush(timeout_s)
        if self._flusher is not None:
            self._flusher.stop()
            await asyncio.to_thread(self._flusher.join, timeout_s)
        if self._syncer is not None:
            self._syncer.stop()
            await asyncio.to_thread(self._syncer.join)
        await asyncio.to_thread(self._close_journal)
        logger.info("conversation log closed: flushed=%s, %d records left in the journal", flushed, self.backlog())

    async def _append(self, line: bytes) -> None:
        seq = self._writer.append(line)
        self._journaled += 1
        if self._always and self._syncer is not None:
            await self._syncer.wait_synced(seq)

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("the conversation log is not started (or already closed)")

    def _open_journal(self) -> Position:
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"journal {self._dir} is in use by another process") from None
        existing = segment_numbers(self._dir)
        # A fresh segment first: every earlier one is then final, so a torn tail there is known torn.
        self._writer.open((existing[-1] + 1) if existing else 1)
        start = Checkpoint(self._dir).load()
        self._scan_pending(start)
        return start

    def _scan_pending(self, start: Position) -> None:
        position = start
        while True:
            batch = read_batch(self._dir, position, _SCAN_BATCH)
            for entry in batch.entries:
                if isinstance(entry.record, CompletionRecord):
                    self._pending[entry.record.id] = entry.record.tenant_id
            self._journaled += len(batch.entries)
            if batch.end == position:
                return
            position = batch.end

    def _on_committed(self, entries: list[Entry]) -> None:
        for entry in entries:
            if isinstance(entry.record, CompletionRecord):
                self._pending.pop(entry.record.id, None)
        self._committed += len(entries)

    def _close_journal(self) -> None:
        self._writer.close()
        os.close(self._lock_fd)
        if self._owns_engine:
            self._engine.dispose()
