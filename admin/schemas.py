"""Response bodies of the admin API (see server.response_models: they document what the routes build)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.response_models import ObjectList, ObjectPage, view_model
from storage.adapters import AdapterView
from storage.audit import AdminActionView
from storage.canaries import CanaryView
from storage.completions import CompletionView
from storage.data_deletions import DeletionView
from storage.model_versions import ModelVersionView
from storage.rating_trend import AdapterRating, VersionRating
from storage.rounds import TrainingRoundView
from storage.schedules import ScheduleView
from storage.user_data import SessionView


class EngineReplica(BaseModel):
    id: str = Field(description="The replica's name: its URL, or the in-process engine's name")
    object: Literal["engine_replica"]
    healthy: bool
    drained: bool
    updating_weights: bool
    weight_version: str | None
    in_flight: int
    cache_hit_ratio: float | None = Field(description="Cached over prompt tokens this gateway sent it; null before any")


class ApiKey(BaseModel):
    id: str
    object: Literal["api_key"]
    tenant_id: str
    name: str
    hint: str = Field(description="tdm- and the first 4 secret characters, then …")
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


class CreatedKey(ApiKey):
    key: str = Field(description="The key itself: in this answer only")


class Tenant(BaseModel):
    id: str
    name: str
    created_at: datetime | None
    active_keys: int


class RevokedTenant(Tenant):
    revoked_keys: list[str] = Field(description="Ids of the keys this call revoked")


class RunSummary(BaseModel):
    id: str
    object: Literal["run"]
    model: str
    status: str
    trigger: str
    schedule_id: str | None = Field(description="The schedule that fired it; null: none")
    base_version_id: str | None
    produced_version_id: str | None
    watermark_from: int | None
    watermark_to: int | None
    samples_collected: int | None
    samples_trained: int | None
    metrics: dict[str, Any]
    duration_s: float | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None = Field(description="The last line of the error")
    reason: str | None = Field(description="Why a nothing_to_learn round could not change the model")


class RunTimings(BaseModel):
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    duration_s: float | None
    stages_s: dict[str, float]


class Watermark(BaseModel):
    from_: int | None = Field(alias="from")
    to: int | None


RunDetail = view_model(
    "RunDetail",
    TrainingRoundView,
    "A round with its timings; ``error`` is the end of its traceback.",
    object=(Literal["run"], ...),
    timings=(RunTimings, ...),
    watermark=(Watermark, ...),
)


class VersionAncestor(BaseModel):
    id: str
    status: str
    created_at: datetime
    watermark: int | None
    metrics: dict[str, Any]


VERSION_FIELDS: dict[str, Any] = {
    "object": (Literal["model_version"], ...),
    "lineage": (list[str], Field(description="Its id, then its ancestors' ids")),
}
ModelVersion = view_model("ModelVersion", ModelVersionView, "A model version and its lineage.", **VERSION_FIELDS)
ModelVersionDetail = view_model(
    "ModelVersionDetail",
    ModelVersionView,
    "A model version, its lineage and its ancestors' rows.",
    **VERSION_FIELDS,
    ancestors=(list[VersionAncestor], ...),
)

SCHEDULE_TIMES: dict[str, Any] = {
    "next_fire_at": (datetime | None, Field(description="null while disabled")),
    "last_fired_at": (datetime | None, ...),
}
Schedule = view_model("Schedule", ScheduleView, "A training schedule.", **SCHEDULE_TIMES)
DeletedSchedule = view_model(
    "DeletedSchedule", ScheduleView, "The schedule as it was.", **SCHEDULE_TIMES, deleted=(Literal[True], ...)
)


class ScheduleRun(BaseModel):
    task_id: str
    schedule_id: str


RatedVersion = view_model(
    "RatedVersion", VersionRating, "How users rated one version.", object=(Literal["version_rating"], ...)
)
RatedAdapter = view_model(
    "RatedAdapter", AdapterRating, "How a scope rated one adapter version.", object=(Literal["adapter_rating"], ...)
)


class RatedAdapterList(ObjectList[RatedAdapter]):  # type: ignore[valid-type]
    """Adapter versions by scope, each scope's in the order they first answered."""


