"""Multi-node tensor parallelism (SGLang's form) with two "nodes" on loopback.

Each node is a real `servelm serve ... --nnodes 2 --node-rank R --dist-init-addr 127.0.0.1:PORT`
launcher process with one rank and one thread: node 0 serves HTTP and holds rank 0, node 1 runs
rank 1 only. The ranks meet in real gloo collectives over TCP and node 1 receives its steps over
ZMQ TCP, exactly as on two machines; only the address is loopback. The node-0-kill test (a fault
already covered from the other side) is marked slow, as is the test that puts node 1 in a network
namespace of its own, joined by a veth pair (a real second address; needs root, skipped otherwise).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.engine_drive import PARITY_PROMPTS, reference_greedy
from tests.tiny_models import make_tiny_model_dir

from .server_process import REPO, ServerProcess, free_port, stream_and_kill, wait_until_gone


class NodeProcess:
    """`servelm serve` with --node-rank > 0: no HTTP, only its ranks; use as a context manager."""

    def __init__(self, args: list[str], log_path: Path, prefix: tuple[str, ...] = ()) -> None:
        self.args = args
        self.log_path = log_path
        self.prefix = prefix
        """Runs the command through this (``ip netns exec NAME``, which execs: same pid)."""
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> NodeProcess:
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen([*self.prefix, sys.executable, "-m", "servelm", "serve", *self.args],
                                        cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank_pids(self) -> list[int]:
        assert self.process is not None
        return [child.pid for child in psutil.Process(self.process.pid).children()
                if "servelm.workers.worker" in " ".join(child.cmdline())]

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


def node_args(model: str, node_rank: int, init_port: int, *extra: str) -> list[str]:
    return [model, "--tp", "2", "--nnodes", "2", "--node-rank", str(node_rank), "--dist-init-addr",
            f"127.0.0.1:{init_port}", "--num-threads", "1", "--dtype", "float32", *extra]


def generate_tokens(server: ServerProcess, prompt: list[int], max_tokens: int) -> list[int]:
    response = httpx.post(f"{server.base_url}/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                 "ignore_eos": True}}, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["output_ids"])


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2-135m", marks=pytest.mark.slow)])
def test_two_nodes_match_tp1(tmp_path: Path, model: str) -> None:
    """TP=2 across two loopback nodes (a tiny random Llama; SmolLM2-135M with -m slow): greedy
    tokens equal the TP=1 engine's; the layout shows both nodes; node 1 exits cleanly (0, no rank
    left) when node 0 stops."""
    num_new_tokens = 16
    extra: tuple[str, ...] = ("--max-total-tokens", "1024", "--enable-metrics", "--served-model-name", "parity")
    if model == "tiny":
        model = str(make_tiny_model_dir(tmp_path, "llama"))
        extra = (*extra, "--skip-tokenizer-init")
    init_port = free_port()
    # node 1 starts (and its rank imports, waiting for node 0) while the reference runs
    with NodeProcess(node_args(model, 1, init_port, *extra), tmp_path / "node1.log") as node1:
        if "--skip-tokenizer-init" in extra:
            prompts, expected = reference_greedy([[1, 2, 3, 4, 5], list(range(7, 40))], num_new_tokens,
                                                 model=model, dtype="float32", num_threads=1,
                                                 skip_tokenizer_init=True, max_total_tokens=1024)
        else:   # the reference of the tensor- and pipeline-parallel parity tests: loaded once per run
            prompts, expected = reference_greedy(PARITY_PROMPTS, num_new_tokens, model=model, dtype="float32",
                                                 num_threads=1, max_total_tokens=2048)
        with ServerProcess(node_args(model, 0, init_port, *extra)) as server:
            got = [generate_tokens(server, prompt, num_new_tokens) for prompt in prompts]
            layout = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["parallel"]
            metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
            rank_pids = node1.rank_pids()
        assert got == expected
        assert (layout["tp_size"], layout["nnodes"], layout["ranks_per_node"]) == (2, 2, 1)
        assert layout["all_reduce"] == "gloo"  # shared memory stops at the node's edge
        assert [(rank["rank"], rank["node"]) for rank in layout["ranks"]] == [(0, 0), (1, 1)]
        assert [layout["ranks"][1]["pid"]] == rank_pids
        assert ('servelm:parallel_layout{executor="mp",model_name="parity",nnodes="2",'
                'ranks_per_node="1",tp_size="2"} 1.0') in metrics
        assert node1.wait(30) == 0, node1.log()
        assert wait_until_gone(rank_pids)


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    return str(make_tiny_model_dir(tmp_path, "llama"))


TINY_FLAGS = ("--skip-tokenizer-init", "--max-total-tokens", "4096")
LONG_STREAM: dict[str, Any] = {"input_ids": [1, 2, 3], "sampling_params": {
    "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}


def test_killing_node_1_fails_the_request_and_ends_node_0(tmp_path: Path, tiny_model: str) -> None:
    init_port = free_port()
    with NodeProcess(node_args(tiny_model, 1, init_port, *TINY_FLAGS), tmp_path / "node1.log") as node1:
        server = ServerProcess(node_args(tiny_model, 0, init_port, *TINY_FLAGS))
        with server:
            ranks = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["parallel"]["ranks"]
            engine_pid, remote_rank_pid = ranks[0]["pid"], ranks[1]["pid"]
            assert node1.process is not None
            events = stream_and_kill(server.base_url, LONG_STREAM, node1.process.pid)
            assert 3 < len(events) < 400
            assert events[-1]["error"]["message"] == (
                f"node 1 (tensor-parallel rank 1, pid {remote_rank_pid} on {os.uname().nodename}) "
                "disconnected")
            assert server.process is not None
            assert server.process.wait(timeout=30) != 0
            assert "node 1 (tensor-parallel rank 1" in server.log()
        assert wait_until_gone([engine_pid, remote_rank_pid])


@pytest.mark.slow
def test_killing_node_0_ends_node_1(tmp_path: Path, tiny_model: str) -> None:
    init_port = free_port()
    with NodeProcess(node_args(tiny_model, 1, init_port, *TINY_FLAGS), tmp_path / "node1.log") as node1:
        with ServerProcess(node_args(tiny_model, 0, init_port, *TINY_FLAGS)) as server:
            assert generate_tokens(server, [1, 2, 3], 4)
            rank_pids = node1.rank_pids()
            assert server.process is not None
            server.process.send_signal(signal.SIGKILL)  # no clean-up, no Shutdown to the ranks
            server.process.wait()
        start_s = time.monotonic()
        assert node1.wait(30) == 1
        assert time.monotonic() - start_s < 15
        assert "node 1: node 0 (127.0.0.1:" in node1.log() and "is gone" in node1.log()
        assert wait_until_gone(rank_pids)


def test_a_node_that_never_joins_is_a_clear_error(tmp_path: Path, tiny_model: str) -> None:
    """Node 1 is started with another --tp-size: it refuses node 0's layout and exits; node 0,
    missing its rank, fails after --dist-timeout naming the node, and exits."""
    init_port = free_port()
    node1_args = node_args(tiny_model, 1, init_port, *TINY_FLAGS)
    node1_args[node1_args.index("--tp") + 1] = "4"
    with NodeProcess(node1_args, tmp_path / "node1.log") as node1:
        with pytest.raises(RuntimeError) as failure:
            with ServerProcess(node_args(tiny_model, 0, init_port, *TINY_FLAGS, "--dist-timeout", "5")):
                pass
        assert node1.wait(30) == 1
    assert ("node(s) [1] (tensor-parallel ranks [1]) did not start within --dist-timeout 5 s"
            in str(failure.value))
    assert "node 0 serves (model, --tp-size, --nnodes) = " in node1.log()
    assert "run the same command on every node" in node1.log()


def test_node_1_without_node_0_gives_up_after_the_timeout(tmp_path: Path, tiny_model: str) -> None:
    init_port = free_port()
    with NodeProcess(node_args(tiny_model, 1, init_port, *TINY_FLAGS, "--dist-timeout", "2"),
                     tmp_path / "node1.log") as node1:
        assert node1.wait(60) == 1
    assert (f"node 1: node 0's rendezvous at 127.0.0.1:{init_port} did not answer within "
            "--dist-timeout 2 s") in node1.log()


@pytest.fixture
def second_address() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, node 0's address here,
    node 1's address there). Skips where network namespaces cannot be made (not root)."""
    suffix = str(os.getpid() % 100_000)
    namespace, here, there = f"servelm-n1-{suffix}", f"svl0-{suffix}", f"svl1-{suffix}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    setup = [["ip", "netns", "add", namespace],
             ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
             ["ip", "link", "set", there, "netns", namespace],
             ["ip", "addr", "add", f"{subnet}.1/24", "dev", here], ["ip", "link", "set", here, "up"],
             ["ip", "netns", "exec", namespace, "ip", "addr", "add", f"{subnet}.2/24", "dev", there],
             ["ip", "netns", "exec", namespace, "ip", "link", "set", there, "up"],
             ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"]]
    try:
        for command in setup:
            done = subprocess.run(command, capture_output=True)
            if done.returncode != 0:
                pytest.skip(f"no network namespace here: {' '.join(command)}: {done.stderr.decode().strip()}")
        yield namespace, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


