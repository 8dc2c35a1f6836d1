"""`tandem export`: the conversation log as JSONL, one answer per line, token ids and logprobs decoded."""

from __future__ import annotations

import json
import sys
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from sqlalchemy.exc import SQLAlchemyError

from storage import make_engine, make_session_factory
from storage.log_export import export_records
from tandem.commands.db import DatabaseUrl, database_problem, migrated_database_url

errors = Console(stderr=True)


def export_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="The JSONL file to write; '-': standard output.")],
    model: Annotated[str | None, typer.Option(help="Only this served model's answers.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's answers.")] = None,
    since: Annotated[
        datetime | None, typer.Option(help="Only answers created at or after (ISO 8601; no zone: UTC).")
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Write the logged answers as JSONL (docs/data-format.md): ids, user, model and weight version,
    the request's messages and sampling, prompt and answer token ids, logprobs, and the rating."""
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    engine = make_engine(migrated_database_url(database_url, "export"))
    count = 0
    try:
        with (
            make_session_factory(engine)() as session,
            _open(out) as stream,
            Progress(
                SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=errors, transient=True
            ) as progress,
        ):
            task = progress.add_task("exporting", total=None)
            for record in export_records(session, model=model, tenant_id=tenant, since=since):
                stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
                if count % 100 == 0:
                    progress.update(task, description=f"exporting: {count} answers")
    except SQLAlchemyError as exc:
        errors.print(f"[red]tandem export: the database failed: {database_problem(exc)}[/red]", soft_wrap=True)
        raise typer.Exit(code=1) from exc
    finally:
        engine.dispose()
    errors.print(f"{count} answers written to {'standard output' if str(out) == '-' else out}")


def _open(out: Path) -> AbstractContextManager[TextIO]:
    if str(out) == "-":
        return nullcontext(sys.stdout)  # not closed: it is the process's
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.open("w", encoding="utf-8")
