"""EAGLE trees (--speculative-eagle-topk 3) on a live SmolLM2-135M server with a random-weight
EAGLE-3 head in the published format (no trained head exists offline, so the trees are almost
never accepted past the root; mechanics only): the same greedy text and tokens as a plain server,
streamed or not, with a stop string, max_tokens and a JSON schema (grammar masks per root path).
One server at a time."""

from __future__ import annotations

import httpx
import pytest

from servelm.model.eagle_checkpoint import main as write_head

from .server_process import ServerProcess
from .test_speculative_eagle_live import ARGS, OPS_MODEL, answers


@pytest.mark.slow
def test_eagle3_tree_server_equals_the_plain_server(tmp_path):
    head = tmp_path / "eagle3-head"
    write_head(["--model", OPS_MODEL, "--algorithm", "EAGLE3", "--out", str(head)])
    with ServerProcess(ARGS) as plain_server:
        plain = answers(plain_server)
    args = [*ARGS, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
            "--speculative-eagle-topk", "3", "--speculative-num-steps", "3",
            "--speculative-num-draft-tokens", "8"]
    with ServerProcess(args) as tree_server:
        speculative = answers(tree_server)
        info = httpx.get(f"{tree_server.base_url}/get_server_info", timeout=30).json()
    assert len(plain["text"]) > 20 and plain["json"].startswith("{")
    assert speculative == plain
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["spec_num_draft_tokens"] > 0 and info["spec_draft_used_blocks"] == 0, info
