"""Engine and session setup for SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 5000
POSTGRES_CONNECT_TIMEOUT_S = 10
# A peer that vanished (host down, network cut) is noticed within ~10-25 s instead of the kernel's
# ~15 minutes: unacknowledged writes give up after TCP_USER_TIMEOUT, idle sockets are probed.
POSTGRES_SOCKET_OPTIONS = {
    "tcp_user_timeout": 10_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def normalize_url(url: str) -> str:
    """Point plain ``postgresql://`` URLs at psycopg 3 instead of SQLAlchemy's psycopg2 default."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(
    url: str,
    *,
    sqlite_busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
    sqlite_sync_every_commit: bool = True,
    statement_timeout_s: float = 0,
    **kwargs: Any,
) -> Engine:
    """An engine with the pragmas and driver tandem relies on; extra kwargs go to ``create_engine``.

    ``sqlite_sync_every_commit=False`` (WAL with synchronous=NORMAL) keeps commits durable across
    process crashes but not power loss; the conversation log uses it when its journal is not fsynced
    per record either, which removes an fsync from every batch. ``statement_timeout_s`` (PostgreSQL)
    makes the server cancel a statement that runs longer, e.g. one stuck behind a lock; 0: no limit.
    """
    url = normalize_url(url)
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        engine = create_engine(url, **kwargs)
        _configure_sqlite(engine, sqlite_busy_timeout_ms, "FULL" if sqlite_sync_every_commit else "NORMAL")
        return engine
    if backend == "postgresql":
        connect_args: dict[str, Any] = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S, **POSTGRES_SOCKET_OPTIONS}
        if statement_timeout_s:
            connect_args["options"] = f"-c statement_timeout={int(statement_timeout_s * 1000)}"
        connect_args.update(kwargs.pop("connect_args", {}))
        return create_engine(url, pool_pre_ping=True, connect_args=connect_args, **kwargs)
    raise ValueError(f"unsupported database {backend!r}: use sqlite:/// or postgresql://")


def _configure_sqlite(engine: Engine, busy_timeout_ms: int, synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # pysqlite's own transaction handling skips BEGIN before SELECTs, so a read-then-write
        # transaction would not be atomic; take over and emit BEGIN ourselves (see "begin" below).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # IMMEDIATE takes the write lock up front, waiting up to busy_timeout for it. A deferred
        # transaction that reads and then writes fails at once ("database is locked") when another
        # connection committed since its read: WAL cannot upgrade a stale snapshot, and SQLite does not
        # call the busy handler for that. Every transaction, reads included, now takes the lock in
        # turn: an embedded single-node database can afford that; PostgreSQL is the one to scale.
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
