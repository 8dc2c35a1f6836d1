"""`tandem learn`: run one learning round now against a running server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tandem.commands.db import DatabaseUrl, resolve_database_url
from tandem.settings import Settings

console = Console()
errors = Console(stderr=True)

STAGE_LABELS = {
    "collect": "collecting feedback",
    "reward": "scoring rewards and advantages",
    "train": "training (child process)",
    "export": "checking the checkpoint, recording the version",
    "swap": "rolling the new version out",
}


def learn_command(
    server: Annotated[str, typer.Option(help="URL of the running tandem server, e.g. http://127.0.0.1:8000.")],
    database_url: DatabaseUrl = None,
    model_dir: Annotated[
        Path | None,
        typer.Option(help="Base checkpoint when the serving version has none recorded; default: the server's model."),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None, typer.Option(help="Where new checkpoints go; default: checkpoints/ in the data dir.")
    ] = None,
    learning_rate: Annotated[float, typer.Option(help="Optimizer learning rate.")] = 1e-6,
    steps: Annotated[int, typer.Option(help="Optimizer steps over the round's samples.")] = 1,
    threads: Annotated[int | None, typer.Option(help="Torch CPU threads for training.")] = None,
) -> None:
    """Run one learning round now: feedback -> rewards -> training -> new version -> hot swap.

    Authenticated with the admin key from TANDEM_ADMIN_KEY.
    """
    from learner.round import RoundConfig, RoundError, run_round

    settings = Settings()
    if settings.admin_key is None:
        errors.print("[red]set TANDEM_ADMIN_KEY: rolling out weights needs the server's admin key[/red]")
        raise typer.Exit(code=2)
    config = RoundConfig(
        server_url=server,
        admin_key=settings.admin_key.get_secret_value(),
        database_url=resolve_database_url(database_url),
        checkpoint_dir=checkpoint_dir or settings.data_dir / "checkpoints",
        model_dir=model_dir,
        learning_rate=learning_rate,
        num_steps=steps,
        num_threads=threads,
    )
    with console.status("starting the round") as status:

        def on_stage(stage: str, seconds: float | None) -> None:
            if seconds is None:
                status.update(STAGE_LABELS.get(stage, stage))
            else:
                console.print(f"[green]done[/green] {stage:<8} {seconds:7.2f} s")

        try:
            result = run_round(config, on_stage=on_stage)
        except RoundError as exc:
            errors.print(f"[red]tandem learn: {exc}[/red]", soft_wrap=True)
            raise typer.Exit(code=1) from exc
    if result.status == "failed":
        errors.print(f"[red]round {result.round_id} failed; serving unchanged: {result.error}[/red]", soft_wrap=True)
        raise typer.Exit(code=1)
    if result.status == "nothing_to_learn":
        console.print(f"round {result.round_id}: nothing to learn (no new feedback since {result.watermark_from})")
        return
    console.print(
        f"round {result.round_id}: {result.samples} samples, reward mean {result.reward_mean:+.3f}, "
        f"new version {result.version_id} serving, swap {result.seconds.get('swap', 0.0):.2f} s",
        soft_wrap=True,  # one line, whatever the terminal width
    )
