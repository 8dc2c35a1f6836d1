"""The append side of the journal: one ``os.write`` per record, fsync in a background thread.

``append`` runs on the event loop and only writes to the page cache, which survives the process
being killed. The syncer thread makes it survive power loss too: every ``fsync_interval_s``, or,
for waiters (fsync="always"), as soon as possible, with one fsync covering every record written
before it started (group commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from pathlib import Path

from server.conversation_log.segments import segment_path

logger = logging.getLogger("tandem.log")


class JournalWriteError(Exception):
    """A record could not be written to the journal (disk full, I/O error); none of it stays behind."""


class JournalWriter:
    def __init__(self, directory: Path, segment_bytes: int) -> None:
        self._directory = directory
        self._segment_bytes = segment_bytes
        self._lock = threading.Lock()  # guards the fd hand-over between the loop and the syncer
        self._fd = -1
        self._segment = 0
        self._size = 0
        self._retired: list[int] = []
        self._dir_dirty = False
        self.appended = 0

    @property
    def segment(self) -> int:
        return self._segment

    def open(self, segment: int) -> None:
        """Start writing a new segment; a segment is never appended to after a restart."""
        fd = os.open(segment_path(self._directory, segment), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        with self._lock:
            if self._fd >= 0:
                self._retired.append(self._fd)
            self._fd, self._segment, self._size = fd, segment, 0
            self._dir_dirty = True

    def append(self, line: bytes) -> int:
        """Write one line; returns its sequence number (1-based, counting from process start).

        Raises JournalWriteError if the line could not be written whole; a partly written line is
        cut off again, so the next record starts on a clean line once space returns."""
        try:
            if self._size >= self._segment_bytes:
                self.open(self._segment + 1)
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise JournalWriteError(exc.strerror or str(exc)) from exc
        self._size += len(line)
        self.appended += 1
        return self.appended

    def sync(self) -> int:
        """fsync everything appended so far; returns the sequence number now durable."""
        target = self.appended  # read before the fds: a record counted here is in one of them
        with self._lock:
            fds, retired, dir_dirty = [*self._retired, self._fd], list(self._retired), self._dir_dirty
            self._dir_dirty = False
        for fd in fds:
            os.fsync(fd)
        if dir_dirty:
            dir_fd = os.open(self._directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        with self._lock:
            self._retired = [fd for fd in self._retired if fd not in retired]
        for fd in retired:
            os.close(fd)
        return target

    def close(self) -> None:
        self.sync()
        with self._lock:
            os.close(self._fd)
            self._fd = -1


class Syncer(threading.Thread):
    def __init__(self, writer: JournalWriter, interval_s: float) -> None:
        super().__init__(name="tandem-journal-fsync", daemon=True)
        self._writer = writer
        self._interval_s = interval_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.synced = 0

    async def wait_synced(self, seq: int) -> None:
        """Return once record ``seq`` is fsynced; raises JournalWriteError if the fsync failed."""
        if self.synced >= seq:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiters.append((seq, future))
        self._wake.set()
        await future

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._writer.appended > self.synced or self._waiters:
                self._sync_once()
        if self._waiters:
            self._sync_once()  # nobody may be left waiting on a stopped syncer

    def _sync_once(self) -> None:
        error: JournalWriteError | None = None
        try:
            self.synced = self._writer.sync()
        except OSError as exc:
            logger.error("journal fsync failed: %s", exc)
            error = JournalWriteError(f"fsync failed: {exc.strerror or exc}")
        with self._lock:
            done = [(s, f) for s, f in self._waiters if error is not None or s <= self.synced]
            self._waiters = [(s, f) for s, f in self._waiters if error is None and s > self.synced]
        if done and self._loop is not None:
            self._loop.call_soon_threadsafe(_resolve, [f for _, f in done], error)


def _resolve(futures: list[asyncio.Future[None]], error: JournalWriteError | None) -> None:
    for future in futures:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
