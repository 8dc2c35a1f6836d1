"""Structured logs: JSON lines (default) or a console format, and one line per HTTP request."""

from __future__ import annotations

import logging
import sys
import time
import uuid
from typing import Any, Literal, TextIO

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_LOGGER = "tandem.request"
# Attributes every LogRecord has; anything else was passed through ``extra=`` and is logged as a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_extra(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class ConsoleFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in _extra(record).items())
        text = super().format(record)
        return f"{text} {fields}" if fields else text


LogFormat = Literal["auto", "json", "console"]


def formatter_for(fmt: LogFormat, stream: TextIO) -> logging.Formatter:
    """``auto``: readable lines when ``stream`` is a terminal, JSON when it is a file or a pipe."""
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    return JsonFormatter() if fmt == "json" else ConsoleFormatter()


def configure_logging(level: str = "INFO", fmt: LogFormat = "auto") -> None:
    """Route tandem's and uvicorn's loggers through one stderr handler in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter_for(fmt, sys.stderr))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # Our request line replaces uvicorn's access log.
    logging.getLogger("uvicorn.access").disabled = True


POLLED_PATHS = frozenset({"/health", "/admin/weights", "/metrics"})


class RequestLogMiddleware:
    """One log line per request: id, method, path, status, latency and, when a handler put them in
    ``request.state.log_fields``, token counts and the completion id. Pure ASGI to stay cheap."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.logger = logging.getLogger(REQUEST_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 0
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            fields = {
                "request_id": request_id,
                "method": scope["method"],
                "path": scope["path"],
                "status": status or 500,
                "latency_ms": round((time.perf_counter() - start) * 1000, 3),
                **state.get("log_fields", {}),
            }
            # Pollers (the learner asks what serves every few seconds, probes ask for health) would
            # fill the log: their successful reads are debug lines.
            quiet = scope["method"] == "GET" and scope["path"] in POLLED_PATHS and 0 < status < 400
            self.logger.log(logging.DEBUG if quiet else logging.INFO, "request", extra=fields)
