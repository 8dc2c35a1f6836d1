"""Every body this API takes is JSON: read it as JSON whatever Content-Type says.

`curl -d '{...}'` sends `application/x-www-form-urlencoded` unless told otherwise, and some clients
send no Content-Type at all; FastAPI would then not parse the body and answer a 400 about a missing
field, which reads as if the field were wrong. No route takes a form, so those bodies are labelled
JSON before routing (a body that is not JSON gets the usual "not valid JSON" 400). Other declared
types (text/plain, say) are left alone and refused as before.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

_RELABELLED = (b"", b"application/x-www-form-urlencoded")


class JsonBodyMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            declared = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
            if declared.split(b";")[0].strip().lower() in _RELABELLED:
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
