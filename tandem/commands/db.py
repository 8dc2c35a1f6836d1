"""`tandem db`: schema migrations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from migrations.migrate import current_revision, downgrade, head_revision, upgrade
from tandem.settings import Settings

db_app = typer.Typer(no_args_is_help=True)
console = Console()
errors = Console(stderr=True)

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


def migrated_database_url(database_url: str | None, command: str) -> str:
    """The URL of a database at this tandem's schema; otherwise exit with one line that names the
    database opened and what to do."""
    url = resolve_database_url(database_url)
    try:
        revision = current_revision(url)
    except SQLAlchemyError as exc:
        _refuse(command, url, f"cannot be opened: {database_problem(exc)}")
    if revision is None:
        _refuse(
            command,
            url,
            "has no tandem schema: give the server's database (--database-url or TANDEM_DATABASE_URL, as "
            "`tandem serve` has it), or create one with `tandem db upgrade`",
        )
    if revision != head_revision():
        _refuse(
            command,
            url,
            f"is at schema revision {revision}, this tandem needs {head_revision()}: run `tandem db upgrade`",
        )
    return url


def _refuse(command: str, url: str, problem: str) -> NoReturn:
    errors.print(f"[red]tandem {command}: the database {_safe(url)} {problem}[/red]", soft_wrap=True)
    raise typer.Exit(code=2)


def database_problem(exc: SQLAlchemyError) -> str:
    """The driver's message of a database error, on one line (no SQL, no SQLAlchemy link)."""
    return " ".join(str(getattr(exc, "orig", None) or exc).split())


def _safe(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _migrate(command: str, database_url: str | None, move: Callable[[str], None]) -> None:
    """Run ``move`` on the database and print the revisions before and after, or the failure in one line."""
    url = resolve_database_url(database_url)
    try:
        before = current_revision(url)
        move(url)
        after = current_revision(url)
    except SQLAlchemyError as exc:
        _refuse(command, url, f"failed: {database_problem(exc)}")
    console.print(f"database {_safe(url)}: {before or 'empty'} -> [bold]{after or 'base'}[/bold]")


@db_app.command("upgrade")
def upgrade_command(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
    database_url: DatabaseUrl = None,
) -> None:
    """Migrate the database schema up to a revision (default: the latest)."""
    _migrate("db upgrade", database_url, lambda url: upgrade(url, revision))


@db_app.command("downgrade")
def downgrade_command(
    revision: Annotated[str, typer.Option(help="Target revision: an id, -1, or base (drops everything).")],
    database_url: DatabaseUrl = None,
) -> None:
    """Migrate the database schema down to a revision."""
    _migrate("db downgrade", database_url, lambda url: downgrade(url, revision))
