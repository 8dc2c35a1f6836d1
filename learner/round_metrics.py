"""A round's metrics as TensorBoard scalars (and W&B when configured), one step per round.

The round's own row (``finish_round(metrics=...)``) is the source of truth; these sinks are views of
it for plotting. So writing them never fails a round: any error is logged as a warning and dropped.

Names are grouped as slime's: ``rollout/`` (rewards, response lengths), ``train/`` (the policy loss
parts, grad norm), ``perf/`` (throughput), ``time/<stage>_s`` (the round's stages, swap included),
``eval/`` (the evaluation gate's scores; ``eval/training/*`` at optimizer steps, ``write_step_metrics``).
A name that already has a group (``perf/tokens_per_sec``) keeps it; an unknown bare name goes under
``round/``. The step is the caller's monotonically increasing round number for the model (e.g. the
count of its succeeded rounds): TensorBoard plots each model's rounds in order, and W&B drops a
step lower than one it has seen.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from learner.algorithms.losses import LossResult

if TYPE_CHECKING:
    from tandem.settings import Settings

__all__ = ["RoundMetricsConfig", "WandbMode", "round_scalars", "write_round_metrics", "write_step_metrics"]

log = logging.getLogger(__name__)

WandbMode = Literal["online", "offline", "disabled"]
WANDB_MISSING = (
    "W&B round metrics are configured (wandb_project) but wandb is not installed: pip install 'tandem[wandb]'"
)

ROLLOUT_NAMES = frozenset(
    {
        "samples",
        "reward_mean",
        "reward_std",
        "reward_sum",
        "reward_count",
        "baseline",
        "baseline_mean",
        "advantage_abs_mean",
        "response_length_mean",
    }
)
# The loss's own parts (slime's train/ names), the critic's and the per-token advantages', and the
# step's gradient norm.
TRAIN_NAMES = frozenset(
    {f.name for f in fields(LossResult)}
    | {"value_loss", "value_clipfrac", "values_mean", "kl_in_reward", "opd_reverse_kl", "opd_samples", "grad_norm"}
)


@dataclass(frozen=True, slots=True)
class RoundMetricsConfig:
    """Where round metrics go.

    ``tensorboard_dir`` is the root: each model writes under ``<tensorboard_dir>/<model>/`` (None: no
    TensorBoard). ``wandb_project`` turns W&B on (one run per model, resumed each round); it needs
    the ``wandb`` extra, checked here so a missing package is a configuration error, not a warning
    at the end of every round.

    Raises:
        ValueError: an unknown ``wandb_mode``, or ``wandb_project`` set without wandb installed.
    """

    tensorboard_dir: Path | None = None
    wandb_project: str | None = None
    wandb_mode: WandbMode = "online"
    wandb_dir: Path | None = None  # W&B's local files; None: W&B's default (./wandb)

    def __post_init__(self) -> None:
        errors = []
        if self.wandb_mode not in get_args(WandbMode):
            errors.append(f"wandb_mode must be one of {get_args(WandbMode)}, got {self.wandb_mode!r}")
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            errors.append(WANDB_MISSING)
        if errors:
            raise ValueError("invalid round metrics config: " + "; ".join(errors))

    @classmethod
    def from_settings(cls, settings: Settings) -> RoundMetricsConfig:
        """TensorBoard under ``settings.resolved_tensorboard_dir``; W&B when ``wandb_project`` is set."""
        return cls(
            tensorboard_dir=settings.resolved_tensorboard_dir,
            wandb_project=settings.observability.wandb_project or None,
            wandb_mode=settings.observability.wandb_mode,
            wandb_dir=settings.storage.data_dir / "wandb",
        )


def _scalar(value: object) -> float | None:
    # bool is an int, but a flag is not a quantity to plot.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _grouped(name: str) -> str:
    if "/" in name:
        return name
    if name in ROLLOUT_NAMES:
        return f"rollout/{name}"
    if name in TRAIN_NAMES:
        return f"train/{name}"
    return f"round/{name}"


def round_scalars(metrics: Mapping[str, Any], seconds: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The numeric entries of a flat round metrics dict under slime-style names, plus stage times.

    Args:
        metrics: e.g. ``RoundResult.metrics``; non-numeric entries (strings, None, nested dicts such
            as the row's ``seconds``, bools) are skipped.
        seconds: per-stage wall times (``RoundResult.seconds``), written as ``time/<stage>_s``.

    Returns:
        ``{name: value}``, e.g. ``{"rollout/reward_mean": 0.5, "train/loss": 0.1, "time/swap_s": 2.0}``.
    """
    scalars: dict[str, float] = {}
    for name, value in metrics.items():
        number = _scalar(value)
        if number is not None:
            scalars[_grouped(str(name))] = number
    for stage, value in (seconds or {}).items():
        number = _scalar(value)
        if number is not None:
            scalars[f"time/{stage}_s"] = number
    return scalars


