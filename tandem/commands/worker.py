"""`tandem worker` (a learner worker of the Celery pool, learning for one server) and `tandem beat`
(the scheduler that fires the training schedules, alone)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import warnings
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from tandem.logging import configure_logging
from tandem.settings import Settings

if TYPE_CHECKING:
    from learner.celery_app import LearnerCelery

errors = Console(stderr=True)
log = logging.getLogger("tandem.worker")

BROKER_CHECK_TIMEOUT_S = 5.0
QUIET_LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace", "httpx")

Server = Annotated[
    str | None, typer.Option(help="URL of the tandem server to learn for; default: from TANDEM_HOST/TANDEM_PORT.")
]
LogLevel = Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING or ERROR [TANDEM_LOG_LEVEL].")]


def worker_command(
    server: Server = None,
    beat: Annotated[
        bool, typer.Option("--beat/--no-beat", help="Also run beat (fires the training schedules) in this worker.")
    ] = False,
    concurrency: Annotated[int, typer.Option(min=1, help="Rounds at once; a round uses the CPU fully.")] = 1,
    log_level: LogLevel = None,
    parent_pid: Annotated[int | None, typer.Option(hidden=True, help="Exit when this process is gone.")] = None,
) -> None:
    """Run a learner worker: takes `learn` tasks (and, with --beat, fires the training schedules).

    The broker is Redis when TANDEM_REDIS_URL is set, else SQLite files in the data dir. Rolling new
    weights out needs the server's admin key (TANDEM_ADMIN_KEY).
    """
    from learner.celery_app import QUEUE

    settings, app, server_url, broker = _learner_app("worker", server, log_level)
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    log.info("learner worker starting", extra={"server": server_url, "broker": broker, "beat": beat})
    _say_root_once()
    worker: Any = app.Worker(
        hostname=f"learner-{os.getpid()}@{socket.gethostname()}",
        pool="solo" if concurrency == 1 else "prefork",
        concurrency=concurrency,
        beat=beat,
        queues=[QUEUE],
        loglevel=settings.observability.log_level,
        quiet=True,
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
    )
    worker.start()
    raise typer.Exit(code=worker.exitcode or 0)


def beat_command(server: Server = None, log_level: LogLevel = None) -> None:
    """Run beat alone: fire the training schedules stored in the database (docs/schedules.md).

    Any number of beats may share a database: each slot fires once. A beat asks the server what it
    serves for feedback schedules, so it needs the admin key (TANDEM_ADMIN_KEY) like a worker.
    """
    settings, app, server_url, broker = _learner_app("beat", server, log_level)
    app.conf.include = ()  # beat sends tasks by name: importing them (torch) would only slow its start
    log.info("beat starting", extra={"server": server_url, "broker": broker})
    beat: Any = app.Beat(loglevel=settings.observability.log_level, quiet=True)
    beat.run()


def _learner_app(command: str, server: str | None, log_level: str | None) -> tuple[Settings, LearnerCelery, str, str]:
    """Settings, logging and the Celery app of a learner process, its broker checked (exit 2 otherwise)."""
    from celery.signals import setup_logging
    from kombu.exceptions import OperationalError

    from learner.celery_app import broker_urls, create_celery_app
    from tandem.commands.load_settings import load_settings

    settings = load_settings(command, log_level=log_level.upper() if log_level else None)
    # A receiver on setup_logging keeps Celery from installing its own handlers over ours.
    setup_logging.connect(lambda **_: _configure_worker_logging(settings), weak=False)
    _configure_worker_logging(settings)
    if settings.server.admin_key is None:
        errors.print(f"[red]tandem {command}: set TANDEM_ADMIN_KEY: the server's admin API needs it[/red]")
        raise typer.Exit(code=2)
    server_url = server or settings.local_server_url
    app = create_celery_app(settings, server_url=server_url)
    broker = _safe_url(broker_urls(settings)[0])
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, interval_start=0.5, timeout=BROKER_CHECK_TIMEOUT_S)
    except (OperationalError, OSError) as exc:
        errors.print(f"[red]tandem {command}: cannot reach the broker {broker}: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(code=2) from exc
    return settings, app, server_url, broker


def _say_root_once() -> None:
    """Celery's nine-line root warning is about pickle, which lets a broker message run code as root.
    This worker accepts JSON only (``learner.celery_app``): one line says what is left of the risk."""
    if os.geteuid() != 0:
        return
    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", category=SecurityWarning, message="You're running the worker with superuser")
    log.warning(
        "the learner worker runs as root; its tasks are JSON only, but a user of its own is safer in production"
    )


def _configure_worker_logging(settings: Settings) -> None:
    configure_logging(settings.observability.log_level, settings.observability.log_format)
    if settings.observability.log_level != "DEBUG":
        # Beat ticks every few seconds: its sending, receipt and HTTP calls are not news. Rounds and
        # schedule firings log their own; failures still come through.
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def _safe_url(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url))


def _exit_with_parent(parent_pid: int) -> None:
    """Kill this worker's process group (beat, training child) once ``parent_pid`` is gone.

    `tandem serve` stops its worker child on exit; this covers a serve that was SIGKILLed.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(1.0)
        log.warning("the parent process is gone; the learner worker exits", extra={"parent_pid": parent_pid})
        if os.getpgrp() == os.getpid():  # our own group (serve starts us in a new session): take it all down
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
