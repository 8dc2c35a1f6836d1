"""`tandem learn` and `tandem sft`: run one learning round, or one supervised fine-tuning round, now
against a running server."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console

from learner.plugins import PluginError
from tandem.commands.db import DatabaseUrl, migrated_database_url

if TYPE_CHECKING:
    from learner.personal_round import PersonalRoundConfig
    from learner.round_config import RoundConfig
    from tandem.settings import Settings

console = Console()
errors = Console(stderr=True)

STAGE_LABELS = {
    "collect": "collecting feedback",
    "reward": "scoring rewards and advantages",
    "rollout": "sampling and scoring fresh answers (low priority)",
    "train": "training (child process)",
    "export": "checking the checkpoint, recording the version",
    "evaluate": "evaluating the candidate against the serving version",
    "swap": "rolling the new version out",
}


Reward = Literal["feedback", "reward_model", "judge", "custom"]

# The options `learn` and `sft` share.
ServerUrl = Annotated[str, typer.Option(help="URL of the running tandem server, e.g. http://127.0.0.1:8000.")]
ModelDir = Annotated[
    Path | None,
    typer.Option(help="Base checkpoint when the serving version has none recorded; default: the server's model."),
]
CheckpointDir = Annotated[Path | None, typer.Option(help="Where new checkpoints go [TANDEM_CHECKPOINT_DIR].")]
LearningRate = Annotated[float | None, typer.Option(help="Optimizer learning rate [TANDEM_LEARN_LEARNING_RATE].")]
Steps = Annotated[int | None, typer.Option(help="Optimizer steps over the round's samples [TANDEM_LEARN_STEPS].")]
Threads = Annotated[int | None, typer.Option(help="Torch CPU threads for training [TANDEM_LEARN_THREADS].")]


def learn_command(
    server: ServerUrl,
    database_url: DatabaseUrl = None,
    model_dir: ModelDir = None,
    checkpoint_dir: CheckpointDir = None,
    learning_rate: LearningRate = None,
    steps: Steps = None,
    threads: Threads = None,
    reward: Annotated[
        Reward | None, typer.Option(help="Reward source (docs/rewards.md) [TANDEM_LEARN_REWARD].")
    ] = None,
    reward_path: Annotated[
        str | None, typer.Option(help="Custom reward function 'package.module:function' [TANDEM_LEARN_REWARD_PATH].")
    ] = None,
    samples_per_prompt: Annotated[
        int | None, typer.Option(help="Rollouts per rated prompt [TANDEM_LEARN_SAMPLES_PER_PROMPT].")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Learn only from this tenant's feedback.")] = None,
    user: Annotated[str | None, typer.Option(help="Learn only from this end user's feedback.")] = None,
    max_age_s: Annotated[float | None, typer.Option(help="Learn only from answers at most this old.")] = None,
    save_batch: Annotated[
        Path | None, typer.Option(help="Save the round's batch under this folder (replay: tandem replay).")
    ] = None,
    rollout_only: Annotated[
        bool, typer.Option("--rollout-only", help="Collect, score and save the batch; no training, nothing served.")
    ] = False,
    personal: Annotated[
        bool,
        typer.Option(
            "--personal",
            help="Train and serve the LoRA adapter of every user and cohort with enough new ratings "
            "[TANDEM_ADAPTER_*] (docs/adapters.md); as TANDEM_LEARN_SCOPE=personal.",
        ),
    ] = False,
) -> None:
    """Run one learning round now: feedback -> rewards (-> rollouts) -> training -> new version -> hot swap.

    Authenticated with the admin key from TANDEM_ADMIN_KEY; every other default comes from the
    learner settings (TANDEM_LEARN_*), as for scheduled rounds.
    """
    from learner.round_settings import personal_round_config

    settings, config = _round_config(
        "learn",
        server,
        database_url=database_url,
        checkpoint_dir=checkpoint_dir,
        learning_rate=learning_rate,
        steps=steps,
        threads=threads,
        overrides={
            "learn_reward": reward,
            "learn_reward_path": reward_path,
            "learn_samples_per_prompt": samples_per_prompt,
            "learn_save_batch_dir": save_batch,
        },
        model_dir=model_dir,
        tenant_id=tenant,
        end_user=user,
        max_age_s=max_age_s,
        mode="rollout_only" if rollout_only else "train",
    )
    if personal or settings.learner.scope == "personal":
        _personal_round(personal_round_config(settings, config))
        return
    _run_and_report(config, "learn")


def sft_command(
    server: ServerUrl,
    data: Annotated[
        Path | None,
        typer.Option(
            help='OpenAI-format JSONL ({"messages": [...]} per line); default: the answers rated up in the log.'
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    model_dir: ModelDir = None,
    checkpoint_dir: CheckpointDir = None,
    learning_rate: LearningRate = None,
    steps: Steps = None,
    threads: Threads = None,
    tenant: Annotated[str | None, typer.Option(help="From the log: only this tenant's liked answers.")] = None,
    user: Annotated[str | None, typer.Option(help="From the log: only this end user's liked answers.")] = None,
    max_age_s: Annotated[float | None, typer.Option(help="From the log: only answers at most this old.")] = None,
) -> None:
    """Supervised fine-tuning: every assistant turn of --data (or every answer rated up in the log)
    trained by likelihood on its own tokens, then the same evaluation gate and hot swap as `tandem learn`."""
    _, config = _round_config(
        "sft",
        server,
        database_url=database_url,
        checkpoint_dir=checkpoint_dir,
        learning_rate=learning_rate,
        steps=steps,
        threads=threads,
        overrides={},
        model_dir=model_dir,
        tenant_id=tenant,
        end_user=user,
        max_age_s=max_age_s,
        mode="sft",
        sft_data=data,
    )
    _run_and_report(config, "sft")


def _round_config(
    command: str,
    server: str,
    *,
    database_url: str | None,
    checkpoint_dir: Path | None,
    learning_rate: float | None,
    steps: int | None,
    threads: int | None,
    overrides: dict[str, Any],
    **fields: Any,
) -> tuple[Settings, RoundConfig]:
    """The settings and the round config of a command; a readable refusal and exit code 2."""
    from learner.round_settings import round_config
    from tandem.commands.load_settings import load_settings

    settings = load_settings(
        command,
        database_url=database_url,
        checkpoint_dir=checkpoint_dir,
        learn_learning_rate=learning_rate,
        learn_steps=steps,
        learn_threads=threads,
        **overrides,
    )
    if settings.server.admin_key is None:
        errors.print("[red]set TANDEM_ADMIN_KEY: rolling out weights needs the server's admin key[/red]")
        raise typer.Exit(code=2)
    try:
        config = dataclasses.replace(
            round_config(
                settings, server_url=server, admin_key=settings.server.admin_key.get_secret_value(), trigger="manual"
            ),
            database_url=migrated_database_url(database_url, command),
            **fields,
        )
    except (ValueError, PluginError) as exc:
        errors.print(f"[red]tandem {command}: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(code=2) from exc
    return settings, config


def _run_and_report(config: RoundConfig, command: str) -> None:
    """Run the round with a status line per stage and print its one-line outcome."""
    from learner.round import RoundError, run_round

    with console.status("starting the round") as status:

        def on_stage(stage: str, seconds: float | None) -> None:
            if seconds is None:
                status.update(STAGE_LABELS.get(stage, stage))
            else:
                console.print(f"[green]done[/green] {stage:<8} {seconds:7.2f} s")

        try:
            result = run_round(config, on_stage=on_stage)
        except RoundError as exc:
            errors.print(f"[red]tandem {command}: {exc}[/red]", soft_wrap=True)
            raise typer.Exit(code=1) from exc
    if result.status == "failed":
        errors.print(f"[red]round {result.round_id} failed; serving unchanged: {result.error}[/red]", soft_wrap=True)
        raise typer.Exit(code=1)
    if result.status == "nothing_to_learn":
        console.print(f"round {result.round_id}: nothing to learn ({result.reason}); no version made", soft_wrap=True)
        return
    rollouts = result.metrics.get("rollout/raw_reward_mean")
    rewards = (
        "trained by likelihood (SFT)"
        if result.reward_mean is None
        else f"reward mean {result.reward_mean:+.3f}" + (f" (rollouts {rollouts:+.3f})" if rollouts is not None else "")
    )
    if result.status == "rollout_only":
        console.print(f"round {result.round_id}: {result.samples} samples, {rewards}; rollout only, nothing trained")
        return
    outcomes = {
        "succeeded": f"new version {result.version_id} serving, swap {result.seconds.get('swap', 0.0):.2f} s",
        "canary": f"new version {result.version_id} in canary: live ratings decide (/admin/canaries)",
    }
    outcome = outcomes.get(
        result.status, f"version {result.version_id} held back as a candidate: {result.metrics.get('eval/reason', '')}"
    )
    console.print(
        f"round {result.round_id}: {result.samples} samples, {rewards}, {outcome}",
        soft_wrap=True,  # one line, whatever the terminal width
    )
    if "guard/passed" in result.metrics:
        console.print(_guard_line(result.metrics), soft_wrap=True)
    unchecked = _unchecked_preference(str(result.metrics.get("eval/reason", "")))
    if unchecked:
        console.print(f"[yellow]{unchecked}[/yellow]", soft_wrap=True)


def _unchecked_preference(reason: str) -> str | None:
    """A warning when the gate could not compare candidate and serving on ratings (a small deployment's
    normal state, which would otherwise pass unnoticed)."""
    found = re.search(r"(?:promoted without evaluation|preference not evaluated): ([^;]+)", reason)
    if found is None:
        return None
    return (
        f"evaluation gate: the preference margin was not checked ({found.group(1)}): the version was judged "
        "by the capability guard alone. Held-out ratings (TANDEM_EVAL_HOLDOUT_FRACTION of prompts) or an eval "
        "prompts file (TANDEM_EVAL_PROMPTS) let it compare answers (docs/evaluation.md)."
    )


def _guard_line(metrics: dict[str, Any]) -> str:
    """The capability guard's measurements of the round's candidate (bounds: docs/evaluation.md)."""
    values = ", ".join(
        f"{name.removeprefix('guard/')} {value:.3f}"
        for name, value in metrics.items()
        if name.startswith("guard/") and name != "guard/passed"
    )
    verdict = "passed" if metrics["guard/passed"] else "held it back"
    return f"capability guard {verdict}: {values}"


def _personal_round(config: PersonalRoundConfig) -> None:
    from learner.personal_round import ScopeResult, run_personal_round
    from learner.round import RoundError

    with console.status("finding the scopes with new ratings") as status:

        def on_scope(result: ScopeResult) -> None:
            line = f"{result.scope_kind} {result.tenant_id}/{result.scope}: {result.status}"
            detail = f" adapter {result.adapter_id}, {result.samples} samples, {result.seconds:.1f} s"
            why = f": {result.error}" if result.status == "held_back" else ""
            console.print(
                line + (detail + why if result.adapter_id else f" {result.error or result.reason or ''}"),
                soft_wrap=True,
            )
            status.update("training the next scope")

        try:
            result = run_personal_round(config, on_scope=on_scope)
        except RoundError as exc:
            errors.print(f"[red]tandem learn --personal: {exc}[/red]", soft_wrap=True)
            raise typer.Exit(code=1) from exc
    failed = [s for s in result.scopes if s.status == "failed"]
    held = [s for s in result.scopes if s.status == "held_back"]
    canaries = [s for s in result.scopes if s.status == "canary"]
    console.print(
        f"personal round over base {result.base_version}: {len(result.trained)} adapters serving, "
        f"{len(canaries)} in canary, {len(held)} held back by evaluation, {len(failed)} failed, {len(result.scopes)} scopes due, "
        f"{result.seconds:.1f} s"
    )
    if failed:
        raise typer.Exit(code=1)