Adapter = view_model(
    "Adapter", AdapterView, "A LoRA adapter version of one scope of a tenant.", object=(Literal["adapter"], ...)
)


class AdapterSwap(BaseModel):
    adapter: Adapter  # type: ignore[valid-type]
    previous_adapter_id: str | None = Field(description="The adapter its scope served before; null: none")


class AdapterReset(BaseModel):
    retired_adapter_id: str | None = Field(description="The adapter the scope served until now; null: none")


Canary = view_model(
    "Canary",
    CanaryView,
    "A candidate adapter serving a share of its scope until live ratings decide it.",
    object=(Literal["canary"], ...),
)


class CanaryStarted(BaseModel):
    canary: Canary  # type: ignore[valid-type]
    superseded_canary_id: str | None = Field(description="The scope's canary this one ended; null: none ran")


class CanaryList(ObjectList[Canary]):  # type: ignore[valid-type]
    """Canaries, newest first."""


class Cohort(BaseModel):
    name: str
    users: list[str] = Field(description="Its members, sorted")


class UserDataExport(BaseModel):
    object: Literal["user_data"]
    tenant_id: str
    user: str
    first_seen_at: datetime
    sessions: list[SessionView]
    completions: list[CompletionView]
    deletions: list[DeletionView] = Field(description="Earlier deletions of the same user")
    adapters: list[AdapterView] = Field(description="Their personal LoRA adapter versions")


class UserDataDeletion(BaseModel):
    object: Literal["user_data.deletion"]
    tenant_id: str
    user: str
    deleted_at: datetime
    counts: dict[str, int] = Field(description="Rows deleted, by kind")


class FlaggedUser(BaseModel):
    object: Literal["flagged_user"]
    tenant_id: str
    user: str
    reason: str | None
    flagged_by: str = Field(description="The admin actor who flagged the user")
    flagged_at: datetime


class FlaggedUserList(ObjectList[FlaggedUser]):
    """End users whose ratings train nothing."""


class EngineReplicaList(ObjectList[EngineReplica]):
    """Every serving replica."""


class ApiKeyList(ObjectList[ApiKey]):
    """API keys, newest first."""


class TenantList(ObjectList[Tenant]):
    """Every tenant."""


class RatedVersionList(ObjectList[RatedVersion]):  # type: ignore[valid-type]
    """Versions in the order they first answered, oldest first."""


class AdapterList(ObjectList[Adapter]):  # type: ignore[valid-type]
    """Adapters, newest first."""


class CohortList(ObjectList[Cohort]):
    """A tenant's cohorts by name."""


class AuditPage(ObjectPage[AdminActionView]):
    """Admin actions, newest first."""


class RunPage(ObjectPage[RunSummary]):
    """Rounds, newest first."""


class ModelVersionPage(ObjectPage[ModelVersion]):  # type: ignore[valid-type]
    """Model versions, newest first."""


class SchedulePage(ObjectPage[Schedule]):  # type: ignore[valid-type]
    """Schedules, newest first."""


class ServerTool(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any] = Field(description="JSON Schema of the arguments")
    source: str = Field(description="'python' (the built-in, in the sandbox) or the dotted path it was loaded from")
    timeout_s: float
    tenants: list[str] = Field(description="tenants whose requests this gateway runs it for")


class ServerToolList(ObjectList[ServerTool]):
    """The tools this gateway runs itself (TANDEM_TOOLS)."""

    max_steps: int = Field(description="turns of tool calls the gateway runs per request (TANDEM_TOOL_MAX_STEPS)")


class TenantTools(BaseModel):
    tenant_id: str
    tools: list[str] = Field(description="gateway tools run for the tenant's requests")
