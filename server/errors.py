"""OpenAI's error shape on every /v1 answer, and the handlers that map exceptions to it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from server.conversation_log import JournalWriteError
from server.engines.base import EngineError

logger = logging.getLogger(__name__)

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """An error a client can act on; raised by services, turned into OpenAI's shape by the handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,  # e.g. Retry-After on a 429 or 503
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_payload(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, Any]]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = orjson.dumps(error_payload(status, message, param=param, code=code))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _location(loc: tuple[int | str, ...]) -> str | None:
    # Drop the "body" prefix and pydantic's union tags so the param reads like the request field.
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    parts = [p for p in parts if not p.startswith(("function-", "tagged-union["))]
    return ".".join(parts) or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ())[-1]
        reason = (first.get("ctx") or {}).get("error")
        detail = f" ({reason} at character {where})" if reason and isinstance(where, int) else ""
        return f"We could not parse the JSON body of your request: it is not valid JSON{detail}.", None
    param = _location(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"Invalid value for '{param}': {message}{more}" if param else f"{message}{more}"), param


async def _api_error(_: Request, exc: ApiError) -> Response:
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)


Authenticate = Callable[[Request], Awaitable[None]]
"""Raises the ApiError (401/403) a request's route would answer before looking at its input."""


def _validation_error(
    authenticate: Authenticate | None,
) -> Callable[[Request, RequestValidationError], Awaitable[Response]]:
    async def handle(request: Request, exc: RequestValidationError) -> Response:
        if authenticate is not None:
            try:
                await authenticate(request)
            except ApiError as error:
                return await _api_error(request, error)
        message, param = validation_message(exc)
        return error_response(400, message, param=param, code="invalid_request")

    return handle


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path (Starlette names only the first route's),
    found by asking the app's routes whether they would take the request with each method."""
    routes = request.app.router.routes
    return ", ".join(
        method
        for method in HTTP_METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    )


def unparsable_body(cause: BaseException) -> str:
    """What was wrong with a body the JSON parser gave up on for a reason other than syntax."""
    if isinstance(cause, UnicodeDecodeError):
        return f"The request body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} at position {cause.start}."
    if isinstance(cause, RecursionError):
        return "The JSON body of your request nests arrays or objects too deeply."
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "A number in the JSON body of your request has too many digits."
    return f"We could not parse the JSON body of your request: {type(cause).__name__}."


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request)
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "error parsing the body"
        return error_response(400, unparsable_body(exc.__cause__), code="invalid_request")
    return error_response(exc.status_code, str(exc.detail), headers=headers)


async def _engine_error(_: Request, exc: EngineError) -> Response:
    headers = {"Retry-After": "1"} if exc.retryable else None
    return error_response(exc.status, str(exc), code="engine_error", headers=headers)


def journal_message(exc: JournalWriteError) -> str:
    return (
        f"The conversation log could not be written ({exc}), so nothing of this request was kept; "
        "retry later. The operator must free space on the journal's disk."
    )


async def _journal_error(_: Request, exc: JournalWriteError) -> Response:
    # 503 and not 507: clients and proxies retry a 503 with Retry-After; the cause is the server's.
    return error_response(503, journal_message(exc), code="log_unavailable", headers={"Retry-After": "5"})


async def _unexpected(_: Request, exc: Exception) -> Response:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(500, "The server had an internal error; it has been logged.")


def install_error_handlers(app: FastAPI, authenticate: Authenticate | None = None) -> None:
    """OpenAI-shaped answers for every error; with ``authenticate``, a request that fails validation is
    authenticated first, so a caller without a valid key learns nothing about the input (401, not 400)."""
    # Starlette types every handler as taking Exception; each is registered for its own exception type.
    handlers: list[tuple[type[Exception], Any]] = [
        (ApiError, _api_error),
        (RequestValidationError, _validation_error(authenticate)),
        (StarletteHTTPException, _http_error),
        (EngineError, _engine_error),
        (JournalWriteError, _journal_error),
        (Exception, _unexpected),
    ]
    for kind, handler in handlers:
        app.add_exception_handler(kind, handler)
