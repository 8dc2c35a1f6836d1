"""Personal rounds: every scope (a user, a cohort) with at least ``min_ratings`` new ratings since
its last adapter trains its own LoRA adapter from its own feedback only, over the serving base, and
the server serves it to that scope from the next request on (docs/adapters.md).

    serving base (GET /admin/weights) -> due scopes (new ratings since each scope's watermark)
    -> per scope: collect its feedback -> advantages (the base round's rewards and baselines)
    -> train the adapters, up to ``scopes_per_pass`` scopes in one child and one pass (rows carry
    their adapter, ``learner.training.adapter_batch``), each continued from the scope's stored
    adapter, else fresh -> per scope: evaluate it against what serves the scope now, on the scope's
    held-out ratings (``learner.evaluation``, the base round's gate and margin) -> record it
    -> promote it through the server, or keep it a candidate with the gate's reason (``held_back``);
    with ``canary_share`` set, the server serves it to that share of the scope's sessions first and
    its judge decides from their live ratings (``canary``, docs/adapters.md)

When the base changes, an adapter trained over the old one stops serving (``server.adapter_directory``:
its scope falls back to its cohort, tenant or the base) and the scope's next personal round
continues its stored weights on the new base, from all of the scope's ratings (not only the new
ones), as soon as it has ``min_ratings`` of them.

Ratings of held-out prompts never train (as in base rounds). A scope whose training fails keeps its
serving adapter and its watermark; the other scopes go on. A pass that fails (one adapter diverging
fails the pass) is run again one child per scope, so the failure stays with its scope; a scope
whose stored adapter has other settings (rank, targets) trains alone. One pass for 8 scopes is
measured several times faster than 8 children back to back (BENCHMARKS.md): a child per scope
loads the base each time, and the pass batches every scope's rows into the same forwards.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from sqlalchemy.orm import Session, sessionmaker

from learner.collect import feedback_samples, learnable
from learner.corrections import corrections_of
from learner.evaluation.stage import Evaluation, evaluate_candidate, held_out_answers, load_eval_set, trainable
from learner.round_config import RoundConfig, RoundError
from learner.round_rewards import RoundRewards
from learner.server_api import ServerApi
from learner.training import TrainingOutcome, TrainingRequest, run_training_child
from learner.training.adapter_batch import batch_misfit, run_adapter_batch
from learner.training_request import AdapterSpec
from storage import (
    AdapterView,
    cohorts,
    collect_feedback,
    count_feedback_by_user,
    list_adapters,
    make_engine,
    make_session_factory,
    record_adapter,
    set_adapter_status,
)
from storage.flagged_users import flagged_users

__all__ = ["PersonalRoundConfig", "PersonalRoundResult", "ScopeResult", "run_personal_round"]

log = logging.getLogger(__name__)

ScopeStatus = Literal["succeeded", "canary", "held_back", "failed", "nothing_to_learn"]


@dataclass(frozen=True, slots=True)
class PersonalRoundConfig:
    """``base``: the server, database, checkpoints, rewards, losses and threads, as for a base round
    (its ``learning_rate`` and ``num_steps`` are the base round's: adapters have their own)."""

    base: RoundConfig
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    learning_rate: float = 1e-3
    num_steps: int = 4
    min_ratings: int = 8
    scope_kinds: tuple[Literal["user", "cohort"], ...] = ("user", "cohort")
    scopes_per_pass: int = 8  # adapters trained together in one child (1: one child per scope)
    canary_share: float = 0.0  # > 0: a passing adapter serves this share of its scope first (a canary)

    def __post_init__(self) -> None:
        # A scope's adapter learns from its own rated answers; rollout rewards (reward model, judge,
        # plugins) would score fresh answers of the base's sampling, not the scope's.
        if self.base.reward != "feedback":
            raise ValueError(
                f"personal rounds train on the scope's rated answers (reward feedback), not {self.base.reward}"
            )
        if self.min_ratings < 1 or self.num_steps < 1 or self.scopes_per_pass < 1 or not self.learning_rate > 0:
            raise ValueError("min_ratings, num_steps and scopes_per_pass must be >= 1 and learning_rate > 0")
        if not 0 <= self.canary_share < 1:
            raise ValueError(f"canary_share must be in [0, 1), not {self.canary_share}")


@dataclass(frozen=True, slots=True)
class Scope:
    tenant_id: str
    kind: Literal["user", "cohort"]
    name: str
    users: tuple[str, ...]  # whose feedback trains it: the user, or the cohort's members


@dataclass(frozen=True, slots=True)
class ScopeResult:
    tenant_id: str
    scope_kind: str
    scope: str
    status: ScopeStatus
    adapter_id: str | None = None
    samples: int = 0
    seconds: float = 0.0
    error: str | None = None
    reason: str | None = None  # why it had nothing to learn


@dataclass(slots=True, eq=False)
class _Prepared:
    """A due scope on its way through the round: what it trains on, then its training request."""

    scope: Scope
    parent: AdapterView | None  # the scope's latest adapter
    adapter_id: str  # the id its new adapter will have
    samples: list[Any]
    watermark: int
    started: float
    metrics: dict[str, Any] = field(default_factory=dict)
    request: TrainingRequest = field(init=False)

    def result(self, status: ScopeStatus, **values: Any) -> ScopeResult:
        scope = self.scope
        seconds = time.perf_counter() - self.started
        return ScopeResult(scope.tenant_id, scope.kind, scope.name, status, seconds=seconds, **values)


@dataclass(frozen=True, slots=True)
class PersonalRoundResult:
    base_version: str
    scopes: tuple[ScopeResult, ...]
    seconds: float

    @property
    def trained(self) -> list[ScopeResult]:
        return [s for s in self.scopes if s.status == "succeeded"]


def run_personal_round(
    config: PersonalRoundConfig, *, on_scope: Callable[[ScopeResult], None] | None = None
) -> PersonalRoundResult:
    """Train and serve every due scope's adapter; never raises for one scope's failure.

    Raises:
        RoundError: the server cannot be reached or refuses the admin key.
    """
    started = time.perf_counter()
    server = ServerApi(config.base.server_url, config.base.admin_key, timeout_s=120)
    serving = server.serving()
    db = make_engine(config.base.database_url)
    try:
        run = _PersonalRound(config, server, make_session_factory(db), serving)
        results = []

        def report(result: ScopeResult) -> None:
            log.info("personal round: %s %s/%s %s", result.status, result.tenant_id, result.scope, result.error or "")
            if on_scope is not None:
                on_scope(result)
            results.append(result)

        ready = []
        for scope, since, parent in run.due_scopes():
            prepared = run.prepare(scope, since, parent)
            if isinstance(prepared, ScopeResult):
                report(prepared)
            else:
                ready.append(prepared)
        for prepared, outcome in run.train(ready):
            report(run.finish(prepared, outcome))
    finally:
        db.dispose()
    return PersonalRoundResult(serving["weight_version"], tuple(results), time.perf_counter() - started)


@dataclass(slots=True)
class _PersonalRound:
    config: PersonalRoundConfig
    server: ServerApi
    sessions: sessionmaker[Session]
    serving: dict[str, Any]

    @property
    def model(self) -> str:
        return self.serving["model"]

    @property
    def base_version(self) -> str:
        return self.serving["weight_version"]

    @property
    def base_dir(self) -> Path:
        version = self.serving["version"]
        configured = self.config.base.model_dir
        return Path(version["checkpoint_path"]) if version else (configured or Path(self.serving["model_path"]))

    def due_scopes(self) -> list[tuple[Scope, int, AdapterView | None]]:
        """(scope, its watermark, its latest adapter) for every scope with enough new ratings."""
        config = self.config
        with self.sessions() as session:
            latest: dict[tuple[str, str, str], AdapterView] = {}
            for adapter in list_adapters(session, model=self.model, limit=1_000_000):  # newest first
                if adapter.status != "rejected":
                    latest.setdefault((adapter.tenant_id, adapter.scope_kind, adapter.scope), adapter)
            scopes = []
            if "user" in config.scope_kinds:
                scopes += [
                    Scope(tenant, "user", user, (user,))
                    for tenant, user in count_feedback_by_user(session, model=self.model, since=0)
                    if config.base.tenant_id in (None, tenant)
                ]
            if "cohort" in config.scope_kinds:
                scopes += [
                    Scope(tenant, "cohort", name, tuple(users))
                    for (tenant, name), users in cohorts(session).items()
                    if config.base.tenant_id in (None, tenant)
                ]
            due = []
            for scope in scopes:
                parent = latest.get((scope.tenant_id, scope.kind, scope.name))
                # Over a new base, the whole history trains again (starting from the stored weights).
                same_base = parent is not None and parent.base_version_id == self.base_version
                since = (parent.watermark or 0) if parent is not None and same_base else 0
                if self._new_ratings(session, scope, since) >= config.min_ratings:
                    due.append((scope, since, parent))
        return due

    def _new_ratings(self, session: Session, scope: Scope, since: int) -> int:
        counts = count_feedback_by_user(session, model=self.model, since=since, tenant_id=scope.tenant_id)
        return sum(counts.get((scope.tenant_id, user), 0) for user in scope.users)

    def prepare(self, scope: Scope, since: int, parent: AdapterView | None) -> _Prepared | ScopeResult:
        """The scope's training request (its feedback, advantages and starting adapter), or why it has
        none (``nothing_to_learn``, or ``failed`` computing its rewards)."""
        started = time.perf_counter()
        base = self.config.base
        with self.sessions.begin() as session:
            batch = collect_feedback(
                session,
                model=self.model,
                since=since,
                tenant_id=scope.tenant_id,
                end_users=scope.users,
                max_age=base.max_age,
            )
            flagged = flagged_users(session)
        rated = learnable(feedback_samples(batch.items), flagged)
        samples = trainable(rated, base.evaluation)
        prepared = _Prepared(scope, parent, f"ad-{uuid.uuid4().hex[:12]}", samples, batch.watermark, started)
        if not samples:
            return prepared.result("nothing_to_learn", reason=f"none of {len(rated)} rated answers trainable")
        prepared.metrics["held_out"] = len(rated) - len(samples)
        rewards = RoundRewards(
            base, self.sessions, self.model, prepared.adapter_id, batch.watermark, self.base_dir, prepared.metrics
        )
        try:
            advantages = rewards.feedback_advantages(samples)
            corrections = corrections_of(samples, self.base_dir)
        except (RoundError, RuntimeError, OSError, ValueError) as exc:
            return prepared.result("failed", samples=len(samples), error=f"{type(exc).__name__}: {exc}")
        if not corrections and not any(advantages):  # an adapter trained on them would equal its parent
            return prepared.result("nothing_to_learn", samples=len(samples), reason="every advantage is zero")
        prepared.samples = [*samples, *corrections]
        advantages = [*advantages, *[0.0] * len(corrections)]
        prepared.metrics["corrections"] = len(corrections)
        prepared.request = self._request(prepared, advantages)
        return prepared

    def _request(self, prepared: _Prepared, advantages: list[float]) -> TrainingRequest:
        base, config, parent = self.config.base, self.config, prepared.parent
        stored = Path(parent.checkpoint_path) if parent is not None else None
        continue_from = stored if stored is not None and stored.is_dir() else None
        prepared.metrics["continued_from"] = parent.id if parent is not None and continue_from else None
        return TrainingRequest(
            base_model_dir=self.base_dir,
            out_dir=base.checkpoint_dir / "adapters" / prepared.scope.tenant_id / prepared.adapter_id,
            samples=tuple(prepared.samples),
            config=base.train_config,
            num_steps=config.num_steps,
            learning_rate=config.learning_rate,
            num_threads=base.num_threads,
            timeout_s=base.train_timeout_s,
            advantages=tuple(advantages),
            reference_model_dir=self.base_dir,
            adapter=replace(config.adapter, init_dir=continue_from),
        )

    def train(self, ready: list[_Prepared]) -> Iterator[tuple[_Prepared, TrainingOutcome]]:
        """Each scope's training outcome: up to ``scopes_per_pass`` scopes in one pass, the rest (and
        every scope of a failed pass) one child each."""
        size = self.config.scopes_per_pass
        fits = [size > 1 and batch_misfit([p.request]) is None for p in ready]
        together = [p for p, fit in zip(ready, fits, strict=True) if fit]
        alone = [p for p, fit in zip(ready, fits, strict=True) if not fit]
        for start in range(0, len(together), size):
            chunk = together[start : start + size]
            if len(chunk) > 1:
                log.info("personal round: training %s in one pass", ", ".join(p.scope.name for p in chunk))
                outcomes = run_adapter_batch([p.request for p in chunk])
                if all(o.status == "succeeded" for o in outcomes):
                    yield from zip(chunk, outcomes, strict=True)
                    continue
                log.warning(
                    "personal round: a pass of %d scopes failed, training them one by one: %s",
                    len(chunk),
                    outcomes[0].error,
                )
            alone += chunk
        for prepared in alone:
            yield prepared, run_training_child(prepared.request)

    def finish(self, prepared: _Prepared, outcome: TrainingOutcome) -> ScopeResult:
        """Evaluate, record and promote (or hold back) a scope's trained adapter."""
        scope, parent, adapter_id, metrics = prepared.scope, prepared.parent, prepared.adapter_id, prepared.metrics
        samples = len(prepared.samples)
        try:
            if outcome.status != "succeeded" or outcome.checkpoint is None:
                raise RuntimeError(f"training {outcome.failure}: {outcome.error}")
            metrics.update(outcome.metrics[-1] if outcome.metrics else {})
            checkpoint = outcome.checkpoint.path
            evaluation = self._evaluate(scope, checkpoint, parent, prepared.watermark)
            with self.sessions.begin() as session:
                record_adapter(
                    session,
                    adapter_id=adapter_id,
                    model=self.model,
                    tenant_id=scope.tenant_id,
                    scope_kind=scope.kind,
                    scope=scope.name,
                    checkpoint_path=str(checkpoint),
                    base_version_id=self.base_version,
                    parent_id=parent.id if parent else None,
                    sha256=outcome.checkpoint.sha256,
                    watermark=prepared.watermark,
                    ratings=samples,
                    metrics=metrics | (evaluation.metrics if evaluation else {}),
                )
                if evaluation is not None:
                    set_adapter_status(
                        session,
                        adapter_id=adapter_id,
                        status="candidate",
                        reason=evaluation.reason,
                        evaluation=evaluation.record,
                    )
            if evaluation is not None and not evaluation.passed:
                return prepared.result("held_back", adapter_id=adapter_id, samples=samples, error=evaluation.reason)
            status = self._serve(adapter_id)
        except (RoundError, RuntimeError, OSError, ValueError) as exc:  # EvalFailed is a RuntimeError
            return prepared.result("failed", samples=samples, error=f"{type(exc).__name__}: {exc}")
        return prepared.result(status, adapter_id=adapter_id, samples=samples)

    def _evaluate(
        self, scope: Scope, checkpoint: Path, parent: AdapterView | None, watermark: int
    ) -> Evaluation | None:
        """The gate for a scope's adapter: scored against what serves the scope now (its adapter over
        this base, else the base), on the scope's held-out ratings (or the eval prompts file)."""
        evaluation = self.config.base.evaluation
        if not evaluation.on:
            return None
        with self.sessions.begin() as session:
            history = collect_feedback(
                session,
                model=self.model,
                since=0,
                until=watermark,
                tenant_id=scope.tenant_id,
                end_users=scope.users,
            )
        eval_set = load_eval_set(
            evaluation, held_out_answers(history.items, evaluation, self.config.base.reward_mapping)
        )
        current = (
            parent if parent and parent.status == "serving" and parent.base_version_id == self.base_version else None
        )
        return evaluate_candidate(
            evaluation,
            eval_set,
            candidate=checkpoint,
            serving=Path(current.checkpoint_path) if current else self.base_dir,
            serving_version=current.id if current else None,
            root=self.base_dir,  # an adapter's lineage starts at the base it is trained over
            num_threads=self.config.base.num_threads,
        )

    def _serve(self, adapter_id: str) -> ScopeStatus:
        """Promote the adapter, or start its canary; a refusal rejects it."""
        try:
            if self.config.canary_share > 0:
                self.server.start_canary(adapter_id, self.config.canary_share, reason="personal round")
                return "canary"
            self.server.promote_adapter(adapter_id, reason="personal round")
            return "succeeded"
        except RoundError as exc:
            with self.sessions.begin() as session:
                set_adapter_status(session, adapter_id=adapter_id, status="rejected", reason=str(exc))
            raise
