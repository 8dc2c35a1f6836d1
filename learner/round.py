"""One learning round, start to finish, as a plain sequence of named steps (slime's ``train.py`` style).

    start_round (the model's round lock) -> collect feedback since the last watermark -> samples
    -> rewards (the built-in feedback mapping) -> advantages (reward minus a feedback baseline)
    -> train in a child process on the serving checkpoint -> export -> record a candidate version
    -> ask the server to roll it out (``POST /admin/weights``) -> finish_round(succeeded)

Any failure after the lock is taken finishes the round ``failed`` with the error: the watermark does
not move (the next round collects the same feedback again) and serving is untouched, because only
the server changes weights and it is asked last. A round with no new feedback finishes at once as
"nothing to learn", without training.

Advantages use feedback alone: answers that share a prompt form a real group (reward minus the group
mean); an answer rated alone gets reward minus the running mean of every reward the model's
succeeded rounds have seen, this round's included (stored on each round's metrics as
``reward_sum`` / ``reward_count``).
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import httpx
import torch
from sqlalchemy.orm import Session, sessionmaker

from learner.algorithms import feedback_advantages, group_mean_std
from learner.collect import feedback_samples
from learner.rewards import FeedbackRewardMapping, feedback_reward
from learner.sample import Sample
from learner.trainers import TrainConfig, TrainingRequest, run_training_child, weights_sha256
from learner.trainers.child import DebugFault
from storage import (
    RoundBusyError,
    collect_feedback,
    finish_round,
    heartbeat_round,
    list_rounds,
    make_engine,
    make_session_factory,
    record_model_version,
    set_version_status,
    start_round,
)

__all__ = ["STAGES", "RoundConfig", "RoundError", "RoundResult", "feedback_baseline_advantages", "run_round"]

log = logging.getLogger(__name__)

STAGES = ("collect", "reward", "train", "export", "swap")
StageCallback = Callable[[str, float | None], None]  # (stage, None) when it starts, (stage, seconds) when done


class RoundError(RuntimeError):
    """The round could not start (server unreachable, admin key refused, another round running)."""


class _StageFailed(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """Where the round runs and how it trains.

    ``model_dir`` is the base checkpoint when the serving version has no recorded checkpoint (the
    model the server started with); None: the folder the server reports, which must be readable here.
    """

    server_url: str
    admin_key: str
    database_url: str
    checkpoint_dir: Path
    model_dir: Path | None = None
    train_config: TrainConfig = field(default_factory=TrainConfig)
    learning_rate: float = 1e-6
    num_steps: int = 1
    num_threads: int | None = None
    train_timeout_s: float = 3600.0
    http_timeout_s: float = 600.0
    heartbeat_s: float = 30.0
    reward_mapping: FeedbackRewardMapping = field(default_factory=FeedbackRewardMapping)
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    trigger: str = "manual"  # what started the round ("manual", "schedule", ...), stored on its row
    debug_fault: DebugFault | None = None  # the training child's, to test failure handling

    def __post_init__(self) -> None:
        errors = []
        if not self.server_url.startswith(("http://", "https://")):
            errors.append(f"server_url must be an http(s) URL, got {self.server_url!r}")
        if not self.admin_key:
            errors.append("admin_key is empty (set TANDEM_ADMIN_KEY)")
        if self.heartbeat_s <= 0 or self.http_timeout_s <= 0:
            errors.append("heartbeat_s and http_timeout_s must be > 0")
        if errors:
            raise ValueError("invalid round config: " + "; ".join(errors))


@dataclass(frozen=True, slots=True)
class RoundResult:
    """How a round ended; ``seconds`` has one entry per stage that ran (see ``STAGES``).

    ``train`` is the whole training child (load, steps, and the checkpoint write with its sha256);
    ``export`` is re-hashing the written checkpoint and recording its version row; ``swap`` is the
    server's rolling update as the learner waits for it.
    """

    status: Literal["succeeded", "nothing_to_learn", "failed"]
    round_id: str
    model: str
    samples: int = 0
    reward_mean: float | None = None
    version_id: str | None = None
    parent_version_id: str | None = None
    checkpoint_path: str | None = None
    watermark_from: int = 0
    watermark_to: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def run_round(config: RoundConfig, *, on_stage: StageCallback | None = None) -> RoundResult:
    """Run one round now against the server at ``config.server_url``.

    Returns:
        The result; a failure after the round started is reported in it (``status="failed"``).

    Raises:
        RoundError: the server cannot be asked what it serves, or another round of the model runs.
    """
    server = _Server(config.server_url, config.admin_key, config.http_timeout_s)
    serving = server.serving()
    model, parent = serving["model"], serving["version"]
    db = make_engine(config.database_url)
    try:
        sessions = make_session_factory(db)
        round_id, since = _start(sessions, config, model, parent["id"] if parent else None)
        timer = _Timer(on_stage)
        try:
            with _heartbeat(sessions, round_id, config.heartbeat_s):
                return _learn(config, server, sessions, timer, round_id, since, model, serving)
        except KeyboardInterrupt:
            _finish(
                sessions, round_id=round_id, status="failed", error="interrupted", metrics={"seconds": timer.seconds}
            )
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, _StageFailed) else str(exc)
            _finish(sessions, round_id=round_id, status="failed", error=error, metrics={"seconds": timer.seconds})
            return RoundResult("failed", round_id, model, watermark_from=since, seconds=timer.seconds, error=error)
    finally:
        db.dispose()


def _learn(
    config: RoundConfig,
    server: _Server,
    sessions: sessionmaker[Session],
    timer: _Timer,
    round_id: str,
    since: int,
    model: str,
    serving: dict[str, Any],
) -> RoundResult:
    with timer("collect"):
        with sessions.begin() as session:
            batch = collect_feedback(session, model=model, since=since)
        samples = [s for s in feedback_samples(batch.items) if s.response_length > 0]
    if not samples:
        _finish(sessions, round_id=round_id, status="succeeded", watermark_to=batch.watermark, samples_collected=0)
        return RoundResult(
            "nothing_to_learn",
            round_id,
            model,
            watermark_from=since,
            watermark_to=batch.watermark,
            seconds=timer.seconds,
        )

    with timer("reward"):
        rewards = assign_feedback_rewards(samples, config.reward_mapping)
        earlier_sum, earlier_count = _earlier_rewards(sessions, model)
        baseline = (earlier_sum + sum(rewards)) / (earlier_count + len(rewards))
        advantages = feedback_baseline_advantages(samples, baseline)
    reward_metrics = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_sum": sum(rewards),
        "reward_count": len(rewards),
        "baseline": baseline,
        "advantage_abs_mean": statistics.fmean(abs(a) for a in advantages),
    }

    parent = serving["version"]
    base_dir = Path(parent["checkpoint_path"]) if parent else (config.model_dir or Path(serving["model_path"]))
    version_id = f"v{batch.watermark}-{uuid.uuid4().hex[:8]}"
    out_dir = config.checkpoint_dir / version_id
    with timer("train"):
        if not base_dir.is_dir():
            raise _StageFailed(f"the base checkpoint {base_dir} is not a folder on this machine (pass --model-dir)")
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        outcome = run_training_child(
            TrainingRequest(
                base_model_dir=base_dir,
                out_dir=out_dir,
                samples=tuple(samples),
                config=config.train_config,
                num_steps=config.num_steps,
                learning_rate=config.learning_rate,
                num_threads=config.num_threads,
                timeout_s=config.train_timeout_s,
                debug_fault=config.debug_fault,
                advantages=tuple(advantages),
            )
        )
        if outcome.status != "succeeded" or outcome.checkpoint is None:
            raise _StageFailed(f"training {outcome.failure}: {outcome.error}")
    train_metrics = dict(outcome.metrics[-1]) if outcome.metrics else {}

    with timer("export"):
        # The child hashed what it wrote; hashing again here proves the folder the server will
        # load is whole and is the one the child reported.
        sha256 = weights_sha256(outcome.checkpoint.path)
        if sha256 != outcome.checkpoint.sha256:
            raise _StageFailed(f"checkpoint {outcome.checkpoint.path} changed after export (sha256 mismatch)")
        with sessions.begin() as session:
            record_model_version(
                session,
                version_id=version_id,
                model=model,
                checkpoint_path=str(outcome.checkpoint.path),
                sha256=sha256,
                parent_id=parent["id"] if parent else None,
                watermark=batch.watermark,
                metrics={**reward_metrics, **train_metrics, "round_id": round_id},
            )

    with timer("swap"):
        try:
            server.roll_out(str(outcome.checkpoint.path), version_id)
        except RoundError as exc:
            with sessions.begin() as session:
                set_version_status(session, version_id=version_id, status="rejected", reason=str(exc))
            raise _StageFailed(f"the server did not roll out {version_id}: {exc}") from exc

    metrics = {**reward_metrics, **train_metrics, "seconds": timer.seconds}
    _finish(
        sessions,
        round_id=round_id,
        status="succeeded",
        watermark_to=batch.watermark,
        metrics=metrics,
        samples_collected=len(batch.items),
        samples_trained=len(samples),
        produced_version_id=version_id,
    )
    return RoundResult(
        "succeeded",
        round_id,
        model,
        samples=len(samples),
        reward_mean=reward_metrics["reward_mean"],
        version_id=version_id,
        parent_version_id=parent["id"] if parent else None,
        checkpoint_path=str(outcome.checkpoint.path),
        watermark_from=since,
        watermark_to=batch.watermark,
        seconds=timer.seconds,
        metrics=metrics,
    )


# steps


def assign_feedback_rewards(samples: Sequence[Sample], mapping: FeedbackRewardMapping) -> list[float]:
    """Set each feedback sample's reward from its rating (or score) with the built-in mapping."""
    rewards = []
    for sample in samples:
        sample.reward = feedback_reward(SimpleNamespace(**sample.metadata["feedback"]), mapping)
        rewards.append(sample.reward)
    return rewards


