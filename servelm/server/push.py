"""LightLLM's push of the server's metrics to a Prometheus Pushgateway (--metric_gateway).

Every --push-interval seconds the server refreshes its engine gauges and PUTs its whole registry
(the metrics /metrics serves) to ``<gateway>/metrics/job/<--job-name>[/<key>/<value>...]``, so a
Pushgateway keeps the latest values for Prometheus to scrape. A failed push is logged (once per
run of failures) and retried at the next interval; it never affects requests. The last push
happens at shutdown, so the final counts reach the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from servelm.config import EngineConfig
from servelm.engine.frontdoor import EngineClient
from servelm.server.observe import ServerMetrics

logger = logging.getLogger(__name__)

USER_ENV, PASSWORD_ENV = "SERVELM_PUSHGATEWAY_USER", "SERVELM_PUSHGATEWAY_PASSWORD"


class MetricsPusher:
    """Pushes ``metrics`` to the configured Pushgateway."""

    def __init__(self, config: EngineConfig, metrics: ServerMetrics) -> None:
        observability = config.observability
        assert observability.metric_gateway is not None
        self.gateway = observability.metric_gateway
        self.job = observability.job_name
        self.grouping_key = observability.grouping_key_dict
        self.interval_s = observability.push_interval
        self.metrics = metrics
        self.num_pushes = 0
        self._handler: Any = None
        if observability.enable_monitor_auth:
            user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
            if not user or password is None:
                raise ValueError(f"--enable_monitor_auth needs {USER_ENV} and {PASSWORD_ENV} in "
                                 "the environment")
            self._handler = _basic_auth(user, password)
        self._failing = False

    async def push_once(self, engine: EngineClient | None) -> None:
        """Refresh the engine gauges from ``engine`` (when given and alive), then push."""
        from prometheus_client import push_to_gateway

        if engine is not None and engine.is_alive:
            try:
                self.metrics.set_engine_stats(await asyncio.wait_for(engine.get_server_info(), 10))
            except Exception:  # push the request metrics even when the engine is busy or gone
                logger.debug("metrics push: engine stats unavailable", exc_info=True)
        kwargs: dict[str, Any] = {"grouping_key": self.grouping_key}
        if self._handler is not None:
            kwargs["handler"] = self._handler
        await asyncio.to_thread(push_to_gateway, self.gateway, job=self.job,
                                registry=self.metrics.registry, **kwargs)
        self.num_pushes += 1

    async def run(self, get_engine: Callable[[], EngineClient | None]) -> None:
        """Push every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.try_push(get_engine())

    async def try_push(self, engine: EngineClient | None) -> bool:
        try:
            await self.push_once(engine)
        except Exception as error:
            if not self._failing:
                logger.warning("metrics push to %s failed (retrying every %.0f s): %s",
                               self.gateway, self.interval_s, error)
            self._failing = True
            return False
        if self._failing:
            logger.info("metrics push to %s works again", self.gateway)
        self._failing = False
        return True


def _basic_auth(user: str, password: str) -> Callable[..., Any]:
    from prometheus_client.exposition import basic_auth_handler

    def handler(url: str, method: str, timeout: float | None, headers: list[tuple[str, str]],
                data: bytes) -> Callable[[], None]:
        return basic_auth_handler(url, method, timeout, headers, data, user, password)

    return handler
