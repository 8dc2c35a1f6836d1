"""One member of an engine pool and what the pool knows about it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from server.engines.sglang_client import SGLangClient

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Replica:
    """A server speaking SGLang's native API (real SGLang or `tandem engine`).

    ``healthy``: answering its health probes; an unhealthy replica gets no traffic until it passes
    ``healthy_after`` probes in a row and serves the pool's weights again.
    ``draining``: alive but being paused (weight update); new requests avoid it while any other
    replica can take them, and its probes are skipped (SGLang's health generate waits behind a pause).
    ``drained``: taken out of rotation by an operator (POST /admin/engines/{name}/drain): it finishes
    what it has, gets no new requests while another replica can take them, and is still probed.
    """

    name: str
    client: SGLangClient
    healthy: bool = False
    draining: bool = False
    drained: bool = False
    in_flight: int = 0
    passed_probes: int = 0
    ejected: asyncio.Event = field(default_factory=asyncio.Event)  # set while out of rotation

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.draining and not self.drained

    def admit(self) -> None:
        """Back in rotation (it passed its probes and serves the pool's weights)."""
        self.healthy = True
        self.ejected.clear()

    def eject(self, reason: str) -> None:
        """Out of rotation until it passes its probes again; buffered requests on it move elsewhere."""
        self.healthy = False
        self.passed_probes = 0
        self.ejected.set()
        log.warning("engine replica out of rotation", extra={"replica": self.name, "reason": reason})
