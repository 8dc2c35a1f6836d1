"""`tandem engines`: check an engine-groups config and show the commands the supervisor would run."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from server.engines.launch_plan import LaunchConfigError, ServerLaunch, load_launch_config, plan, router_launch
from tandem.settings import Settings

engines_app = typer.Typer(no_args_is_help=True)


@engines_app.callback()
def engines_callback() -> None:
    """Managed SGLang / tandem engine groups (see docs/engine-groups.md)."""


@engines_app.command("plan")
def plan_command(
    config: Annotated[Path, typer.Argument(help="The engine groups TOML file.", show_default=False)],
    check_paths: Annotated[
        bool, typer.Option(help="Require model folders to exist (turn off to plan for another machine).")
    ] = True,
) -> None:
    """Validate CONFIG and print every server's command line and the router's; exit 2 listing all errors."""
    try:
        launch_config = load_launch_config(config, check_paths=check_paths)
    except LaunchConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    python = Settings().engine.sglang_interpreter
    launches = plan(launch_config, python=python)
    router = router_launch(launch_config, python=python)
    for launch in [*launches, *([router] if router else [])]:
        typer.echo(f"# {_title(launch)}")
        typer.echo(shell_command(launch))
    serving = router.url if router else ", ".join(launch.url for launch in launches)
    typer.echo(f"# {len(launches)} server(s){' and a router' if router else ''}; the gateway routes over {serving}")


def _title(launch: ServerLaunch) -> str:
    if launch.role == "router":
        return f"router -> {launch.url}"
    return f'group "{launch.group}" replica {launch.index} ({launch.role}) -> {launch.url}'


def shell_command(launch: ServerLaunch) -> str:
    """The launch as one shell line: ``env`` assignments, then the quoted argv."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in launch.env.items()]
    return " ".join([*assignments, shlex.join(launch.argv)])
