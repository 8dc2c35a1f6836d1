"""`tandem keys`: create, list and revoke tenant API keys."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from storage.api_keys import create_api_key, list_api_keys, revoke_api_key
from storage.db import make_engine, make_session_factory
from tandem.commands.db import DatabaseUrl, migrated_database_url

keys_app = typer.Typer(no_args_is_help=True)
console = Console()
errors = Console(stderr=True)


@keys_app.command("create")
def create_command(
    tenant: Annotated[str, typer.Option(help="Tenant name (created if new).")],
    name: Annotated[str, typer.Option(help="A label for the key.")] = "default",
    database_url: DatabaseUrl = None,
) -> None:
    """Create an API key; the key is printed once and cannot be shown again."""
    engine = make_engine(migrated_database_url(database_url, "keys"))
    try:
        with make_session_factory(engine).begin() as session:
            plaintext, key = create_api_key(session, tenant_name=tenant, name=name)
    finally:
        engine.dispose()
    console.print(f"created key [bold]{key.id}[/bold] for tenant [bold]{key.tenant_id}[/bold]; store it now:")
    console.print(plaintext, markup=False, highlight=False, soft_wrap=True)


@keys_app.command("list")
def list_command(database_url: DatabaseUrl = None) -> None:
    """List API keys (never the keys themselves)."""
    engine = make_engine(migrated_database_url(database_url, "keys"))
    try:
        with make_session_factory(engine)() as session:
            keys = list_api_keys(session)
    finally:
        engine.dispose()
    table = Table()
    for column in ("id", "tenant", "name", "prefix", "created (UTC)", "revoked (UTC)"):
        table.add_column(column, no_wrap=column in ("id", "prefix"))
    for key in keys:
        revoked = f"{key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else ""
        table.add_row(key.id, key.tenant_id, key.name, key.prefix + "…", f"{key.created_at:%Y-%m-%d %H:%M}", revoked)
    console.print(table)
    console.print(f"{len(keys)} keys, {sum(k.revoked_at is None for k in keys)} active")


@keys_app.command("revoke")
def revoke_command(
    key_id: Annotated[str, typer.Argument(help="The key id (see `tandem keys list`).")],
    database_url: DatabaseUrl = None,
) -> None:
    """Revoke an API key; requests with it are refused from now on."""
    engine = make_engine(migrated_database_url(database_url, "keys"))
    try:
        with make_session_factory(engine).begin() as session:
            key = revoke_api_key(session, key_id)
    finally:
        engine.dispose()
    if key is None:
        errors.print(f"[red]no API key with id {key_id}[/red]")
        raise typer.Exit(code=1)
    console.print(f"revoked key [bold]{key.id}[/bold] of tenant {key.tenant_id}")