@pytest.mark.slow
def test_two_nodes_on_a_veth_pair_match_tp1(tmp_path: Path, tiny_model: str,
                                           second_address: tuple[str, str, str]) -> None:
    """Node 1 in its own network namespace reaches node 0 only through 10.x.y.1: the rendezvous,
    the step sockets and gloo all use that address (gloo's default would be the host name's,
    127.0.0.1 here, which node 1 cannot reach)."""
    namespace, node0_address, _ = second_address
    prompts, expected = reference_greedy([[1, 2, 3, 4, 5], list(range(7, 40))], 12, model=tiny_model,
                                         dtype="float32", num_threads=1, skip_tokenizer_init=True,
                                         max_total_tokens=1024)
    init_port = free_port()
    args = [tiny_model, "--tp", "2", "--nnodes", "2", "--dist-init-addr", f"{node0_address}:{init_port}",
            "--num-threads", "1", "--dtype", "float32", *TINY_FLAGS, "--dist-timeout", "60"]
    with NodeProcess([*args, "--node-rank", "1"], tmp_path / "node1.log",
                     prefix=("ip", "netns", "exec", namespace)) as node1:
        with ServerProcess([*args, "--node-rank", "0"]) as server:
            got = [generate_tokens(server, prompt, 12) for prompt in prompts]
            layout = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["parallel"]
        assert got == expected
        assert [rank["node"] for rank in layout["ranks"]] == [0, 1]
        assert node1.wait(30) == 0, node1.log()


