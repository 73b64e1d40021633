"""Expert parallelism through the server (slow: servers with a rank process each): SGLang's
recorder endpoints and the routing metrics on --tp 2 --ep 2 with EPLB, a rank killed
mid-generation under EP ends the server with the tensor-parallel path's clear error, and EP across
two nodes (loopback, and a network namespace joined by a veth pair) equals one process."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.tiny_models import make_tiny_model_dir

from .server_process import ServerProcess, check_killed_rank_ends_the_server
from .test_multi_node import second_address  # noqa: F401 (a fixture)

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


@pytest.mark.parametrize("network", ["loopback", "netns"])
def test_ep2_over_two_nodes_matches_one_process(tmp_path: Path, network: str, request: pytest.FixtureRequest) -> None:
    """--tp 2 --ep 2 with one rank per node: the all-to-all crosses the nodes (on loopback, and from
    a network namespace of its own joined by a veth pair: skipped where namespaces cannot be made);
    greedy tokens equal one process's."""
    from tests.e2e.test_multi_node import NodeProcess, generate_tokens
    from tests.engine_drive import reference_greedy

    from .server_process import free_port

    model = str(make_tiny_model_dir(tmp_path, "mixtral"))
    prompts, expected = reference_greedy([[1, 2, 3, 4, 5], list(range(7, 40))], 12, model=model,
                                         dtype="float32", num_threads=1, skip_tokenizer_init=True,
                                         max_total_tokens=1024)
    address, prefix = "127.0.0.1", ()
    if network == "netns":
        namespace, address, _ = request.getfixturevalue("second_address")
        prefix = ("ip", "netns", "exec", namespace)
    args = [model, "--tp", "2", "--ep", "2", "--nnodes", "2", "--dist-init-addr", f"{address}:{free_port()}",
            "--num-threads", "1", "--dtype", "float32", "--skip-tokenizer-init", "--max-total-tokens", "1024",
            "--dist-timeout", "60"]
    with NodeProcess([*args, "--node-rank", "1"], tmp_path / "node1.log", prefix=prefix) as node1:
        with ServerProcess([*args, "--node-rank", "0"]) as server:
            got = [generate_tokens(server, prompt, 12) for prompt in prompts]
            layout = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["parallel"]
        assert got == expected
        assert layout["ep_size"] == 2 and [rank["node"] for rank in layout["ranks"]] == [0, 1]
        assert node1.wait(30) == 0, node1.log()
