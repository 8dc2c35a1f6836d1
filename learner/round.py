"""One learning round, start to finish, as a plain sequence of named steps (slime's ``train.py`` style).

    start_round (the model's round lock) -> collect feedback since the last watermark (filters)
    -> reward: the feedback mapping, baselines, advantages (and, for the reward model, its fit)
    -> rollout, when the reward can score new text: n fresh answers per prompt, scored, grouped
    with the rated answers, filtered and normalised (``learner.groups``)
    -> train in a child process on the serving checkpoint -> export -> record a candidate version
    -> evaluate: candidate and serving scored on the eval set (``learner.evaluation``); a candidate
    worse than serving by more than the margin stays a candidate (result ``held_back``)
    -> ask the server to roll it out (``POST /admin/weights``) -> finish_round(succeeded)

Any failure after the lock is taken finishes the round ``failed`` with the error: the watermark does
not move (the next round collects the same feedback again) and serving is untouched, because only
the server changes weights and it is asked last. A round that cannot change the policy finishes as
``nothing_to_learn`` with the reason, without training or a version: no new feedback, none of it
trainable (held out, flagged users, no answer), every rollout group's rewards equal, or every
advantage zero (a lone rating is its own baseline). Its data counts as consumed: the watermark moves.

Rated answers to held-out prompts (``learner.evaluation.eval_set``) are dropped at collect and from
the reward model's history: they only ever evaluate. A held-back round still moves the watermark:
its data made a candidate, judged and kept (an admin may promote it); retraining on the same data
every round would repeat the verdict, or, with harmful ratings, retry them forever.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from learner.collect import feedback_samples, learnable
from learner.corrections import corrections_of, turn_tokenizer
from learner.debug_batch import save_batch
from learner.evaluation.scoring import unscorable
from learner.evaluation.stage import held_out_answers, load_eval_set, trainable
from learner.promotion import Promotion
from learner.round_config import STAGES, Drifted, RoundConfig, RoundError, RoundResult, StageFailed
from learner.round_metrics import write_round_metrics, write_step_metrics
from learner.round_rewards import RoundRewards
from learner.sample import Sample
from learner.server_api import ServerApi
from learner.sft import conversation_samples, rated_up
from learner.trainers.checkpoint import export_quantized
from learner.trainers.drift import length_change
from learner.training import TrainingRequest, run_training_child
from learner.user_weights import user_weights
from storage import (
    FeedbackBatch,
    RoundBusyError,
    collect_feedback,
    finish_round,
    heartbeat_round,
    list_rounds,
    make_engine,
    make_session_factory,
    start_round,
)
from storage.flagged_users import flagged_users
from storage.schedules import pause_schedule

__all__ = ["STAGES", "RoundConfig", "RoundError", "RoundResult", "run_round"]

log = logging.getLogger(__name__)

StageCallback = Callable[[str, float | None], None]  # (stage, None) when it starts, (stage, seconds) when done


def run_round(config: RoundConfig, *, on_stage: StageCallback | None = None) -> RoundResult:
    """Run one round now against the server at ``config.server_url``.

    Returns:
        The result; a failure after the round started is reported in it (``status="failed"``).

    Raises:
        RoundError: the server cannot be asked what it serves, or another round of the model runs.
    """
    server = ServerApi(config.server_url, config.admin_key, config.http_timeout_s)
    serving = server.serving()
    db = make_engine(config.database_url)
    try:
        sessions = make_session_factory(db)
        parent = serving["version"]
        round_id, since = _start(sessions, config, serving["model"], parent["id"] if parent else None)
        timer = _Timer(on_stage, lambda: _still_running(sessions, round_id))
        run = _Round(config, server, sessions, timer, round_id, since, serving)
        try:
            with _heartbeat(sessions, round_id, config.heartbeat_s):
                return run.learn()
        except KeyboardInterrupt:
            run.finish(status="failed", error="interrupted", metrics={"seconds": run.timer.seconds})
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, StageFailed) else str(exc)
            if not _still_running(sessions, round_id):  # cancelled (admin API) or declared dead: row is final
                return run.result("failed", error=f"the round was stopped: its row is no longer running ({error})")
            if isinstance(exc, Drifted) and config.schedule_id is not None:
                with sessions.begin() as session:
                    pause_schedule(session, config.schedule_id, f"round {round_id}: {error}")
                error += f"; schedule {config.schedule_id} paused until an admin enables it"
            run.finish(status="failed", error=error, metrics={"seconds": run.timer.seconds})
            return run.result("failed", error=error)
    finally:
        db.dispose()


@dataclass(slots=True)
class _Round:
    """One running round: its inputs, and what each step adds for the next."""

    config: RoundConfig
    server: ServerApi
    sessions: sessionmaker[Session]
    timer: _Timer
    round_id: str
    since: int
    serving: dict[str, Any]
    watermark: int | None = None
    samples: list[Sample] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    eval_samples: list[Sample] | None = None  # the eval set, built once when first needed

    @property
    def model(self) -> str:
        return self.serving["model"]

    @property
    def parent(self) -> dict[str, Any] | None:
        return self.serving["version"]

    def learn(self) -> RoundResult:
        if self.config.mode == "sft":
            return self.learn_supervised()
        with self.timer("collect"):
            collected = self.collect()
        if not self.samples:
            return self.nothing_to_learn(self.untrainable(collected), collected)
        corrections = corrections_of(self.samples, self.base_dir)  # from the rated answers, before grouping
        rewards = self.rewards()
        with self.timer("reward"):
            advantages = rewards.feedback_advantages(self.samples)
            weights = user_weights(self.samples, self.config.user_weighting)  # the ratings' rewards are set now
            score = rewards.fresh_scorer()
        if score is not None:
            with self.timer("rollout"):
                batch = rewards.grouped(self.samples, score, rollout_id=self.succeeded_rounds())
            self.samples, advantages = batch.samples, batch.advantages
            if not self.samples and not corrections:
                return self.nothing_to_learn("every rollout group's rewards were equal", collected)
        # A rollout carries its rated prompt's user: a user's weight scales their whole group.
        advantages = [a * weights.of(s) for s, a in zip(self.samples, advantages, strict=True)]
        self.metrics |= weights.metrics()
        # The policy loss and its gradient are zero (a removed sample trains nothing whatever its
        # advantage) and no correction is to be learnt: training would only copy the weights.
        if not corrections and not any(a for s, a in zip(self.samples, advantages, strict=True) if not s.remove_sample):
            return self.nothing_to_learn(
                f"every advantage is zero ({len(advantages)} samples): no answer was rated better or worse "
                "than its baseline",
                collected,
            )
        self.refuse_length_drift()  # on the policy's own answers, before the corrections join them
        self.samples, advantages = [*self.samples, *corrections], [*advantages, *[0.0] * len(corrections)]
        self.metrics["corrections"] = len(corrections)
        return self.train_and_serve(advantages, collected, rewards)

    def learn_supervised(self) -> RoundResult:
        """An SFT round (``learner.sft``): a conversations file, or the answers rated up in the log, all
        trained by likelihood; the feedback watermark stays where it is."""
        config = self.config
        with self.timer("collect"):
            if config.sft_data is not None:
                tokenizer, stops = turn_tokenizer(self.base_dir)
                self.samples = conversation_samples(config.sft_data, tokenizer, stops)
            else:
                self.samples = rated_up(self.rated_answers(since=0)[1])
        self.watermark = self.since
        if not self.samples:
            where = f"no assistant turn in {config.sft_data}" if config.sft_data else "no answer rated up in the log"
            return self.nothing_to_learn(where, 0)
        self.metrics["sft_samples"] = len(self.samples)
        return self.train_and_serve([0.0] * len(self.samples), len(self.samples))

    def train_and_serve(
        self, advantages: list[float], collected: int, rewards: RoundRewards | None = None
    ) -> RoundResult:
        """Train on ``self.samples``, record the version, gate it, and roll it out (``rewards``: the
        round's, for the eval rollout after the swap)."""
        request = self.training_request(advantages)
        if self.config.save_batch_dir is not None:
            info = {"round_id": self.round_id, "model": self.model, "watermark": self.watermark}
            save_batch(request, self.config.save_batch_dir / self.round_id, info=info)
        if self.config.mode == "rollout_only":
            # Nothing trained: the watermark stays, so a training round later sees the same data.
            self.finish(status="succeeded", watermark_to=self.since, metrics=self.metrics)
            return self.result("rollout_only")
        with self.timer("train"):
            checkpoint = self.train(request)
        promotion = self.promotion()
        with self.timer("export"):
            sha256 = self.metrics.pop("checkpoint_sha256")
            lineage = {"round_id": self.round_id, "base_model_path": str(self.root_dir)}
            version_id = promotion.record(
                checkpoint, sha256=sha256, watermark=self.watermark, metrics=self.metrics | lineage
            )
        promote = True
        if self.config.evaluation.on:
            with self.timer("evaluate"):
                promote, measured = promotion.evaluate(
                    checkpoint,
                    version_id,
                    config=self.config.evaluation,
                    eval_set=self.eval_set(),
                    root=self.root_dir,
                    num_threads=self.config.num_threads,
                )
            self.metrics |= measured
        canary = promote and self.config.canary_share > 0
        if promote:
            if self.config.rollout_weights == "same":
                served = checkpoint
            else:
                with self.timer("quantize"):
                    served = export_quantized(checkpoint, self.config.rollout_weights)
            with self.timer("swap"):
                promotion.roll_out(served, version_id, self.config.canary_share)
            if self.config.eval_rollout_path is not None:
                with self.timer("eval_rollout"):
                    self.metrics |= (rewards or self.rewards()).eval_rollout(self.samples, self.succeeded_rounds())
        self.metrics["seconds"] = self.timer.seconds
        self.finish(
            status="succeeded",
            watermark_to=self.watermark,
            metrics=self.metrics,
            samples_collected=collected,
            samples_trained=sum(not s.remove_sample for s in self.samples),
            produced_version_id=version_id,
        )
        self.write_metrics()
        status = "canary" if canary else "succeeded" if promote else "held_back"
        return self.result(status, version_id=version_id, checkpoint_path=checkpoint)

    # steps

    def collect(self) -> int:
        """Rated answers since the watermark, through the configured filters; returns how many were rated."""
        batch, rated = self.rated_answers(since=self.since)
        self.watermark = batch.watermark
        answered = sum(1 for item in batch.items if item.response_token_ids)
        self.metrics["flagged_excluded"] = answered - len(rated)
        self.samples = trainable(rated, self.config.evaluation)
        if self.config.evaluation.holds_out:
            self.metrics["eval/held_out"] = len(rated) - len(self.samples)
        return len(batch.items)

    def feedback(self, session: Session, *, since: int, until: int | None = None) -> FeedbackBatch:
        """The model's rated answers after ``since`` through the round's tenant, user and age filters."""
        config = self.config
        return collect_feedback(
            session,
            model=self.model,
            since=since,
            until=until,
            tenant_id=config.tenant_id,
            end_user=config.end_user,
            max_age=config.max_age,
        )

    def rated_answers(self, *, since: int) -> tuple[FeedbackBatch, list[Sample]]:
        """``feedback`` and its answers as samples, less those of flagged users."""
        with self.sessions.begin() as session:
            batch = self.feedback(session, since=since)
            flagged = flagged_users(session)
        return batch, learnable(feedback_samples(batch.items), flagged)

    def rewards(self) -> RoundRewards:
        return RoundRewards(
            self.config, self.sessions, self.model, self.round_id, self.watermark, self.base_dir, self.metrics
        )

    def promotion(self) -> Promotion:
        parent = self.parent
        return Promotion(self.sessions, self.server, self.model, parent["id"] if parent else None, self.base_dir)

    @property
    def base_dir(self) -> Path:
        """The serving checkpoint: what is trained, and what the reward model reads."""
        parent = self.parent
        return (
            Path(parent["checkpoint_path"]) if parent else (self.config.model_dir or Path(self.serving["model_path"]))
        )

    @property
    def root_dir(self) -> Path:
        """The model the lineage started from: the KL loss's reference (slime's initial model)."""
        parent = self.parent
        recorded = (parent or {}).get("metrics", {}).get("base_model_path")
        return Path(recorded) if recorded else self.base_dir

    def eval_set(self) -> list[Sample]:
        """The prompts file, or the held-out rated answers up to this round's watermark (same filters)."""
        if self.eval_samples is None:
            config, held_out = self.config, []
            if config.evaluation.holds_out:
                with self.sessions.begin() as session:
                    history = self.feedback(session, since=0, until=self.watermark)
                held_out = held_out_answers(history.items, config.evaluation, config.reward_mapping)
            self.eval_samples = load_eval_set(config.evaluation, held_out)
        return self.eval_samples

    def training_request(self, advantages: list[float]) -> TrainingRequest:
        config = self.config
        every = config.evaluation.every_steps
        scorable = every and unscorable(self.eval_set(), config.evaluation.method) is None
        eval_set = tuple(self.eval_set()) if scorable else ()
        return TrainingRequest(
            base_model_dir=self.base_dir,
            out_dir=config.checkpoint_dir / f"v{self.watermark}-{uuid.uuid4().hex[:8]}",
            samples=tuple(self.samples),
            config=config.train_config,
            num_steps=config.num_steps,
            learning_rate=config.learning_rate,
            num_threads=config.num_threads,
            timeout_s=config.train_timeout_s,
            advantages=tuple(advantages),
            reference_model_dir=self.root_dir,
            eval_every=every if eval_set else 0,
            eval_set=eval_set,
            eval_method=config.evaluation.method,
            drift=config.drift if config.drift.on and config.train_config.backend == "torch" else None,
        )

    def refuse_length_drift(self) -> None:
        """Stop before training when the batch's answers are far longer or shorter than the lineage's
        earlier rounds' (they come from the serving policy: its answers changed length)."""
        if not self.config.drift.on or not self.samples:  # corrections alone: no policy answer to measure
            return
        with self.sessions.begin() as session:
            earlier = list_rounds(session, model=self.model, status="succeeded", limit=5)
        lengths = [
            r.metrics["rollout/response_length_mean"] for r in earlier if "rollout/response_length_mean" in r.metrics
        ]
        mean = sum(s.response_length for s in self.samples) / len(self.samples)
        why = length_change(mean, lengths, self.config.drift)
        if why is not None:
            raise Drifted(f"drift guard: {why}")

    def train(self, request: TrainingRequest) -> Path:
        """The new checkpoint folder; a failed child leaves nothing to serve."""
        if not request.base_model_dir.is_dir():
            raise StageFailed(
                f"the base checkpoint {request.base_model_dir} is not a folder on this machine (pass --model-dir)"
            )
        request.out_dir.parent.mkdir(parents=True, exist_ok=True)
        outcome = run_training_child(request)
        if outcome.failure in ("drifted", "diverged"):
            raise Drifted(f"training {outcome.failure}: {outcome.error}")
        if outcome.status != "succeeded" or outcome.checkpoint is None:
            raise StageFailed(f"training {outcome.failure}: {outcome.error}")
        self.metrics |= dict(outcome.metrics[-1]) if outcome.metrics else {}
        if outcome.evaluations:
            self.metrics["eval/training"] = list(outcome.evaluations)
        # The child hashed what it wrote; hashing again (in export) proves the folder is whole.
        self.metrics["checkpoint_sha256"] = outcome.checkpoint.sha256
        return outcome.checkpoint.path

    # bookkeeping

    def succeeded_rounds(self) -> int:
        """The model's succeeded rounds so far: this round's metrics step and slime's ``rollout_id``."""
        with self.sessions() as session:
            return len(list_rounds(session, model=self.model, status="succeeded", limit=1_000_000))

    def write_metrics(self) -> None:
        """TensorBoard / W&B points at step = the model's count of succeeded rounds (never fails the round)."""
        if self.config.metrics is None:
            return
        step = self.succeeded_rounds()
        write_round_metrics(
            self.config.metrics, model=self.model, step=step, metrics=self.metrics, seconds=self.timer.seconds
        )
        if "eval/training" in self.metrics:
            # Plotted against the model's optimizer steps: the steps of its earlier trained rounds come first.
            with self.sessions() as session:
                earlier = list_rounds(session, model=self.model, status="succeeded", limit=1_000_000)
            offset = sum(
                int(r.config.get("num_steps", 1)) for r in earlier if r.samples_trained and r.id != self.round_id
            )
            points = [
                (offset + int(e["step"]), {f"eval/training/{k}": v for k, v in e.items() if k != "step"})
                for e in self.metrics["eval/training"]
            ]
            write_step_metrics(self.config.metrics, model=self.model, points=points)

    def untrainable(self, collected: int) -> str:
        """Why none of the ``collected`` ratings became a training sample."""
        if collected == 0:
            return f"no new ratings since watermark {self.since}"
        dropped = {
            "held out for evaluation": self.metrics.get("eval/held_out", 0),
            "from flagged users": self.metrics.get("flagged_excluded", 0),
        }
        why = ", ".join(f"{n} {what}" for what, n in dropped.items() if n)
        return f"{collected} new ratings, none trainable" + (f" ({why})" if why else " (no rated answer)")

    def nothing_to_learn(self, reason: str, collected: int) -> RoundResult:
        self.metrics["seconds"] = self.timer.seconds
        self.finish(
            status="nothing_to_learn",
            reason=reason,
            watermark_to=self.watermark,
            metrics=self.metrics,
            samples_collected=collected,
        )
        log.info("round %s: nothing to learn: %s", self.round_id, reason)
        return self.result("nothing_to_learn", reason=reason)

    def finish(self, **values: Any) -> None:
        with self.sessions.begin() as session:
            finish_round(session, round_id=self.round_id, **values)

    def result(self, status: str, **values: Any) -> RoundResult:
        parent = self.parent
        return RoundResult(
            status,  # type: ignore[arg-type]
            self.round_id,
            self.model,
            samples=len(self.samples),
            reward_mean=self.metrics.get("reward_mean"),
            parent_version_id=parent["id"] if parent else None,
            watermark_from=self.since,
            watermark_to=self.watermark if status != "failed" else None,
            seconds=self.timer.seconds,
            metrics=self.metrics,
            **{k: str(v) if isinstance(v, Path) else v for k, v in values.items()},
        )


def _start(sessions: sessionmaker[Session], config: RoundConfig, model: str, parent_id: str | None) -> tuple[str, int]:
    try:
        with sessions.begin() as session:
            started = start_round(
                session,
                model=model,
                worker_id=config.worker_id,
                trigger=config.trigger,  # type: ignore[arg-type]
                base_version_id=parent_id,
                schedule_id=config.schedule_id,
                config=config.summary(),
            )
    except RoundBusyError as exc:
        raise RoundError(str(exc)) from exc
    return started.id, int(started.watermark_from or 0)


class _Timer:
    def __init__(self, on_stage: StageCallback | None, still_running: Callable[[], bool]) -> None:
        self.on_stage = on_stage
        self.still_running = still_running
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        # Every stage boundary checks the row, so a cancelled round stops before it trains or swaps.
        if not self.still_running():
            raise StageFailed(f"the round was cancelled before {stage}")
        if self.on_stage:
            self.on_stage(stage, None)
        started = time.perf_counter()
        yield
        self.seconds[stage] = time.perf_counter() - started
        if self.on_stage:
            self.on_stage(stage, self.seconds[stage])


def _still_running(sessions: sessionmaker[Session], round_id: str) -> bool:
    """A heartbeat that answers: False once the round was cancelled or declared dead."""
    with sessions.begin() as session:
        return heartbeat_round(session, round_id=round_id)


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