def feedback_baseline_advantages(samples: Sequence[Sample], baseline: float) -> list[float]:
    """Reward minus the group mean where several rated answers share a prompt, else minus ``baseline``."""
    rewards = torch.tensor([s.reward_value() for s in samples], dtype=torch.float64)
    # A sample without a group is a group of its own (negative ids never collide with real ones).
    groups = torch.tensor([-1 - i if s.group_index is None else s.group_index for i, s in enumerate(samples)])
    group_mean, _ = group_mean_std(rewards, groups)
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    baselines = torch.where(counts[inverse] > 1, group_mean, torch.full_like(rewards, baseline))
    return feedback_advantages(rewards, baselines).tolist()


def _earlier_rewards(sessions: sessionmaker[Session], model: str) -> tuple[float, int]:
    with sessions() as session:
        rounds = list_rounds(session, model=model, status="succeeded", limit=10_000)
    total = sum(float(r.metrics.get("reward_sum", 0.0)) for r in rounds)
    count = sum(int(r.metrics.get("reward_count", 0)) for r in rounds)
    return total, count


def _start(sessions: sessionmaker[Session], config: RoundConfig, model: str, parent_id: str | None) -> tuple[str, int]:
    try:
        with sessions.begin() as session:
            started = start_round(
                session,
                model=model,
                worker_id=config.worker_id,
                trigger=config.trigger,
                base_version_id=parent_id,
                config={"learning_rate": config.learning_rate, "num_steps": config.num_steps},
            )
    except RoundBusyError as exc:
        raise RoundError(str(exc)) from exc
    return started.id, int(started.watermark_from or 0)


