"""The database goes away for real (a cut TCP proxy, a held SQLite lock, a SIGKILLed gateway)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from migrations.migrate import upgrade
from server.conversation_log import ConversationLog
from storage.db import make_engine, make_session_factory
from storage.models import Completion
from tests.fixtures.tcp_proxy import TcpProxy
from tests.storage.factories import completion, new_tenant
from tests.support.polling import async_wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def _stored(url: str, tenant: str) -> int:
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session:
            count = select(func.count()).select_from(Completion).where(Completion.tenant_id == tenant)
            return session.scalar(count) or 0
    finally:
        engine.dispose()


async def _record_while_down(log: ConversationLog, tenant: str, n: int) -> None:
    started = time.perf_counter()
    for _ in range(n):
        await log.record_completion(completion(tenant, tokens=20))
    assert time.perf_counter() - started < 3.0, "recording must not wait for the database"
    assert not await log.flush(0.5)
    # The flusher's first failed write marks the database unavailable; on a loaded machine it may not
    # have tried yet when the flush above gave up.
    await async_wait_until(lambda: not log.db_available, timeout_s=30, what="the database is marked unavailable")
    assert log.backlog() == n


@pytest.mark.postgres
async def test_postgres_down_then_back(postgres_url: str, tmp_path: Path) -> None:
    upgrade(postgres_url)
    proxy = TcpProxy("127.0.0.1", 5432)
    proxy.start()
    proxied = make_url(postgres_url).set(port=proxy.port).render_as_string(hide_password=False)
    log = ConversationLog(proxied, tmp_path / "journal", flush_interval_s=0.01, retry_initial_s=0.02, retry_max_s=0.2)
    await log.start()
    tenant = new_tenant()
    try:
        for _ in range(3):
            await log.record_completion(completion(tenant, tokens=20))
        assert await log.flush(10)

        proxy.stop()
        await _record_while_down(log, tenant, 10)
        assert _stored(postgres_url, tenant) == 3

        proxy.start()
        assert await log.flush(20)
        assert log.db_available and log.backlog() == 0
        assert _stored(postgres_url, tenant) == 13
    finally:
        proxy.stop()
        await log.close(timeout_s=1)


async def test_sqlite_locked_then_released(sqlite_url: str, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url, sqlite_busy_timeout_ms=20)
    log = ConversationLog(engine, tmp_path / "journal", flush_interval_s=0.01, retry_initial_s=0.02, retry_max_s=0.1)
    await log.start()
    tenant = new_tenant()
    blocker = sqlite3.connect(make_url(sqlite_url).database or "", isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        await _record_while_down(log, tenant, 10)
        blocker.execute("ROLLBACK")
        assert await log.flush(10)
        assert log.db_available
        assert _stored(sqlite_url, tenant) == 10
    finally:
        blocker.close()
        await log.close(timeout_s=1)
        engine.dispose()


CHILD = """
import asyncio, sys
from server.conversation_log import ConversationLog
from tests.storage.factories import completion

async def main() -> None:
    journal, count, tenant = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    log = ConversationLog("postgresql://postgres@127.0.0.1:1/unreachable", journal, retry_initial_s=0.05)
    await log.start()
    for _ in range(count):
        await log.record_completion(completion(tenant, tokens=30))
    print("journaled", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_sigkill_right_after_answering_loses_nothing(database_url: str, tmp_path: Path) -> None:
    journal, tenant, count = tmp_path / "journal", new_tenant(), 25
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(journal), str(count), tenant],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)  # type: ignore[union-attr]
        assert line.strip() == "journaled"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    for _ in range(2):  # a second replay must not store anything twice
        log = ConversationLog(database_url, journal)
        await log.start()
        assert await log.flush(20)
        await log.close()
        assert _stored(database_url, tenant) == count
