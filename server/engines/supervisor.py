"""Managed engine processes: start each planned server, restart it whenever it dies, stop them all.

A restarted server comes back with its launch weights; the engine pool readmits it only after it
passes its health probes and has loaded the pool's current weights, so it never serves a stale model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from server.engines.launch_plan import ServerLaunch

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
HEALTHY_RUN_S = 60.0  # a server that lived this long starts its restart back-off afresh


@dataclass
class ManagedServer:
    launch: ServerLaunch
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    starts: int = 0

    @property
    def name(self) -> str:
        return f"{self.launch.group}-{self.launch.index}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Supervisor:
    def __init__(
        self,
        launches: Sequence[ServerLaunch],
        log_dir: Path,
        *,
        restart_delay_s: float = 1.0,
        max_restart_delay_s: float = 30.0,
    ) -> None:
        self.servers = [ManagedServer(launch, log_dir / f"{launch.group}-{launch.index}.log") for launch in launches]
        self._log_dir = log_dir
        self._restart_delay_s = restart_delay_s
        self._max_restart_delay_s = max_restart_delay_s
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        """Spawn every server; returns at once (the pool waits for them to answer)."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        for server in self.servers:
            await self._spawn(server)
            self._tasks.append(asyncio.create_task(self._keep_alive(server), name=f"supervise-{server.name}"))

    async def _spawn(self, server: ManagedServer) -> None:
        with server.log_path.open("ab") as out:
            server.process = await asyncio.create_subprocess_exec(
                *server.launch.argv,
                env={**os.environ, **server.launch.env},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # its own process group: SGLang's children are stopped with it
            )
        server.starts += 1
        log.info(
            "engine server started",
            extra={
                "server": server.name,
                "pid": server.process.pid,
                "url": server.launch.url,
                "log": str(server.log_path),
            },
        )

    async def _keep_alive(self, server: ManagedServer) -> None:
        delay = self._restart_delay_s
        while True:
            if server.process is None:
                return
            started = time.monotonic()
            code = await server.process.wait()
            if self._stopping:
                return
            log.warning(
                "engine server died; restarting",
                extra={"server": server.name, "exit_code": code, "restart_in_s": delay, "log": str(server.log_path)},
            )
            _kill_group(server.process.pid, signal.SIGKILL)  # children that outlived their parent
            delay = self._restart_delay_s if time.monotonic() - started > HEALTHY_RUN_S else delay
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_restart_delay_s)
            if self._stopping:
                return
            await self._spawn(server)

    async def close(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace period."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        running = [s.process for s in self.servers if s.process is not None and s.process.returncode is None]
        for process in running:
            _kill_group(process.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await asyncio.gather(*(p.wait() for p in running))
        except TimeoutError:
            log.warning("engine servers ignored SIGTERM; killing them")
        for process in running:
            _kill_group(process.pid, signal.SIGKILL)
        await asyncio.gather(*(p.wait() for p in running))


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
