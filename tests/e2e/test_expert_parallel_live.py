"""Expert parallelism through the server (slow: two servers with a rank process each): SGLang's
recorder endpoints and the routing metrics on --tp 2 --ep 2 with EPLB, and a rank killed
mid-generation under EP ends the server with the tensor-parallel path's clear error."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.tiny_models import make_tiny_model_dir

from .server_process import ServerProcess, check_killed_rank_ends_the_server

pytestmark = pytest.mark.slow


def test_recorder_endpoints_and_metrics_under_ep2_with_eplb(tmp_path: Path) -> None:
    model = str(make_tiny_model_dir(tmp_path, "mixtral"))
    server = ServerProcess([model, "--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2", "--enable-eplb",
                            "--eplb-rebalance-num-iterations", "4", "--expert-distribution-recorder-mode", "stat",
                            "--enable-metrics", "--enable-expert-distribution-metrics", "--num-threads", "1",
                            "--skip-tokenizer-init", "--max-total-tokens", "1024", "--dtype", "float32"])
    with server:
        url = server.base_url
        assert httpx.post(f"{url}/start_expert_distribution_record", timeout=30).json()["success"]
        response = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3, 4], "sampling_params": {
            "max_new_tokens": 9, "temperature": 0, "ignore_eos": True}}, timeout=120)
        assert response.status_code == 200, response.text
        httpx.post(f"{url}/stop_expert_distribution_record", timeout=30)
        dump = httpx.get(f"{url}/dump_expert_distribution_record", timeout=30).json()
        assert dump["mode"] == "stat" and dump["layers"] == [0, 1]
        assert [sum(layer) for layer in dump["rows"]] == [(4 + 8) * 2] * 2   # prompt + 8 decodes, top-2
        assert len(dump["placements"]) == 2 and len(dump["placements"][0]) == 10
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        layer0 = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("servelm:moe_expert_rows{") and 'layer="0"' in line]
        assert len(layer0) == 8 and sum(layer0) >= (4 + 8) * 2   # the rows since start (the warm-up's too)
        assert "servelm:eplb_rebalances{" in metrics and "servelm:moe_ep_rank_rows{" in metrics
        rebalances = next(line for line in metrics.splitlines() if line.startswith("servelm:eplb_rebalances{"))
        assert float(rebalances.split()[-1]) >= 1


def test_killing_a_rank_under_expert_parallelism_ends_the_server(tmp_path: Path) -> None:
    check_killed_rank_ends_the_server(str(make_tiny_model_dir(tmp_path, "mixtral")), ["--tp", "2", "--ep", "2"],
                                      "tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL",
                                      "tensor-parallel rank 1")
