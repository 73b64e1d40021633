"""The playground page: served from package files, public while the API stays behind the key, off
with --disable-playground."""

from __future__ import annotations

import re

from server_fakes import FakeEngine

from servelm.server.playground import ASSETS, STATIC_DIR


def test_page_and_assets_are_served(client) -> None:
    for path in ("/", "/playground"):
        response = client.get(path)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert "servelm playground" in response.text
    page = client.get("/").text
    # Every asset the page names is served, and nothing comes from another host.
    referenced = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sorted(r for r in referenced if r.startswith("playground/")) == \
        sorted(f"playground/{name}" for name in ASSETS)
    assert not [r for r in referenced if "//" in r]
    for name, media_type in ASSETS.items():
        response = client.get(f"/playground/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type)
        assert response.text == (STATIC_DIR / name).read_text()


def test_only_listed_assets_are_served(client) -> None:
    for path in ("/playground/playground.html", "/playground/../app.py", "/playground/nope.js",
                 "/playground/playground.js?name=../app.py"):
        response = client.get(path)
        assert response.status_code == 404 or response.text == (STATIC_DIR / "playground.js").read_text()


def test_page_is_public_but_the_api_needs_the_key(engine: FakeEngine, make_client) -> None:
    client = make_client(engine, api_key="sekret")
    assert client.get("/").status_code == 200
    assert client.get("/playground/playground.js").status_code == 200
    assert client.get("/get_server_info").status_code == 401
    assert client.post("/", json={}).status_code in (401, 405)
    denied = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    allowed = client.post("/v1/chat/completions", headers={"Authorization": "Bearer sekret"},
                          json={"messages": [{"role": "user", "content": "hi"}]})
    assert allowed.status_code == 200


def test_disable_playground(engine: FakeEngine, make_client) -> None:
    client = make_client(engine, disable_playground=True, api_key="k")
    assert client.get("/playground").status_code == 401  # no longer public
    client = make_client(engine, disable_playground=True)
    assert client.get("/").status_code == 404
    assert client.get("/playground/playground.js").status_code == 404
