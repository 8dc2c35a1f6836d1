"""/admin/canaries: a candidate serving a share of its scope first, judged by live ratings.

``POST /admin/adapters/{id}/canary`` starts one for an adapter (a personal round does it by itself
when TANDEM_ADAPTER_CANARY_SHARE is set), ``POST /admin/models/{id}/canary`` one for a base model
version (on part of the engine pool's replicas; a learning round does it when
TANDEM_LEARN_CANARY_SHARE is set). The gateway's judge (``server.canary.judge``) then promotes the
candidate when its thumbs-up rate is not worse than the control's by more than the margin, rolls it
back when it is, and rolls it back when undecided at the deadline. An operator may decide first
(``/promote``, ``/rollback``). Every start and decision is audited with its numbers.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session, sessionmaker

from admin import schemas
from admin.audited import audited, read
from admin.deps import ActorDep, ReasonRequest, SessionsDep, audit_refusal, in_thread
from admin.routes.adapters import adapter_or_404, check_folder, serve_changes
from server.canary.decision import CanaryRules, tallies
from server.canary.judge import CanaryJudge
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import CONFLICT, ERRORS
from server.weights import WeightService
from storage.adapters import ScopeKind, serving_adapter
from storage.canaries import (
    CanaryScope,
    CanaryView,
    Decision,
    arm_thumbs,
    decide_canary,
    get_canary,
    list_canaries,
    start_canary,
)
from storage.learning_errors import NotFoundError
from storage.model_versions import ModelVersionView, get_version
from storage.times import utcnow

router = APIRouter()


class CanaryStart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    share: float = Field(gt=0, lt=1, description="The share of the scope's sessions the candidate serves")
    min_ratings: int | None = Field(None, ge=1, le=1_000_000, description="Rated answers a side needs first")
    margin: float | None = Field(None, ge=0, lt=1, description="Thumbs-up rate the candidate may trail by")
    confidence: float | None = Field(None, gt=0.5, lt=1, description="Posterior probability a decision needs")
    max_duration_s: float | None = Field(None, gt=0, le=365 * 86400, description="Rolled back when undecided then")
    reason: str | None = Field(None, max_length=1000, description="Why, for the audit log")


def canary_view(canary: CanaryView) -> dict[str, Any]:
    return {**asdict(canary), "object": "canary"}


def _judge(request: Request) -> CanaryJudge:
    return cast(CanaryJudge, request.app.state.canaries)


@router.post(
    "/admin/adapters/{adapter_id}/canary",
    status_code=201,
    response_model=schemas.CanaryStarted,
    responses={**ERRORS, **CONFLICT},
)
async def start(
    adapter_id: str, body: CanaryStart, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    """Serve a candidate adapter to a sticky share of its scope's sessions until live ratings decide it."""
    rules = _rules(body, request)
    serving_base = request.app.state.engine.model_info().weight_version

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        candidate = adapter_or_404(session, adapter_id)
        if candidate.status != "candidate":
            raise ApiError(409, f"Cannot canary {adapter_id}: it is {candidate.status}.", code="version_state")
        if candidate.base_version_id not in (None, serving_base):
            raise ApiError(
                409,
                f"Cannot canary {adapter_id}: it was trained over {candidate.base_version_id}, "
                f"and {serving_base} serves now.",
                code="version_state",
            )
        check_folder(candidate.checkpoint_path)
        control = serving_adapter(
            session,
            model=candidate.model,
            tenant_id=candidate.tenant_id,
            scope_kind=cast(ScopeKind, candidate.scope_kind),
            scope=candidate.scope,
        )
        scope = CanaryScope(candidate.model, candidate.tenant_id, candidate.scope_kind, candidate.scope)
        control_id = control.id if control else None
        return _begin(session, _new_id(), scope, candidate.id, control_id, body, rules, actor)

    started = await audited(sessions, work, actor=actor, action="canary.start", target=adapter_id, status_code=201)
    await serve_changes(request)
    return json_response(started, 201)


