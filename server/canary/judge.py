"""The gateway's canary judge: every few seconds, reads each running canary's live ratings and
promotes, rolls back or keeps it (``server.canary.decision``), then serves the outcome at once.

Several gateways may judge the same canaries: a decision is one conditional update
(``storage.canaries.decide_canary``), so exactly one of them applies it; the others serve it from
their next reread. Each decision is written to the audit log in its transaction.

A base canary lives in one gateway's engine pool (the split, ``server.weights``): that gateway judges
it, changing the pool first (the candidate everywhere, or nowhere) and then the row. Another gateway
only rolls it back at its deadline. A split whose canary is no longer running (decided elsewhere, or
superseded) is rolled back; a running base canary whose candidate no longer splits this gateway's
pool while it did before is superseded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from server.adapter_directory import AdapterDirectory
from server.canary.decision import CanaryRules, Verdict, judge
from server.errors import ApiError
from server.weights import WeightService
from storage import get_adapter
from storage.audit import record_admin_action
from storage.canaries import CanaryView, Decision, arm_thumbs, decide_canary, list_canaries, record_numbers
from storage.model_versions import get_version
from storage.times import utcnow

log = logging.getLogger("tandem.canary")

JUDGE = "canary-judge"


class CanaryJudge:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        directory: AdapterDirectory,
        weights: WeightService,
        *,
        check_s: float,
        defaults: CanaryRules,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._sessions = sessions
        self._directory = directory
        self._weights = weights
        self._check_s = check_s
        self.defaults = defaults  # the rules of a canary started without its own
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def judge_all(self) -> int:
        """Judge every running canary of the served model now; how many were decided."""
        split = self._weights.split_version()
        decided, for_the_pool, base_running = await asyncio.to_thread(self._judge_all, split)
        for canary, verdict in for_the_pool:
            decided += await self._decide_base(canary, verdict)
        if split is not None and split not in base_running:  # decided elsewhere, or superseded
            await self._weights.end_split(False)
            log.info("base canary split ended: its canary no longer runs", extra={"weight_version": split})
        if decided:
            await self._directory.refresh()
        return decided

    def _judge_all(self, split: str | None) -> tuple[int, list[tuple[CanaryView, Verdict]], set[str]]:
        """Adapter canaries are decided here; base canaries this pool splits for come back with a
        decision to apply to the pool first; the ids of the base candidates that were running."""
        with self._sessions() as session:
            running = list_canaries(session, model=self._directory.model, status="running", limit=1_000)
        decided, for_the_pool = 0, []
        for canary in running:
            here, pending = self._judge_one(canary, holds_split=canary.candidate_id == split)
            decided += here
            if pending is not None:
                for_the_pool.append((canary, pending))
        return decided, for_the_pool, {c.candidate_id for c in running if c.scope_kind == "base"}

    def _judge_one(self, canary: CanaryView, *, holds_split: bool) -> tuple[bool, Verdict | None]:
        """(decided here, a base canary's decision for the pool to apply first)."""
        base = canary.scope_kind == "base"
        with self._sessions.begin() as session:
            status = (
                get_version(session, version_id=canary.candidate_id).status
                if base
                else get_adapter(session, adapter_id=canary.candidate_id).status
            )
            if status != "candidate":  # an operator decided it outside the canary
                verdict = Verdict(None, f"the candidate became {status} outside the canary", canary.numbers)
                return self._decide(session, canary, verdict, "superseded"), None
            thumbs = arm_thumbs(session, canary_id=canary.id)
            elapsed = (self._clock() - canary.started_at).total_seconds()
            rules = CanaryRules.of(canary.rules)
            verdict = judge(thumbs["canary"], thumbs["control"], rules, elapsed_s=elapsed)
            if verdict.numbers != canary.numbers:
                record_numbers(session, canary_id=canary.id, numbers=verdict.numbers)
            if verdict.decision is None:
                return False, None
            if base and holds_split:
                return False, verdict
            if base:  # another gateway's pool serves it: only its deadline is decided here
                if elapsed < rules.max_duration_s:
                    return False, None
                reason = f"timed out: no engine pool decided it before its deadline ({verdict.reason})"
                verdict = Verdict("rolled_back", reason, verdict.numbers)
            return self._decide(session, canary, verdict, verdict.decision or "rolled_back"), None

    async def _decide_base(self, canary: CanaryView, verdict: Verdict) -> int:
        """The pool first (the candidate everywhere, or nowhere), then the row."""
        try:
            await self._weights.end_split(verdict.decision == "promoted")
        except ApiError as exc:
            if exc.code == "canary_state":  # no longer split: ended meanwhile
                return 0
            # The rest of the pool refused the candidate: it serves nowhere, and is rolled back.
            await self._weights.end_split(False)
            verdict = Verdict("rolled_back", f"{verdict.reason}; promotion failed: {exc.message}", verdict.numbers)
        decision: Decision = verdict.decision or "rolled_back"

        def record() -> bool:
            with self._sessions.begin() as session:
                return self._decide(session, canary, verdict, decision)

        return int(await asyncio.to_thread(record))

    def _decide(self, session: Session, canary: CanaryView, verdict: Verdict, decision: Decision) -> bool:
        won = decide_canary(
            session,
            canary_id=canary.id,
            decision=decision,
            reason=verdict.reason,
            numbers=verdict.numbers,
            decided_by=JUDGE,
        )
        if won:
            record_admin_action(
                session,
                actor=JUDGE,
                action=f"canary.{decision}",
                target=canary.id,
                details={"candidate_id": canary.candidate_id, "reason": verdict.reason, **verdict.numbers},
                status_code=200,
            )
            log.info(
                "canary decided",
                extra={
                    "canary_id": canary.id,
                    "decision": decision,
                    "candidate_id": canary.candidate_id,
                    "reason": verdict.reason,
                },
            )
        return won

    async def start(self) -> None:
        self._task = asyncio.create_task(self._keep_judging())

    async def _keep_judging(self) -> None:
        while True:
            await asyncio.sleep(self._check_s)
            try:
                await self.judge_all()
            except SQLAlchemyError as exc:  # the canaries wait for the database; serving goes on
                log.warning("could not judge the canaries: %s", str(exc).splitlines()[0])
            except Exception:  # the next check tries again: one failure must not end the judging
                log.exception("could not judge the canaries")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
