"""`tandem serve` prints the dashboard's address once the gateway is up.

Without TANDEM_ADMIN_KEY the link carries this run's internal admin key in its fragment (as notebook
servers print a tokenised link): the page signs in with it and drops it from the address bar, and a
fragment is never sent to the server, so the key reaches no access log. The key lives as long as the
process; set TANDEM_ADMIN_KEY for one that lasts. It is printed to the terminal only, never logged.
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TextIO
from urllib.parse import quote

from fastapi import FastAPI

from tandem.settings import Settings

__all__ = ["announce_dashboard", "dashboard_url"]


def dashboard_url(settings: Settings) -> str:
    """Where to open the dashboard from this machine, with the run's login when there is one."""
    host = settings.server.host
    if host in ("0.0.0.0", "::", ""):  # every interface: loopback is one of them
        host = "127.0.0.1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a name
    url = f"http://{host}:{settings.server.port}/admin/ui"
    internal = settings.server.internal_admin_key
    if settings.server.admin_key is None and internal is not None:
        url += f"#key={quote(internal.get_secret_value(), safe='')}"
    return url


def announce_dashboard(api: FastAPI, settings: Settings, out: TextIO = sys.stderr) -> None:
    """Print the dashboard link once ``api`` has started (the engine loaded, the port about to open)."""
    serve = api.router.lifespan_context
    if settings.server.admin_key is None:
        how = "the link signs you in as admin for this run; set TANDEM_ADMIN_KEY for a key that lasts"
    else:
        how = "sign in with TANDEM_ADMIN_KEY"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        async with serve(app) as state:
            print(f"\n  Dashboard: {dashboard_url(settings)}\n  ({how})\n", file=out, flush=True)
            yield state

    api.router.lifespan_context = lifespan
