"""Fixtures for the server tests (helpers live in server_fakes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_fakes import CHATML, FakeEngine, build_tokenizer, make_config

from servelm.server.app import build_app


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), CHATML)


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same tokenizer without a chat template."""
    return build_tokenizer(tmp_path_factory.mktemp("tok_plain"), None)


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture
def make_client() -> Callable[..., TestClient]:
    def make(engine: FakeEngine, **server: Any) -> TestClient:
        return TestClient(build_app(engine, make_config(**server)), raise_server_exceptions=False)
    return make


@pytest.fixture
def client(engine: FakeEngine, make_client: Callable[..., TestClient]) -> TestClient:
    return make_client(engine)
