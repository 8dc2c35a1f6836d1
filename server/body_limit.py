"""Reject request bodies over a size limit with 413, by Content-Length and by the bytes streamed in."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server's limit of {limit} bytes."


class BodyLimitMiddleware:
    """Pure ASGI, so the streaming check costs one addition per body chunk."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    await error_response(400, "The Content-Length header is not a number.")(scope, receive, send)
                    return
                if int(value) > self.limit:
                    response = error_response(413, _too_large(self.limit), headers={"Connection": "close"})
                    await response(scope, receive, send)
                    return
                break
        limit = self.limit
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # FastAPI re-raises HTTPException from body reading; the error handlers shape it.
                    raise HTTPException(413, _too_large(limit))
            return message

        await self.app(scope, limited_receive, send)
