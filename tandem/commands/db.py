"""`tandem db`: schema migrations."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from sqlalchemy.engine import make_url

from migrations.migrate import current_revision, downgrade, upgrade
from tandem.settings import Settings

db_app = typer.Typer(no_args_is_help=True)
console = Console()

DatabaseUrl = Annotated[
    str | None, typer.Option(help="SQLAlchemy URL [TANDEM_DATABASE_URL]; default: SQLite in the data dir.")
]


def resolve_database_url(database_url: str | None) -> str:
    """The URL to use, creating the folder of a SQLite file if it does not exist yet."""
    url = database_url or Settings().resolved_database_url
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return url


def _safe(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


@db_app.command("upgrade")
def upgrade_command(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
    database_url: DatabaseUrl = None,
) -> None:
    """Migrate the database schema up to a revision (default: the latest)."""
    url = resolve_database_url(database_url)
    before = current_revision(url)
    upgrade(url, revision)
    console.print(f"database {_safe(url)}: {before or 'empty'} -> [bold]{current_revision(url)}[/bold]")


@db_app.command("downgrade")
def downgrade_command(
    revision: Annotated[str, typer.Option(help="Target revision: an id, -1, or base (drops everything).")],
    database_url: DatabaseUrl = None,
) -> None:
    """Migrate the database schema down to a revision."""
    url = resolve_database_url(database_url)
    before = current_revision(url)
    downgrade(url, revision)
    console.print(f"database {_safe(url)}: {before or 'empty'} -> [bold]{current_revision(url) or 'base'}[/bold]")
