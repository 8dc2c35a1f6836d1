"""ORM models, engine setup and the repositories the server, learner and admin share."""

from storage.api_keys import (
    ApiKeyIdentity,
    count_active_api_keys,
    create_api_key,
    list_api_keys,
    lookup_api_key,
    revoke_api_key,
)
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
from storage.tenants import DEFAULT_TENANT_ID, ensure_tenant

__all__ = [
    "DEFAULT_TENANT_ID",
    "ApiKeyIdentity",
    "ChoiceView",
    "CompletionView",
    "FeedbackEventView",
    "FeedbackView",
    "WriteResult",
    "completion_tenant",
    "count_active_api_keys",
    "create_api_key",
    "ensure_tenant",
    "get_completion_view",
    "list_api_keys",
    "lookup_api_key",
    "make_engine",
    "make_session_factory",
    "revoke_api_key",
    "write_records",
]
