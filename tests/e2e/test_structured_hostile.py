"""Hostile grammars on a live server (SmolLM2-135M) while a normal stream decodes (issue 19).

Before: the issue's 264-byte schema killed the server (std::bad_alloc), a self-loop $ref was a
500, and an enum of 100k values, 10k optional properties or an array nested 900 deep compiled
inside the engine step, stalling every other stream for 48-300 s while /health said 200.
Now each is a 400 in OpenAI's error format naming the problem (the budgets name their flags),
and the normal stream's tokens keep coming.

The server runs with the spec budget raised (--max-grammar-spec-bytes 100000) so one schema
(thousands of optional properties: seconds of compile) passes the up-front checks and reaches
the engine, where a short --grammar-compile-timeout refuses it and kills the process compiling it
(afterwards the idle engine uses no CPU: nothing compiles on). The llguidance server (lazy masks: a faster compile) runs in the slow set.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import psutil
import pytest

from .server_process import ServerProcess

MODEL = "smollm2-135m"
NORMAL_TOKENS = 1000  # long enough to outlast the hostile requests on a fast default (GGUF kernels: ~35 tok/s;
# 600 ended first in 2 of 3 full-suite runs on a Zen 4 VM in session 28); prompt + 1000 fits --context-length 1024
MAX_GAP_S = 5.0
"""Largest pause allowed between two tokens of the normal stream: generous for a loaded 2-core
box (a decode step of this model takes tens of ms), far below the minutes seen before."""


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _optional_properties(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


HOSTILE = {  # name -> (extra request fields, words the 400 must contain)
    "issue payload": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}}, "no finite JSON value"),
    "self-loop $ref": ({"guided_json": {"$ref": "#"}}, "no finite JSON value"),
    "mutual $defs": ({"guided_json": {"$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}, "$ref": "#/$defs/a"}},
        "no way out"),
    "not {}": ({"guided_json": {"type": "object", "properties": {"x": {"not": {}}}, "required": ["x"]}},
               "not: {}"),
    "empty enum": ({"guided_json": {"enum": []}}, "empty enum"),
    "min > max": ({"guided_json": {"type": "integer", "minimum": 9, "maximum": 1}}, "minimum 9 > maximum 1"),
    "tool whose parameters contain themselves": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"again": {"$ref": "#"}},
                                    "required": ["again"]}}}], "tool_choice": "required"}, "no way out"),
    "EBNF with no way out": ({"guided_grammar": 'root ::= "[" root "]"'}, "no finite output"),
    "enum of 100k values": ({"guided_json": {"enum": [f"value{i}" for i in range(100_000)]}},
                            "--max-grammar-spec-bytes"),
    "10k optional properties": ({"guided_json": _optional_properties(10_000)}, "--max-grammar-spec-bytes"),
    "choice of 100k values": ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "--max-grammar-spec-bytes"),
    "arrays nested 900 deep": ({"guided_json": _nested_arrays(900)}, "nested 901 levels deep"),
}
SLOW_COMPILE = {"xgrammar": (2000, "0.5"), "llguidance": (3000, "0.1")}
"""Per backend: optional properties that compile in seconds (xgrammar 2-18 s, llguidance 0.7 s on
the dev box, well within --max-grammar-spec-bytes 100000), and a compile timeout below that."""


@pytest.fixture(scope="module", params=["xgrammar", pytest.param("llguidance", marks=pytest.mark.slow)])
def server(request):
    num_properties, timeout_s = SLOW_COMPILE[request.param]
    with ServerProcess([MODEL, "--grammar-backend", request.param, "--num-threads", "1",
                        "--max-total-tokens", "8192", "--context-length", "1024",
                        "--max-grammar-spec-bytes", "100000", "--grammar-compile-timeout", timeout_s]) as running:
        running.hostile = {**HOSTILE, "slow compile": ({"guided_json": _optional_properties(num_properties)},
                                                       "--grammar-compile-timeout")}
        yield running


def _stream_normal(base_url: str, arrivals: list[float], result: dict) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": NORMAL_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append(time.monotonic())
                if chunk.get("usage"):
                    result["usage"] = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                    result["finish_reason"] = chunk["choices"][0]["finish_reason"]


def _hostile(base_url: str, fields: dict, name: str) -> tuple[str, httpx.Response]:
    if "response_format" in fields or "tools" in fields:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, **fields}
        return name, httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 20, **fields}
    return name, httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)


def test_hostile_grammars_are_400s_while_a_normal_stream_decodes(server):
    arrivals: list[float] = []
    result: dict = {}
    normal = threading.Thread(target=_stream_normal, args=(server.base_url, arrivals, result))
    normal.start()
    deadline = time.monotonic() + 120
    while not arrivals and time.monotonic() < deadline:  # hostile requests land mid-stream
        time.sleep(0.05)
    with ThreadPoolExecutor(4) as pool:
        responses = dict(pool.map(lambda name: _hostile(server.base_url, server.hostile[name][0], name),
                                  server.hostile))
    during_stream = bool(normal.is_alive())
    normal.join(timeout=600)
    for name, response in responses.items():
        assert response.status_code == 400, (name, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", (name, error)
        assert server.hostile[name][1] in error["message"], (name, error["message"])
    assert result.get("status") == 200 and result.get("finish_reason") == "length"
    assert len(arrivals) >= NORMAL_TOKENS // 2  # chunks can carry several tokens
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    print(f"normal stream: {len(arrivals)} chunks, largest gap {max(gaps):.3f} s")
    assert max(gaps) < MAX_GAP_S, f"normal stream stalled {max(gaps):.1f} s"
    assert during_stream, "the stream ended before the hostile requests did: nothing was measured"
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert server.process is not None and server.process.poll() is None
    # The timed-out compile was stopped, not left running on a thread: the idle engine (and its
    # compile process, if one runs) uses next to no CPU now.
    engine = min((c for c in psutil.Process(server.process.pid).children()
                  if "spawn_main" in " ".join(c.cmdline())), key=lambda c: c.create_time())
    tree = [engine, *engine.children(recursive=True)]
    before = sum(sum(p.cpu_times()[:2]) for p in tree if p.is_running())
    time.sleep(2.0)
    after = sum(sum(p.cpu_times()[:2]) for p in tree if p.is_running())
    assert after - before < 0.6, f"the engine used {after - before:.1f} CPU s in 2 s idle"


def test_structured_output_still_works_after_hostile_requests(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    body = {"model": MODEL, "prompt": "A JSON object:", "max_tokens": 30, "temperature": 0, "guided_json": schema}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), schema)