def _safe_name(model: str) -> str:
    """A model name (possibly a path or ``org/name``) as one folder name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("._") or "model"


def write_round_metrics(
    config: RoundMetricsConfig,
    *,
    model: str,
    step: int,
    metrics: Mapping[str, Any],
    seconds: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Write one round's scalars at ``step`` to every configured sink; never raises.

    Args:
        config: the sinks.
        model: the served model name; TensorBoard writes under ``<tensorboard_dir>/<model>/``.
        step: the round number for this model, increasing from round to round.
        metrics: the round's flat metrics (see ``round_scalars``).
        seconds: the round's per-stage wall times.

    Returns:
        The scalars it meant to write (empty when there were none); a sink that failed is logged as
        a warning, the others are still written.
    """
    try:
        scalars = round_scalars(metrics, seconds)
    except Exception:  # a malformed dict must not fail the round either
        log.warning("round metrics: cannot read the metrics dict", extra={"model": model}, exc_info=True)
        return {}
    if not scalars:
        return scalars
    if config.tensorboard_dir is not None:
        try:
            _write_tensorboard(config.tensorboard_dir / _safe_name(model), [(step, scalars)])
        except Exception:
            log.warning("round metrics: TensorBoard write failed", extra={"model": model, "step": step}, exc_info=True)
    if config.wandb_project:
        try:
            _write_wandb(config, model, step, scalars)
        except Exception:
            log.warning("round metrics: W&B log failed", extra={"model": model, "step": step}, exc_info=True)
    return scalars


def write_step_metrics(
    config: RoundMetricsConfig, *, model: str, points: Sequence[tuple[int, Mapping[str, Any]]]
) -> None:
    """Points of a series within a round (periodic evaluation during training) at their own steps,
    e.g. the model's optimizer steps; TensorBoard only (a W&B run takes one step axis, the round's).
    Never raises."""
    if config.tensorboard_dir is None or not points:
        return
    try:
        scalars = [(step, round_scalars(values)) for step, values in points]
        _write_tensorboard(config.tensorboard_dir / _safe_name(model), scalars)
    except Exception:
        log.warning("round metrics: TensorBoard step series write failed", extra={"model": model}, exc_info=True)


def _write_tensorboard(log_dir: Path, points: Sequence[tuple[int, Mapping[str, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter  # heavy; only when a round ends

    # One event file per round (the name carries time, host, pid and a counter); TensorBoard reads
    # every file of the folder as one run.
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for step, scalars in points:
            for name, value in scalars.items():
                writer.add_scalar(name, value, global_step=step)
    finally:
        writer.close()


def _wandb_run_id(model: str) -> str:
    # Stable per model so every round resumes the same run; W&B ids allow [A-Za-z0-9_-].
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", model).strip("-")[:40]
    return f"tandem-{readable}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def _write_wandb(config: RoundMetricsConfig, model: str, step: int, scalars: Mapping[str, float]) -> None:
    import wandb  # the optional extra; its presence was checked with the config

    if config.wandb_dir is not None:
        config.wandb_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=config.wandb_project,
        mode=config.wandb_mode,
        id=_wandb_run_id(model),
        name=model,
        resume="allow",
        dir=None if config.wandb_dir is None else str(config.wandb_dir),
        config={"model": model},
    )
    try:
        run.log(dict(scalars), step=step)
    finally:
        run.finish()
