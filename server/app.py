"""The gateway application: wiring of storage, the conversation log, the engine and the routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from limits.aio.strategies import MovingWindowRateLimiter
from sqlalchemy import Engine as SqlEngine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from migrations.migrate import upgrade
from server.adapter_directory import AdapterDirectory
from server.auth import Authenticator, AuthPolicy
from server.body_limit import BodyLimitMiddleware
from server.canary.decision import CanaryRules
from server.canary.judge import CanaryJudge
from server.chat_service import ChatService
from server.completions import CompletionService
from server.conversation_log import ConversationLog
from server.distributed_rollout import DistributedRollouts
from server.engine_admin import EngineAdmin
from server.engine_factory import open_engine
from server.engines.base import Engine
from server.errors import install_error_handlers
from server.json_bodies import JsonBodyMiddleware
from server.metrics import GatewayMetrics, MetricsMiddleware
from server.rate_limits import ReleaseAdmissions, RequestLimiter, limiter_for
from server.rollouts import RolloutService
from server.routes import router
from server.routes.deps import authenticate_first
from server.server_tools import ServerTools
from server.weights import WeightService
from storage.api_keys import count_active_api_keys
from storage.db import make_engine, make_session_factory
from storage.rate_limits import Limits
from tandem.logging import RequestLogMiddleware
from tandem.models import resolve_model
from tandem.sandbox import SandboxUnavailable
from tandem.settings import Settings
from tandem.tool_registry import ToolError, registry_of

logger = logging.getLogger(__name__)

MIGRATION_RETRY_S = 5.0

__all__ = ["ServingUnprotectedError", "StartupError", "create_app"]


class StartupError(RuntimeError):
    """The server cannot start with these settings; the message says what to change."""


class ServingUnprotectedError(StartupError):
    """A non-loopback bind with no API key and no admin key: anyone could use the server."""


def refuse_unprotected(settings: Settings) -> None:
    """Raise ServingUnprotectedError when binding beyond loopback with no key that could protect it."""
    if settings.server.binds_loopback or settings.server.admin_key is not None:
        return
    url = settings.resolved_database_url
    db = make_engine(url)
    try:
        upgrade(url)
        with make_session_factory(db)() as session:
            keys = count_active_api_keys(session)
    except OperationalError as exc:
        raise StartupError(
            f"Cannot check whether API keys protect {settings.server.host}: the database is unreachable ({exc.orig}). "
            "Set TANDEM_ADMIN_KEY to serve while it is down, or bind 127.0.0.1."
        ) from exc
    finally:
        db.dispose()
    if keys == 0:
        raise ServingUnprotectedError(
            f"Refusing to serve on {settings.server.host}: it is reachable from other machines and no API key is "
            "configured. Create one with `tandem keys create`, set TANDEM_ADMIN_KEY, or bind 127.0.0.1."
        )


async def _migrate(url: str) -> asyncio.Task[None] | None:
    """Upgrade the schema. An unreachable database does not stop serving: answers are journaled and
    stored once it is back; the migration is retried in the background until then (the returned task)."""
    try:
        await asyncio.to_thread(upgrade, url)
        return None
    except OperationalError as exc:
        logger.error(
            "the database is unreachable at start: serving anyway (answers are journaled, only the admin key "
            "and keys verified later are accepted); retrying the migration every %.0f s",
            MIGRATION_RETRY_S,
            extra={"error": str(exc.orig)},
        )

    async def retry() -> None:
        while True:
            await asyncio.sleep(MIGRATION_RETRY_S)
            try:
                await asyncio.to_thread(upgrade, url)
            except OperationalError as exc:
                logger.warning("the database is still unreachable", extra={"error": str(exc.orig)})
                continue
            logger.info("the database is reachable: schema migrated")
            return

    return asyncio.create_task(retry())


def _default_tenant_limits(settings: Settings) -> Limits:
    return Limits(
        requests_per_minute=settings.server.tenant_requests_per_minute or None,
        tokens_per_minute=settings.server.tenant_tokens_per_minute or None,
        max_concurrent_requests=settings.server.tenant_max_concurrent_requests or None,
    )


def _load_tokenizer(settings: Settings, engine: Engine) -> PreTrainedTokenizerBase:
    path = Path(engine.model_info().model_path)
    if not (path / "tokenizer_config.json").exists():  # a remote engine's path is not on this machine
        path = resolve_model(settings.engine.model, settings.storage.model_cache_dir)
    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True, slots=True)
class _Given:
    """What a caller (a test, `tandem serve`) may hand in instead of having it opened at start-up."""

    engine: Engine | None
    log: ConversationLog | None
    model_path: Path | None
    server_tools: ServerTools | None  # loaded before start-up, so that a bad tool stops it at once


@asynccontextmanager
async def _database(settings: Settings) -> AsyncIterator[tuple[SqlEngine, sessionmaker[Session]]]:
    """The migrated database (or one still migrating in the background) and its sessions."""
    url = settings.resolved_database_url
    migrating = await _migrate(url)
    db = make_engine(
        url,
        sqlite_sync_every_commit=settings.storage.journal_fsync == "always",
        statement_timeout_s=settings.storage.statement_timeout_s,
    )
    try:
        yield db, make_session_factory(db)
    finally:
        if migrating is not None:
            migrating.cancel()
        db.dispose()


def _server_tools(settings: Settings) -> ServerTools | None:
    """The gateway's own tools (TANDEM_TOOLS)."""
    if not settings.server.tools:
        return None
    try:
        registry = registry_of(settings.server.tools)
    except (ToolError, SandboxUnavailable) as exc:
        raise StartupError(f"TANDEM_TOOLS: {exc}") from exc
    return ServerTools(registry, max_steps=settings.server.tool_max_steps)


