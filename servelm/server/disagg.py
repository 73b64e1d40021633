"""The front end's part in prefill/decode disaggregation: read a request's transfer fields (SGLang's
bootstrap_host/port/room, vLLM's kv_transfer_params) onto its engine submissions, return vLLM's
kv_transfer_params from a prefill server, and register with a LightLLM-style PD master
(`servelm router`) at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from servelm.config import EngineConfig
from servelm.disagg.spec import TransferRequestError, parse_transfers
from servelm.errors import InvalidRequestError
from servelm.server.streaming import Submission

logger = logging.getLogger(__name__)

REGISTER_RETRY_S = 10.0
"""How long a prefill or decode server keeps trying to reach its PD master at start-up."""


def attach_transfers(config: EngineConfig, body: BaseModel, submissions: list[Submission]) -> None:
    """Give each submission its part in the request's transfer (a 400 for bad fields)."""
    extra = body.model_extra or {}
    try:
        transfers = parse_transfers(extra, config.disaggregation.mode, len(submissions))
    except TransferRequestError as error:
        raise InvalidRequestError(str(error), error.param) from None
    for submission, transfer in zip(submissions, transfers):
        submission.kv_transfer = transfer


def transfer_params(config: EngineConfig, raw: Request,
                    submissions: list[Submission]) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_params`` for a prefill response: the engine's part plus where the
    decode server finds this server's bootstrap endpoint (the host the client reached us by,
    unless --host names one)."""
    params = next((s.kv_transfer_params for s in submissions if s.kv_transfer_params), None)
    if params is None:
        return None
    host = config.server.host
    if host in ("0.0.0.0", "::", "", None):
        host = raw.url.hostname or "127.0.0.1"
    return {**params, "remote_host": host,
            "remote_port": config.disaggregation.disaggregation_bootstrap_port}


def _post_register(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()


async def register_with_master(config: EngineConfig) -> None:
    """LightLLM's --pd_master_ip/--pd_master_port: tell the PD master this server's URL, role
    and bootstrap port (``POST /register``). Retries for REGISTER_RETRY_S, then fails start-up."""
    disaggregation = config.disaggregation
    if disaggregation.pd_master_ip is None or not disaggregation.is_enabled:
        return
    server = config.server
    host = server.host if server.host not in ("0.0.0.0", "::") else "127.0.0.1"
    body = {"url": f"http://{host}:{server.port}", "mode": disaggregation.mode,
            "bootstrap_port": disaggregation.disaggregation_bootstrap_port}
    url = f"http://{disaggregation.pd_master_ip}:{disaggregation.pd_master_port}/register"
    deadline = asyncio.get_running_loop().time() + REGISTER_RETRY_S
    while True:
        try:
            await asyncio.to_thread(_post_register, url, body)
            logger.info("registered with the PD master at %s as %s", url, disaggregation.mode)
            return
        except (urllib.error.URLError, OSError) as error:
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"cannot register with the PD master at {url} "
                                   f"(--pd_master_ip/--pd_master_port): {error}") from None
            await asyncio.sleep(0.5)


async def register_when_serving(config: EngineConfig, server: Any, failures: list[str]) -> None:
    """Register once uvicorn accepts connections (the master may probe us at once); a failure
    is recorded in ``failures`` and stops the server (start-up error)."""
    while not getattr(server, "started", False):
        await asyncio.sleep(0.05)
    try:
        await register_with_master(config)
    except RuntimeError as error:
        logger.critical("%s", error)
        failures.append(str(error))
        server.should_exit = True
