"""The playground: a chat and completion page served from files inside the package.

Invariants:
- The page and its assets are package data (``server/static/``, listed in pyproject.toml), so a
  wheel install serves them; nothing is fetched from a CDN.
- The page itself needs no API key (it holds no data); every API call it makes carries the key
  the user typed, exactly as any other client's would.
- ``--disable-playground`` (llama.cpp: ``--no-webui``) leaves ``/`` and ``/playground`` to 404.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATHS = ("/", "/playground")
ASSETS = {"playground.js": "text/javascript", "markdown.js": "text/javascript",
          "playground.css": "text/css"}
PUBLIC_PATHS = frozenset((*PAGE_PATHS, *(f"/playground/{name}" for name in ASSETS)))
"""Paths served without the API key."""

_NO_CACHE = {"Cache-Control": "no-cache"}
"""Revalidate each load, so a page from an older server version is never mixed with new assets."""


def install_playground(app: FastAPI) -> None:
    page = STATIC_DIR / "playground.html"

    async def playground_page() -> FileResponse:
        return FileResponse(page, media_type="text/html", headers=_NO_CACHE)

    for path in PAGE_PATHS:
        app.add_api_route(path, playground_page, methods=["GET"], include_in_schema=False)

    for name, media_type in ASSETS.items():
        app.add_api_route(f"/playground/{name}", _asset_route(STATIC_DIR / name, media_type),
                          methods=["GET"], include_in_schema=False)


def _asset_route(path: Path, media_type: str):  # type: ignore[no-untyped-def]
    """A handler without parameters (FastAPI would read any parameter from the query string)."""
    async def asset() -> FileResponse:
        return FileResponse(path, media_type=media_type, headers=_NO_CACHE)
    return asset