async def _start_services(
    app: FastAPI,
    settings: Settings,
    stack: AsyncExitStack,
    db: SqlEngine,
    sessions: sessionmaker[Session],
    given: _Given,
    metrics: GatewayMetrics,
) -> Engine:
    """Open the log and the engine, build every service on ``app.state``; ``stack`` closes them."""
    log = given.log
    if log is None:
        storage = settings.storage
        log = ConversationLog(
            db,
            storage.journal_dir,
            fsync=storage.journal_fsync,
            fsync_interval_s=storage.journal_fsync_interval_s,
            flush_interval_s=storage.log_flush_interval_s,
            batch_size=storage.log_batch_size,
        )
        await log.start()
        stack.push_async_callback(log.close)
    serving = given.engine
    if serving is None:
        serving = await open_engine(settings, given.model_path)
        stack.push_async_callback(serving.close)
    tokenizer = await asyncio.to_thread(_load_tokenizer, settings, serving)
    weights = WeightService(serving, sessions, on_swap=metrics.observe_swap)
    adapters = AdapterDirectory(
        sessions,
        serving.model_info().served_model_name,
        lambda: serving.model_info().weight_version,
        enabled=settings.adapters.enabled,
        disabled_tenants=settings.adapters.disabled_tenants,
        refresh_s=settings.adapters.refresh_s,
        split_version=weights.split_version,
    )
    await adapters.start()
    stack.push_async_callback(adapters.close)
    canaries = CanaryJudge(
        sessions, adapters, weights, check_s=settings.adapters.canary_check_s, defaults=_canary_rules(settings)
    )
    await canaries.start()
    stack.push_async_callback(canaries.close)
    server_tools = given.server_tools
    chat = ChatService(
        serving, tokenizer, log, adapters, tool_parser=settings.engine.tool_parser, server_tools=server_tools
    )
    stack.push_async_callback(chat.close)
    state = app.state
    state.chat = chat
    state.server_tools = server_tools
    state.adapters = adapters
    state.canaries = canaries
    state.completions = CompletionService(log, sessions)
    state.weights = weights
    state.distributed = DistributedRollouts(state.weights, serving)
    stack.push_async_callback(state.distributed.close)
    state.engine = serving
    state.engine_admin = EngineAdmin(serving, metrics)  # admin's only way to change serving state
    state.sessions = sessions
    state.rollouts = RolloutService(serving, tokenizer, chat.renderer, settings.server.rollout_max_concurrency)
    windows = limiter_for(settings.learner.redis_url, settings.learner.redis_key_prefix)
    state.limits = RequestLimiter(windows, _default_tenant_limits(settings))
    state.auth = _authenticator(settings, sessions, windows)
    stack.callback(state.auth.close)
    return serving


def _canary_rules(settings: Settings) -> CanaryRules:
    adapters = settings.adapters
    return CanaryRules(
        min_ratings=adapters.canary_min_ratings,
        margin=adapters.canary_margin,
        confidence=adapters.canary_confidence,
        max_duration_s=adapters.canary_max_duration_s,
    )


def _authenticator(
    settings: Settings, sessions: sessionmaker[Session], windows: MovingWindowRateLimiter
) -> Authenticator:
    server = settings.server
    return Authenticator(
        sessions,
        admin_key=server.admin_key.get_secret_value() if server.admin_key else None,
        loopback=server.binds_loopback,
        internal_key=server.internal_admin_key.get_secret_value() if server.internal_admin_key else None,
        policy=AuthPolicy(
            key_ttl_s=server.auth_key_ttl_s,
            key_stale_s=server.auth_key_stale_s,
            lookup_timeout_s=server.auth_lookup_timeout_s,
            failures_per_minute=server.auth_failures_per_minute,
        ),
        failure_limiter=windows,
    )


def create_app(settings: Settings, *, engine: Engine | None = None, log: ConversationLog | None = None) -> FastAPI:
    """The FastAPI app; the engine and the conversation log are opened at startup unless given.

    Raises:
        ServingUnprotectedError: ``settings.server.host`` is not loopback and no API key exists.
    """
    refuse_unprotected(settings)
    model_path: Path | None = None
    if engine is None and settings.engine.kind == "local":
        try:
            model_path = resolve_model(settings.engine.model, settings.storage.model_cache_dir)
        except (ValueError, RuntimeError) as exc:
            raise StartupError(str(exc)) from exc
    server_tools = _server_tools(settings)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _database(settings) as (db, sessions), AsyncExitStack() as stack:
            given = _Given(engine, log, model_path, server_tools)
            serving = await _start_services(app, settings, stack, db, sessions, given, metrics)
            info = serving.model_info()
            logger.info(
                "serving",
                extra={
                    "model": info.served_model_name,
                    "weight_version": info.weight_version,
                    "replica": serving.replica,
                },
            )
            yield

    app = FastAPI(title="tandem", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app, authenticate_first)
    app.include_router(router)
    app.state.metrics = metrics
    app.add_middleware(JsonBodyMiddleware)  # curl -d's form label on a JSON body
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.server.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outside the body limit: its 413s count too
    app.add_middleware(RequestLogMiddleware)
    app.add_middleware(ReleaseAdmissions)
    return app
