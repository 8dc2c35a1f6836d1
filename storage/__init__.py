"""ORM models, engine setup and the repositories the server, learner and admin share."""

from storage.api_keys import (
    ApiKeyIdentity,
    count_active_api_keys,
    create_api_key,
    list_api_keys,
    lookup_api_key,
    revoke_api_key,
)
from storage.audit import AdminActionView, list_admin_actions, record_admin_action
from storage.completions import (
    ChoiceView,
    CompletionView,
    FeedbackEventView,
    FeedbackView,
    completion_tenant,
    get_completion_view,
)
from storage.conversation_writes import WriteResult, write_records
from storage.db import make_engine, make_session_factory
from storage.feedback_collect import FeedbackBatch, FeedbackItem, RatingRecord, collect_feedback, rating_history
from storage.feedback_count import count_feedback_since
from storage.learning_errors import LearningStateError, NotFoundError, RoundBusyError
from storage.model_versions import (
    ModelVersionView,
    get_version,
    list_versions,
    record_model_version,
    serving_version,
    set_version_status,
)
from storage.rounds import (
    TrainingRoundView,
    cancel_round,
    fail_stale_rounds,
    finish_round,
    get_round,
    heartbeat_round,
    last_watermark,
    list_rounds,
    queue_round,
    start_round,
)
from storage.tenants import DEFAULT_TENANT_ID, ensure_tenant

__all__ = [
    "DEFAULT_TENANT_ID",
    "AdminActionView",
    "ApiKeyIdentity",
    "ChoiceView",
    "CompletionView",
    "FeedbackBatch",
    "FeedbackEventView",
    "FeedbackItem",
    "FeedbackView",
    "LearningStateError",
    "ModelVersionView",
    "NotFoundError",
    "RatingRecord",
    "RoundBusyError",
    "TrainingRoundView",
    "WriteResult",
    "cancel_round",
    "collect_feedback",
    "completion_tenant",
    "count_active_api_keys",
    "count_feedback_since",
    "create_api_key",
    "ensure_tenant",
    "fail_stale_rounds",
    "finish_round",
    "get_completion_view",
    "get_round",
    "get_version",
    "heartbeat_round",
    "last_watermark",
    "list_admin_actions",
    "list_api_keys",
    "list_rounds",
    "list_versions",
    "lookup_api_key",
    "make_engine",
    "make_session_factory",
    "queue_round",
    "rating_history",
    "record_admin_action",
    "record_model_version",
    "revoke_api_key",
    "serving_version",
    "set_version_status",
    "start_round",
    "write_records",
]