@pytest.mark.slow
def test_tp4_over_two_nodes_of_two_ranks_matches_tp1(tmp_path: Path, tiny_model: str) -> None:
    """Two ranks per node (node 0: the engine's rank 0 plus a local rank process; node 1: two rank
    processes, LightLLM's --node_rank spelling): each node cuts its CPUs between its own ranks."""
    prompts, expected = reference_greedy([[1, 2, 3, 4, 5], list(range(7, 40))], 12, model=tiny_model,
                                         dtype="float32", num_threads=1, skip_tokenizer_init=True,
                                         max_total_tokens=1024)
    init_port = free_port()
    args = [tiny_model, "--tp", "4", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{init_port}",
            "--num-threads", "1", "--dtype", "float32", *TINY_FLAGS]
    with NodeProcess([*args, "--node_rank", "1"], tmp_path / "node1.log") as node1:
        with ServerProcess([*args, "--node-rank", "0"]) as server:
            got = [generate_tokens(server, prompt, 12) for prompt in prompts]
            layout = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["parallel"]
            assert len(node1.rank_pids()) == 2
        assert got == expected
        assert [(rank["rank"], rank["node"]) for rank in layout["ranks"]] == [(0, 0), (1, 0), (2, 1), (3, 1)]
        assert layout["ranks_per_node"] == 2
        assert node1.wait(30) == 0, node1.log()
