"""The `tandem` command: serve the gateway, run an engine process, manage the database and keys."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
import uvicorn
from fastapi import FastAPI
from sqlalchemy import make_url

from tandem.commands.db import db_app
from tandem.commands.engines import engines_app
from tandem.commands.export import export_command
from tandem.commands.generate import generate_command
from tandem.commands.keys import keys_app
from tandem.commands.learn import learn_command, sft_command
from tandem.commands.replay import replay_command
from tandem.commands.worker import beat_command, worker_command
from tandem.logging import configure_logging
from tandem.settings import Settings

app = typer.Typer(help="tandem: LLM serving that learns from its own traffic.", no_args_is_help=True)
app.add_typer(db_app, name="db", help="Database schema migrations.")
app.add_typer(keys_app, name="keys", help="Tenant API keys.")
app.add_typer(engines_app, name="engines", help="Managed engine groups: validate a config and show launch commands.")
app.command("learn")(learn_command)
app.command("sft")(sft_command)
app.command("replay")(replay_command)
app.command("export")(export_command)
app.command("generate")(generate_command)
app.command("worker")(worker_command)
app.command("beat")(beat_command)

Host = Annotated[str | None, typer.Option(help="Address to bind [TANDEM_HOST].")]
Port = Annotated[int | None, typer.Option(help="Port to bind [TANDEM_PORT].")]
Model = Annotated[
    str | None, typer.Option(help="A local HF model folder or a builtin name [TANDEM_MODEL].", show_default=False)
]


def _run(api: FastAPI, settings: Settings) -> None:
    uvicorn.run(
        api,
        host=settings.server.host,
        port=settings.server.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


@app.command()
def serve(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL [TANDEM_DATABASE_URL].")] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="local (in-process) or sglang (SGLang servers or `tandem engine` processes) [TANDEM_ENGINE]."
        ),
    ] = None,
    engine_url: Annotated[
        list[str] | None,
        typer.Option(
            help="URL of an SGLang server or `tandem engine` process; repeat for a pool (implies --engine sglang)."
        ),
    ] = None,
    engine_config: Annotated[
        Path | None,
        typer.Option(
            help="TOML file of managed engine server groups to launch (implies --engine sglang) [TANDEM_ENGINE_CONFIG]."
        ),
    ] = None,
) -> None:
    """Serve the OpenAI-compatible API; upgrades the database schema first."""
    from admin.app import create_app  # the gateway with the admin API mounted
    from server.app import StartupError
    from tandem.commands.load_settings import load_settings
    from tandem.dashboard_link import announce_dashboard
    from tandem.worker_child import attach_worker_child, with_internal_key

    settings = load_settings(
        "serve",
        host=host,
        port=port,
        model=model,
        database_url=database_url,
        engine=engine or ("sglang" if engine_url or engine_config else None),
        engine_urls=engine_url or None,
        engine_config=engine_config,
    )
    configure_logging(settings.observability.log_level, settings.observability.log_format)
    settings.storage.data_dir.mkdir(parents=True, exist_ok=True)
    # The data directory first: the default one is shared by every checkout on this machine.
    logging.getLogger("tandem.serve").info(
        "tandem serve starting",
        extra={
            "data_dir": str(settings.storage.data_dir),
            "database": make_url(settings.resolved_database_url).render_as_string(hide_password=True),
            "model": settings.engine.model,
        },
    )
    settings = with_internal_key(settings)
    try:
        api = create_app(settings)
    except StartupError as exc:
        typer.secho(f"tandem serve: {exc}", fg="red", err=True)
        raise typer.Exit(2) from exc
    attach_worker_child(api, settings)  # learner = "embedded": a learner worker for serve's lifetime
    announce_dashboard(api, settings)
    _run(api, settings)


@app.command("engine")
def engine_command(
    host: Host = None,
    port: Annotated[int, typer.Option(help="Port to bind.")] = 30000,
    model: Model = None,
    weight_version: Annotated[str, typer.Option(help="Initial weight version label.")] = "default",
) -> None:
    """Run the local engine as its own process, answering SGLang's native HTTP API."""
    from server.engine_factory import open_local_engine
    from server.engines.sglang_server import create_engine_app
    from tandem.models import resolve_model

    settings = Settings().with_overrides(host=host, port=port, model=model, engine="local")
    configure_logging(settings.observability.log_level, settings.observability.log_format)
    model_path = resolve_model(settings.engine.model, settings.storage.model_cache_dir)
    _run(create_engine_app(lambda: open_local_engine(settings, model_path, weight_version=weight_version)), settings)


if __name__ == "__main__":
    app()
