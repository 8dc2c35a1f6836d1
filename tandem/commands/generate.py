"""`tandem generate`: run a tool rollout or a multi-agent workflow over a prompt set and write the
trajectories (docs/agents.md, "Data generation")."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.commands.load_settings import load_settings

console = Console()
errors = Console(stderr=True)


def generate_command(
    prompts: Annotated[Path, typer.Argument(help='JSONL of {"messages": [...], "label": ...} or {"prompt": "..."}.')],
    out: Annotated[Path, typer.Option("--out", help="The JSONL file of trajectories to write (replaced).")],
    generate: Annotated[
        str, typer.Option(help="A slime generate function: a tool rollout, a workflow's generate, your own.")
    ] = "learner.tool_rollout:generate",
    reward: Annotated[
        str | None,
        typer.Option(help="A slime reward function scoring each sample, e.g. learner.verifiers:exact_math_answer."),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Rollouts per prompt.")] = 1,
    concurrency: Annotated[int, typer.Option(min=1, help="Rollouts in flight at once.")] = 4,
    temperature: Annotated[float, typer.Option(min=0.0, max=2.0)] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Response tokens per rollout, every turn together.")] = 512,
    server: Annotated[str | None, typer.Option(help="The gateway; default: the configured host and port.")] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="The serving model's folder (its tokenizer); default: asked from the gateway.")
    ] = None,
) -> None:
    """Generate training trajectories from the serving model, with the gateway's admin key."""
    from learner.plugins import PluginError
    from learner.round_config import RoundError
    from learner.server_api import ServerApi
    from learner.trajectories import GenerateJob, PromptFileError, generate_trajectories, read_prompts

    settings = load_settings("generate")
    admin_key = settings.server.admin_key.get_secret_value() if settings.server.admin_key else ""
    url = server or f"http://{settings.server.host}:{settings.server.port}"
    try:
        prompt_samples = read_prompts(prompts)
        folder = str(checkpoint) if checkpoint else ServerApi(url, admin_key, 30.0).serving()["model_path"]
    except (OSError, PromptFileError, RoundError) as exc:
        errors.print(f"[red]tandem generate: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(code=2) from exc
    sampling = (("temperature", temperature), ("max_new_tokens", max_new_tokens))
    job = GenerateJob(url, admin_key, folder, generate, reward, samples, concurrency, sampling)
    started, lines = time.perf_counter(), []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("rollouts", total=len(prompt_samples) * samples)
        try:
            lines = list(generate_trajectories(job, prompt_samples, lambda n: progress.advance(task, n)))
        except PluginError as exc:
            progress.stop()
            errors.print(f"[red]tandem generate: {exc}[/red]", soft_wrap=True)
            raise typer.Exit(code=2) from exc
    out.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    rewards = [line["reward"] for line in lines if isinstance(line["reward"], int | float)]
    mean = f", mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
    calls = sum(int(line["metadata"].get("tool_calls") or 0) for line in lines)
    console.print(
        f"generated {len(lines)} trajectories from {len(prompt_samples)} prompts in "
        f"{time.perf_counter() - started:.1f} s ({calls} tool calls{mean}); wrote {out}",
        soft_wrap=True,
    )
