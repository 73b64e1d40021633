"""benchmarks/compare_peers.py's rounds: every server measured once a round in a rotated order, on
prompts of its own per round, medians and ranges per column, a server that does not start left out.

The servers are real processes on loopback: a small streaming OpenAI-style completions server (the
standard library's HTTP server) that logs each request's prompt (a hash) and its own name."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from benchmarks import compare_peers as cp

SERVER = r'''
import hashlib, json, sys, time, http.server
name, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def do_GET(self):
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(json.dumps([name, hashlib.sha1(repr(request["prompt"]).encode()).hexdigest(),
                                len(request["prompt"])]) + "\n")
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close"); self.end_headers()
        long = len(request["prompt"]) > 1500   # a long prompt: a slow first token, then 1 ms a token
        time.sleep(1.0 if long else 0.0)
        for _ in range(request["max_tokens"]):
            time.sleep(0.001 if long else 0.0)
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": request["max_tokens"]}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        self.close_connection = True
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128   # 32 concurrent streams connect at once
Server(("127.0.0.1", port), Handler).serve_forever()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_round_order_rotates():
    names = ["a", "b", "c"]
    assert [cp.round_order(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_summarize_medians_and_ranges():
    rounds = [dict(zip(cp.COLUMNS, values)) for values in ((10, 100, 50, 80), (30, 300, 40, 60), (20, 200, 45, 70))]
    medians, ranges = cp.summarize({"s": rounds, "absent": []})
    assert medians == [["s", "20.0", "200.0", "45.0", "70.0"]]
    assert ranges == [["s", "10.0-30.0", "100.0-300.0", "40.0-50.0", "60.0-80.0"]]


def test_rounds_interleave_servers_on_fresh_prompts(tmp_path: Path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    log = tmp_path / "requests.jsonl"
    peers = [cp.Peer(name, [sys.executable, str(script), name, str(port), str(log)], {}, 30, port)
             for name, port in (("one", free_port()), ("two", free_port()))]
    peers.append(cp.Peer("broken", [sys.executable, "-c", "raise SystemExit(3)"], {}, 30, free_port()))
    args = argparse.Namespace(model="m", output_len=4, rounds=2, sequential=False, port=0)
    results = cp.measure_peers(peers, args, tmp_path)

    assert set(results) == {"one", "two", "broken"} and results["broken"] == []
    for name in ("one", "two"):
        assert len(results[name]) == 2
        for row in results[name]:
            assert list(row) == list(cp.COLUMNS) and all(value > 0 for value in row.values())
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    # per server and round: warm-up, 1 stream, prefill, 8 streams, 32 streams = 43 requests
    assert [name for name, *_ in requests[::43]] == ["one", "two", "two", "one"]
    assert len(requests) == 4 * 43
    prompts = [{tuple(r[1:]) for r in requests[i * 43:(i + 1) * 43]} for i in range(4)]
    assert prompts[0] == prompts[1]            # round 0: one, then two, on the same prompts
    assert prompts[2] == prompts[3]            # round 1: two, then one, on their own
    assert not prompts[0] & prompts[2]         # round 1's are fresh
    assert any(length == cp.PREFILL_TOKENS for _, _, length in requests)


def test_sequential_starts_each_server_per_measurement(tmp_path: Path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    log = tmp_path / "requests.jsonl"
    port = free_port()   # both on one port: only possible one at a time
    peers = [cp.Peer(name, [sys.executable, str(script), name, str(port), str(log)], {}, 30, port)
             for name in ("one", "two")]
    args = argparse.Namespace(model="m", output_len=2, rounds=1, sequential=False, port=0)
    results = cp.measure_peers(peers, args, tmp_path)
    assert [len(results[name]) for name in ("one", "two")] == [1, 1]


def test_mean_context_counts_each_tokens_keys():
    for length, window in ((1, None), (7, None), (7, 3), (7, 7), (7, 9), (1019, 512)):
        seen = [min(t, window) if window else t for t in range(1, length + 1)]
        assert abs(cp.mean_context(length, window) - sum(seen) / length) < 1e-9


def test_prefill_flops_of_the_packaged_models():
    from servelm.model.gguf.gguf_file import GGUFFile
    from servelm.model.packaged import packaged_model_path
    qwen = Path(packaged_model_path("qwen2.5-coder-0.5b"))
    c = GGUFFile(qwen).hf_config()
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    per_layer = 2 * c.hidden_size ** 2 + 2 * kv * c.hidden_size + 3 * c.intermediate_size * c.hidden_size
    flops = cp.prefill_flops(qwen, 100)
    assert flops.linears == 2 * c.num_hidden_layers * per_layer
    # every layer global: heads x 2 head sizes x 2 FLOPs per key, 50.5 keys on average
    assert flops.attention == c.num_hidden_layers * 2 * c.num_attention_heads * 2 * (c.hidden_size // c.num_attention_heads) * 50.5
    assert flops.head == 2 * c.vocab_size * c.hidden_size / 100
    assert flops.total == flops.linears + flops.attention + flops.head
    # Gemma 3's sliding layers see at most their window: past it, fewer keys than all-global layers
    gemma = Path(packaged_model_path("gemma3-270m"))
    g = GGUFFile(gemma).hf_config()
    long, short = cp.prefill_flops(gemma, 4 * g.sliding_window), cp.prefill_flops(gemma, g.sliding_window)
    full = g.num_hidden_layers * 2 * g.num_attention_heads * 2 * g.head_dim * cp.mean_context(4 * g.sliding_window, None)
    assert short.attention == g.num_hidden_layers * 2 * g.num_attention_heads * 2 * g.head_dim * (g.sliding_window + 1) / 2
    assert long.attention < full


def test_roofline_shares_and_peak():
    flops = cp.PrefillFlops(linears=0.7e9, attention=0.05e9, head=0.05e9)   # 0.8 GFLOP a token
    results = {"a": [{"prefill tok/s": 300.0}, {"prefill tok/s": 500.0}, {"prefill tok/s": 400.0}],
               "b": [{"prefill tok/s": 1000.0}], "failed": []}
    lines = cp.roofline_lines(results, flops, 400.0, (390.0, 400.0), 2)
    assert "-> 500 prompt tok/s" in lines[0] and "390, 400" in lines[0]
    assert lines[3:] == ["| a | 400.0 | 80% |", "| b | 1000.0 | 200% |"]
    peak = cp.bf16_gemm_peak(1, size=64, repeats=2)
    assert 0 < peak < float("inf")


def test_the_long_context_column_is_the_decode_rate_after_the_first_token(tmp_path: Path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    log = tmp_path / "requests.jsonl"
    port = free_port()
    peers = [cp.Peer("one", [sys.executable, str(script), "one", str(port), str(log)], {}, 30, port)]
    args = argparse.Namespace(model="m", output_len=2, rounds=1, sequential=False, port=0, long_context=2048)
    results = cp.measure_peers(peers, args, tmp_path)
    [row] = results["one"]
    assert tuple(row) == cp.columns(2048) == cp.COLUMNS + ("1 stream @2048 tok/s",)
    # the server waits 1 s before a long prompt's first token, then ~1 ms a token: the column leaves
    # the first token's wait out (with it: 63 tokens in ~1.07 s, ~60 tok/s)
    assert 200 < row["1 stream @2048 tok/s"] < 1100
    assert [length for _, _, length in map(json.loads, log.read_text().splitlines())].count(2048) == 1
    medians, _ = cp.summarize(results, cp.columns(2048))
    assert len(medians[0]) == 1 + len(cp.columns(2048))
    assert cp.slot_tokens(2, 2048) > 2048 + cp.LONG_OUTPUT_TOKENS and cp.slot_tokens(2) > cp.PREFILL_TOKENS
