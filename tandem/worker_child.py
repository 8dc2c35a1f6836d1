"""`tandem serve`'s embedded learner: one `tandem worker --beat` child for the gateway's lifetime.

With ``learner = "embedded"`` (the default) serve starts the worker once the gateway's startup is
done and stops it when serve exits, whether on Ctrl+C or SIGTERM (uvicorn runs the lifespan's
shutdown for both). The child leads its own process group, so stopping it also stops its beat
process and any training child; it also watches serve's pid and takes its group down if serve
vanishes without a shutdown (SIGKILL).

The child talks to the gateway with the admin key. When none is configured, serve makes a random
internal key for this process lifetime: the gateway accepts it as admin (``internal_admin_key``) without
leaving the keyless quick start, and the child receives it in its environment only (never on its
command line, which other users can read, and never logged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI
from pydantic import SecretStr

from tandem.settings import Settings

__all__ = ["WorkerChild", "attach_worker_child", "with_internal_key"]

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


def with_internal_key(settings: Settings) -> Settings:
    """``settings`` with a fresh internal admin key for this run when no admin key is configured (the
    embedded worker's key, and the login the dashboard link carries: ``tandem.dashboard_link``)."""
    if settings.server.admin_key is not None:
        return settings
    return settings.with_overrides(internal_admin_key=SecretStr(secrets.token_urlsafe(32)))


def attach_worker_child(api: FastAPI, settings: Settings) -> None:
    """Run a worker child while ``api`` serves (after its startup, stopped before its shutdown)."""
    if settings.learner.mode != "embedded":
        return
    serve = api.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        async with serve(app) as state:
            child = WorkerChild.start(settings)
            try:
                yield state
            finally:
                await asyncio.to_thread(child.stop)

    api.router.lifespan_context = lifespan


class WorkerChild:
    """A `tandem worker --beat` process in its own process group."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @classmethod
    def start(cls, settings: Settings) -> WorkerChild:
        key = settings.server.admin_key or settings.server.internal_admin_key
        if key is None:
            raise ValueError("the worker child needs the admin key or an internal key (with_internal_key)")
        env = {
            **os.environ,
            # What serve resolved, CLI flags included, so both learn from the same data.
            "TANDEM_DATA_DIR": str(settings.storage.data_dir),
            "TANDEM_DATABASE_URL": settings.resolved_database_url,
            "TANDEM_ADMIN_KEY": key.get_secret_value(),
            "TANDEM_LOG_LEVEL": settings.observability.log_level,
            "TANDEM_LOG_FORMAT": settings.observability.log_format,
        }
        command = [sys.executable, "-m", "tandem.cli", "worker", "--beat", "--server", settings.local_server_url]
        command += ["--parent-pid", str(os.getpid())]
        popen = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("learner worker child started", extra={"pid": popen.pid, "server": settings.local_server_url})
        return cls(popen)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the child's group, then SIGKILL it after ``grace_s``; a round cut short goes stale
        and is failed by the next worker (its feedback stays unconsumed)."""
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)
        # Beat and a training child may outlive the worker itself: the group goes in any case.
        self._signal_group(signal.SIGKILL)
        self.popen.wait()
        log.info("learner worker child stopped", extra={"pid": self.popen.pid, "returncode": self.popen.returncode})

    def _signal_group(self, signum: int) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signum)
