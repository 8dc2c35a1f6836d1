"""`tandem replay`: train a saved round batch again, with no engine, server or database."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console()
errors = Console(stderr=True)


def replay_command(
    batch_dir: Annotated[Path, typer.Argument(help="A batch folder a round saved (its save_batch_dir).")],
    out: Annotated[Path, typer.Option("--out", help="The checkpoint folder to create; must not exist.")],
    model_dir: Annotated[
        Path | None,
        typer.Option(help="Base checkpoint to train from; default: the one the batch names (checked by sha256)."),
    ] = None,
) -> None:
    """Replay a saved training batch: the same training child, a new checkpoint in --out.

    On the same base weights it writes the same weights as the round did.
    """
    from learner.debug_batch import BatchError, read_manifest, replay_batch

    try:
        manifest = read_manifest(batch_dir)
    except BatchError as exc:
        errors.print(f"[red]tandem replay: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(code=2) from exc
    label = f"training {manifest.get('samples')} samples x {manifest.get('num_steps')} steps (child process)"
    started = time.perf_counter()
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True
    ) as progress:
        progress.add_task(label, total=None)
        try:
            outcome = replay_batch(batch_dir, out_dir=out, model_dir=model_dir)
        except (BatchError, FileExistsError) as exc:
            progress.stop()
            errors.print(f"[red]tandem replay: {exc}[/red]", soft_wrap=True)
            raise typer.Exit(code=2) from exc
    seconds = time.perf_counter() - started
    for step, metrics in enumerate(outcome.metrics, start=1):
        shown = ", ".join(
            f"{k} {metrics[k]:.4g}" for k in ("loss", "pg_clipfrac", "entropy_loss", "grad_norm") if k in metrics
        )
        console.print(f"step {step}: {shown}")
    if outcome.status != "succeeded" or outcome.checkpoint is None:
        errors.print(
            f"[red]replay failed ({outcome.failure}) after {seconds:.1f} s: {outcome.error}[/red]", soft_wrap=True
        )
        raise typer.Exit(code=1)
    console.print(
        f"replayed {batch_dir}: {manifest.get('samples')} samples, {len(outcome.metrics)} steps, "
        f"checkpoint {outcome.checkpoint.path} (weights sha256 {outcome.checkpoint.sha256[:12]}) in {seconds:.1f} s",
        soft_wrap=True,  # one line, whatever the terminal width
    )