@router.post(
    "/admin/models/{version_id}/canary",
    status_code=201,
    response_model=schemas.CanaryStarted,
    responses={**ERRORS, **CONFLICT},
)
async def start_base(
    version_id: str, body: CanaryStart, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    """Serve a candidate model version from part of the engine pool, to a sticky share of every
    session, until live ratings decide it."""
    weights: WeightService = request.app.state.weights
    rules = _rules(body, request)
    info = request.app.state.engine.model_info()
    canary_id = _new_id()

    def work(session: Session) -> tuple[tuple[dict[str, Any], str], dict[str, Any]]:
        version = _candidate_version(session, version_id, info.served_model_name)
        scope = CanaryScope.base(info.served_model_name)
        answer, details = _begin(session, canary_id, scope, version.id, info.weight_version, body, rules, actor)
        return (answer, version.checkpoint_path), details

    try:
        weights.check_splittable()
    except ApiError as exc:
        raise await audit_refusal(sessions, exc, actor=actor, action="canary.start", target=version_id) from exc
    started, checkpoint = await audited(
        sessions, work, actor=actor, action="canary.start", target=version_id, status_code=201
    )
    try:
        await weights.start_split(checkpoint, version_id, body.share)
    except ApiError as exc:  # the candidate serves nobody: its canary ends at once, saying why
        await in_thread(_supersede, sessions, canary_id, f"the engine pool could not load it: {exc.message}", actor)
        raise await audit_refusal(sessions, exc, actor=actor, action="canary.start", target=version_id) from exc
    await serve_changes(request)
    return json_response(started, 201)


def _rules(body: CanaryStart, request: Request) -> CanaryRules:
    """The gateway's defaults, with what ``body`` sets."""
    given = {k: v for k, v in body.model_dump(exclude={"share", "reason"}).items() if v is not None}
    return replace(_judge(request).defaults, **given)


def _new_id() -> str:
    return f"cnr-{uuid.uuid4().hex[:16]}"


def _begin(
    session: Session,
    canary_id: str,
    scope: CanaryScope,
    candidate_id: str,
    control_id: str | None,
    body: CanaryStart,
    rules: CanaryRules,
    actor: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Record the running canary (superseding the scope's); the answer and the audit details."""
    now = utcnow()
    canary, superseded = start_canary(
        session,
        canary_id=canary_id,
        scope=scope,
        candidate_id=candidate_id,
        control_id=control_id,
        share=body.share,
        rules=rules.record(),
        started_by=actor,
        deadline=now + timedelta(seconds=rules.max_duration_s),
        now=now,
    )
    details = {"canary_id": canary.id, "share": body.share, "superseded": superseded, "reason": body.reason}
    return {"canary": canary_view(canary), "superseded_canary_id": superseded}, details | rules.record()


def _candidate_version(session: Session, version_id: str, model: str) -> ModelVersionView:
    try:
        version = get_version(session, version_id=version_id)
    except NotFoundError as exc:
        raise ApiError(404, f"{exc.args[0]}.", param="version_id", code="version_not_found") from exc
    if version.model != model:
        message = f"Model version {version_id} belongs to {version.model}, but this server serves {model}."
        raise ApiError(400, message, param="version_id", code="wrong_model")
    if version.status != "candidate":
        raise ApiError(409, f"Cannot canary {version_id}: it is {version.status}.", code="version_state")
    return version


def _supersede(sessions: sessionmaker[Session], canary_id: str, reason: str, actor: str) -> None:
    with sessions.begin() as session:
        decide_canary(session, canary_id=canary_id, decision="superseded", reason=reason, numbers={}, decided_by=actor)


@router.get("/admin/canaries", response_model=schemas.CanaryList, responses=ERRORS)
async def get_canaries(
    _: AdminDep,
    sessions: SessionsDep,
    request: Request,
    tenant_id: Annotated[str | None, Query(max_length=64)] = None,
    status: Annotated[Literal["running", "promoted", "rolled_back", "superseded"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    """Canaries of the served model, newest first."""
    model: str = request.app.state.adapters.model

    def work(session: Session) -> list[dict[str, Any]]:
        found = list_canaries(session, model=model, tenant_id=tenant_id, status=status, limit=limit)
        return [canary_view(c) for c in found]

    return json_response({"object": "list", "data": await in_thread(read, sessions, work)})


@router.get("/admin/canaries/{canary_id}", response_model=schemas.Canary, responses=ERRORS)
async def get_one(canary_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    """One canary; a running one's numbers are counted now."""

    def work(session: Session) -> dict[str, Any]:
        canary = _find(session, canary_id)
        if canary.status == "running":
            canary = replace(canary, numbers=_tallied(session, canary)[1])
        return canary_view(canary)

    return json_response(await in_thread(read, sessions, work))


@router.post("/admin/canaries/{canary_id}/promote", response_model=schemas.Canary, responses={**ERRORS, **CONFLICT})
async def promote(
    canary_id: str, actor: ActorDep, sessions: SessionsDep, request: Request, body: ReasonRequest | None = None
) -> Response:
    """Decide now: serve the candidate for its scope."""
    return await _decide("promoted", canary_id, actor, sessions, request, body)


@router.post("/admin/canaries/{canary_id}/rollback", response_model=schemas.Canary, responses={**ERRORS, **CONFLICT})
async def rollback(
    canary_id: str, actor: ActorDep, sessions: SessionsDep, request: Request, body: ReasonRequest | None = None
) -> Response:
    """Decide now: reject the candidate; its scope keeps what served before."""
    return await _decide("rolled_back", canary_id, actor, sessions, request, body)


async def _decide(
    decision: Decision,
    canary_id: str,
    actor: str,
    sessions: sessionmaker[Session],
    request: Request,
    body: ReasonRequest | None,
) -> Response:
    action = "promote" if decision == "promoted" else "rollback"
    if await in_thread(read, sessions, lambda session: _find(session, canary_id).scope_kind == "base"):
        # The engine pool first (the candidate everywhere, or nowhere), then the row.
        weights: WeightService = request.app.state.weights
        try:
            await weights.end_split(decision == "promoted")
        except ApiError as exc:
            if exc.code == "canary_state":
                exc = ApiError(
                    409, f"Canary {canary_id}: this gateway's engine pool does not serve it.", code="canary_state"
                )
            raise await audit_refusal(sessions, exc, actor=actor, action=f"canary.{action}", target=canary_id) from exc

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        canary = _find(session, canary_id)
        tallies, numbers = _tallied(session, canary)
        reason = f"{(body.reason if body and body.reason else 'decided by an operator')} ({tallies})"
        if not decide_canary(
            session, canary_id=canary_id, decision=decision, reason=reason, numbers=numbers, decided_by=actor
        ):
            raise ApiError(409, f"Canary {canary_id} is already {canary.status}.", code="canary_state")
        return canary_view(get_canary(session, canary_id=canary_id)), {"reason": reason, **numbers}

    decided = await audited(sessions, work, actor=actor, action=f"canary.{action}", target=canary_id)
    await serve_changes(request)
    return json_response(decided)


def _find(session: Session, canary_id: str) -> CanaryView:
    try:
        return get_canary(session, canary_id=canary_id)
    except NotFoundError as exc:
        raise ApiError(404, f"{exc.args[0]}.", param="canary_id", code="canary_not_found") from exc


def _tallied(session: Session, canary: CanaryView) -> tuple[str, dict[str, Any]]:
    """A running canary's tallies now, in words and in numbers (an ended one's as decided)."""
    if canary.status != "running":
        return canary.reason or canary.status, canary.numbers
    thumbs = arm_thumbs(session, canary_id=canary.id)
    return tallies(thumbs["canary"], thumbs["control"], CanaryRules.of(canary.rules))
