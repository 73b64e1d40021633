"""--enable-expert-distribution-metrics: the engine's ``moe`` stats become gauges on /metrics."""

from __future__ import annotations

from servelm.config import EngineConfig, ObservabilityConfig
from servelm.server.observe import ServerMetrics


def test_moe_stats_become_gauges() -> None:
    config = EngineConfig(observability=ObservabilityConfig(enable_metrics=True,
                                                            enable_expert_distribution_metrics=True))
    metrics = ServerMetrics(config)
    metrics.set_engine_stats({"moe": {"layers": [0, 2], "expert_rows": [[5, 1], [0, 6]],
                                      "ep_rank_rows": [[5, 1], [3, 3]], "balancedness": 0.8,
                                      "eplb_rebalances": 3}})
    text = metrics.render()[0].decode()
    lines = {line.split("{")[0] + "{" + ",".join(sorted(line.split("{")[1].split("}")[0].split(","))) + "}":
             float(line.split()[-1]) for line in text.splitlines() if line.startswith("servelm:moe_") or
             line.startswith("servelm:eplb")}
    name = f'model_name="{config.model.name}"'
    assert lines[f'servelm:moe_expert_rows{{expert="1",layer="2",{name}}}'] == 6
    assert lines[f'servelm:moe_ep_rank_rows{{ep_rank="0",layer="0",{name}}}'] == 5
    assert lines[f"servelm:moe_ep_balancedness{{{name}}}"] == 0.8
    assert lines[f"servelm:eplb_rebalances{{{name}}}"] == 3
    assert "servelm:moe_" not in ServerMetrics(EngineConfig()).render()[0].decode()
