"""/admin/ui: the operator dashboard, a static page that calls the admin API with the key it asks for.

The page holds no data, so serving it needs no key: its login form takes the admin key, keeps it in
the tab's sessionStorage and sends it to the admin API as a bearer token. Everything comes from this
server (no build step, no CDN); the Content-Security-Policy says so, which also keeps injected
markup from running scripts or sending the key elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from server.errors import ApiError

router = APIRouter()

UI_DIR = Path(__file__).resolve().parents[1] / "ui"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new release's page must not run an old script
}


@router.get("/admin/ui", include_in_schema=False, response_class=FileResponse)
async def page() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/admin/ui/{name}", include_in_schema=False, response_class=FileResponse)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise ApiError(404, f"No dashboard file '{name}'.", code="not_found")
    return FileResponse(UI_DIR / name, media_type=ASSETS[name], headers=HEADERS)