def _finish(sessions: sessionmaker[Session], **values: Any) -> None:
    with sessions.begin() as session:
        finish_round(session, **values)


# helpers


class _Timer:
    def __init__(self, on_stage: StageCallback | None) -> None:
        self.on_stage = on_stage
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.on_stage:
            self.on_stage(stage, None)
        started = time.perf_counter()
        yield
        self.seconds[stage] = time.perf_counter() - started
        if self.on_stage:
            self.on_stage(stage, self.seconds[stage])


@contextmanager
def _heartbeat(sessions: sessionmaker[Session], round_id: str, every_s: float) -> Iterator[None]:
    """Beat while the round runs, so ``fail_stale_rounds`` only fails rounds whose worker died."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                with sessions.begin() as session:
                    heartbeat_round(session, round_id=round_id)
            except Exception:  # a missed beat is retried; the round itself reports real failures
                log.warning("round heartbeat failed", extra={"round_id": round_id}, exc_info=True)

    thread = threading.Thread(target=beat, name=f"heartbeat-{round_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class _Server:
    """The gateway's admin weights API; the only way a round changes what serves."""

    def __init__(self, url: str, admin_key: str, timeout_s: float) -> None:
        self._url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._timeout = timeout_s

    def serving(self) -> dict[str, Any]:
        return self._call("GET", None)

    def roll_out(self, model_path: str, weight_version: str) -> dict[str, Any]:
        return self._call("POST", {"model_path": model_path, "weight_version": weight_version})

    def _call(self, method: str, body: dict[str, Any] | None) -> dict[str, Any]:
        try:
            response = httpx.request(
                method, f"{self._url}/admin/weights", json=body, headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise RoundError(f"cannot reach the server at {self._url}: {exc}") from exc
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise RoundError(f"{method} /admin/weights answered {response.status_code}: {message}")
        return response.json()
