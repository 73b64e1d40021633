"""--served-model-name a b (vLLM's list): responses carry a, requests may say a or b, /v1/models
lists both (issue 11)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from server_fakes import FakeEngine

from servelm.config import EngineConfig, ModelConfig
from servelm.server.app import build_app


def test_every_served_name_is_accepted_and_listed(engine: FakeEngine) -> None:
    config = EngineConfig(model=ModelConfig(model="/models/tiny", served_model_name=["first", "second"]))
    client = TestClient(build_app(engine, config), raise_server_exceptions=False)
    listed = [model["id"] for model in client.get("/v1/models").json()["data"]]
    assert listed == ["first", "second"]
    for name in ("first", "second"):
        response = client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "first"
    response = client.post("/v1/completions", json={"model": "third", "prompt": "x", "max_tokens": 2})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
