"""Multi-LoRA through the real server (issue 14): PEFT adapters made offline on SmolLM2-135M,
greedy tokens equal to transformers + peft (float32), mixed batches, run-time load/unload through
SGLang's and vLLM's endpoints, and every refusal."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lora_adapters import SPECS, base_model, make_adapter, make_bad_adapters, peft_greedy

from .server_process import ServerProcess

pytest.importorskip("peft")

MODEL = "smollm2-135m"
MAX_RANK = 32
NUM_NEW_TOKENS = 10
TEXTS = ["def quicksort(items):", "The capital of France is"]


@dataclass
class LoRAServer:
    server: ServerProcess
    root: Path
    prompts: list[list[int]]
    expected: dict[str | None, list[list[int]]]
    """Adapter name (None: the base model) -> transformers+peft greedy tokens per prompt."""
    bad: dict[str, tuple[Path, str]]

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.server.base_url}{path}", json=body, timeout=timeout)

    def generate(self, lora: str | None, prompt: list[int], **extra: Any) -> list[int]:
        body = {"input_ids": prompt, "lora_path": lora, **extra,
                "sampling_params": {"max_new_tokens": NUM_NEW_TOKENS, "temperature": 0,
                                    "ignore_eos": True}}
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return list(response.json()["output_ids"])

    def complete(self, model: str, prompt: list[int]) -> httpx.Response:
        return self.post("/v1/completions", {"model": model, "prompt": prompt, "temperature": 0,
                                             "max_tokens": NUM_NEW_TOKENS, "ignore_eos": True,
                                             "logprobs": 0})

    def adapters(self) -> dict[str, Any]:
        info = httpx.get(f"{self.server.base_url}/get_server_info", timeout=30).json()
        return {adapter["name"]: adapter for adapter in info["lora_adapters"]}

    def ensure_loaded(self, name: str) -> None:
        if name not in self.adapters():
            response = self.post("/load_lora_adapter", {"lora_name": name,
                                                        "lora_path": str(self.root / name)})
            assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoRAServer]:
    root = tmp_path_factory.mktemp("lora")
    models = {name: make_adapter(MODEL, root / name, seed, **spec)
              for seed, (name, spec) in enumerate(SPECS.items(), start=1)}
    bad = make_bad_adapters(MODEL, root / "bad", MAX_RANK)
    args = [MODEL, "--dtype", "float32", "--num-threads", "1", "--enable-lora",
            "--lora-paths", f"attn8={root / 'attn8'}", f"mlp16={root / 'mlp16'}",
            "--max-lora-rank", str(MAX_RANK), "--max-loras-per-batch", "2",
            "--max-loaded-loras", "3", "--context-length", "256", "--max-total-tokens", "4096"]
    with ServerProcess(args) as server:
        prompts = [httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}, timeout=30)
                   .json()["tokens"] for text in TEXTS]
        expected: dict[str | None, list[list[int]]] = {
            None: peft_greedy(base_model(MODEL), prompts, NUM_NEW_TOKENS)}
        for name, model in models.items():
            expected[name] = peft_greedy(model, prompts, NUM_NEW_TOKENS)
        assert len({json.dumps(tokens) for tokens in expected.values()}) == len(expected), \
            "every adapter changes the output"
        yield LoRAServer(server, root, prompts, expected, bad)


def completion_tokens(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["logprobs"]["tokens"])


# every adapter is checked against peft in the default run by the concurrent test below; the API
# spellings here on the base and the mixed adapter, the other adapters with -m slow
@pytest.mark.parametrize("name", [None, *(name if name == list(SPECS)[-1] else pytest.param(name, marks=pytest.mark.slow)
                                          for name in SPECS)])
def test_greedy_equals_transformers_peft(lora_server: LoRAServer, name: str | None) -> None:
    """Each adapter alone, by /generate lora_path, the OpenAI model field (vLLM) and base:adapter
    (SGLang): transformers + peft's greedy tokens."""
    if name is not None:
        lora_server.ensure_loaded(name)
    for prompt, expected in zip(lora_server.prompts, lora_server.expected[name]):
        assert lora_server.generate(name, prompt) == expected
        by_name = completion_tokens(lora_server.complete(name or MODEL, prompt))
        assert len(by_name) == NUM_NEW_TOKENS
        if name is not None:
            assert completion_tokens(lora_server.complete(f"{MODEL}:{name}", prompt)) == by_name
            assert completion_tokens(lora_server.complete(MODEL, prompt)) != by_name


def test_base_and_three_adapters_concurrently_equal_alone(lora_server: LoRAServer) -> None:
    """Base + 3 adapters x 2 prompts sent at once (with --max-loras-per-batch 2, so some wait for
    a running adapter to drain): each output equals the same request alone; then one /generate
    batch with a lora_path per prompt."""
    for name in SPECS:
        lora_server.ensure_loaded(name)
    jobs = [(name, index) for name in [None, *SPECS] for index in range(len(lora_server.prompts))]
    results: dict[tuple[str | None, int], list[int]] = {}

    def run(job: tuple[str | None, int]) -> None:
        results[job] = lora_server.generate(job[0], lora_server.prompts[job[1]])

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, index in jobs:
        assert results[(name, index)] == lora_server.expected[name][index], (name, index)

    names: list[str | None] = [None, *SPECS]
    body = {"input_ids": [lora_server.prompts[i % 2] for i in range(len(names))],
            "lora_path": names,
            "sampling_params": {"max_new_tokens": NUM_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    response = lora_server.post("/generate", body)
    assert response.status_code == 200, response.text
    for i, (name, item) in enumerate(zip(names, response.json())):
        assert item["output_ids"] == lora_server.expected[name][i % 2], name


def test_load_use_unload_reload_through_both_apis(lora_server: LoRAServer) -> None:
    server, name = lora_server, "mixed4-again"
    path = str(server.root / "mixed4")
    prompt, expected = server.prompts[0], server.expected["mixed4"][0]
    # SGLang's shapes
    response = server.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert response.status_code == 200 and response.json()["success"], response.text
    assert response.json()["loaded_adapters"][name] == path
    models = httpx.get(f"{server.server.base_url}/v1/models", timeout=30).json()["data"]
    listed = {entry["id"]: entry for entry in models}
    assert listed[name]["parent"] == MODEL and listed[name]["root"] == path
    assert listed[MODEL]["parent"] is None
    assert server.generate(name, prompt) == expected
    again = server.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    response = server.post("/unload_lora_adapter", {"lora_name": name})
    assert response.status_code == 200 and name not in response.json()["loaded_adapters"]
    gone = server.complete(name, prompt)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    # vLLM's shapes
    response = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert response.status_code == 200 and response.text.startswith("Success"), response.text
    assert server.generate(name, prompt) == expected
    response = server.post("/v1/unload_lora_adapter", {"lora_name": name})
    assert response.status_code == 200 and response.text.startswith("Success"), response.text
    missing = server.post("/v1/unload_lora_adapter", {"lora_name": name})
    assert missing.status_code == 404 and "is not loaded" in missing.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["malformed", "rank-over", "embed-target", "other-base",
                                  "missing-weights"])
def test_bad_adapter_is_refused_naming_the_reason(lora_server: LoRAServer, kind: str) -> None:
    path, reason = lora_server.bad[kind]
    for route in ("/load_lora_adapter", "/v1/load_lora_adapter"):
        response = lora_server.post(route, {"lora_name": kind, "lora_path": str(path)})
        assert response.status_code == 400, response.text
        assert reason in response.json()["error"]["message"], response.text
    assert kind not in lora_server.adapters()


def test_unknown_adapter_is_a_404(lora_server: LoRAServer) -> None:
    prompt = lora_server.prompts[0]
    for model in ("no-such-adapter", f"{MODEL}:no-such-adapter"):
        response = lora_server.complete(model, prompt)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
    response = lora_server.post("/v1/chat/completions", {
        "model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    response = lora_server.post("/generate", {"input_ids": prompt, "lora_path": "no-such-adapter"})
    assert response.status_code == 404 and "is not loaded" in response.json()["error"]["message"]
    response = lora_server.post("/generate", {"input_ids": [prompt, prompt], "lora_path": ["attn8"]})
    assert response.status_code == 400 and "lora_path has 1 entries" in response.text
    assert lora_server.post("/tokenize", {"model": "no-such-adapter", "prompt": "x"}).status_code == 404
    lora_server.ensure_loaded("mlp16")  # an adapter's name works for the shared tokenizer
    tokenized = lora_server.post("/tokenize", {"model": "mlp16", "prompt": TEXTS[0]})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == lora_server.prompts[0]


def test_unload_lets_running_requests_finish(lora_server: LoRAServer) -> None:
    """A streamed request keeps its adapter after the unload and ends with the adapter's tokens;
    new requests for the name get 404 at once."""
    lora_server.ensure_loaded("attn8")
    prompt = lora_server.prompts[1]
    body = {"input_ids": prompt, "lora_path": "attn8", "stream": True,
            "sampling_params": {"max_new_tokens": NUM_NEW_TOKENS, "temperature": 0,
                                "ignore_eos": True}}
    output_ids: list[int] = []
    try:
        with httpx.stream("POST", f"{lora_server.server.base_url}/generate", json=body,
                          timeout=120) as stream:
            unloaded = False
            for line in stream.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                output_ids = json.loads(line[5:])["output_ids"]
                if not unloaded:
                    response = lora_server.post("/unload_lora_adapter", {"lora_name": "attn8"})
                    assert response.status_code == 200, response.text
                    unloaded = True
                    assert lora_server.complete("attn8", prompt).status_code == 404
        assert unloaded and output_ids == lora_server.expected["attn8"][1]
    finally:
        lora_server.ensure_loaded("attn8")


def test_evicted_adapter_is_read_again_from_disk(lora_server: LoRAServer) -> None:
    """--max-loaded-loras 3: a fourth adapter drops the least recently used one from memory; a
    request for that one reads it back and still gets its tokens."""
    for name in SPECS:
        lora_server.ensure_loaded(name)
    lora_server.generate("mlp16", lora_server.prompts[0])
    lora_server.generate("mixed4", lora_server.prompts[0])  # attn8 is now least recently used
    copy = lora_server.root / "attn8-copy"
    shutil.copytree(lora_server.root / "attn8", copy, dirs_exist_ok=True)
    response = lora_server.post("/load_lora_adapter", {"lora_name": "attn8-copy", "lora_path": str(copy)})
    assert response.status_code == 200, response.text
    try:
        adapters = lora_server.adapters()
        assert not adapters["attn8"]["in_memory"] and adapters["attn8-copy"]["in_memory"]
        assert lora_server.generate("attn8", lora_server.prompts[0]) == lora_server.expected["attn8"][0]
        assert lora_server.adapters()["attn8"]["in_memory"]
        assert lora_server.generate("attn8-copy", lora_server.prompts[1]) == lora_server.expected["attn8"][1]
    finally:
        lora_server.post("/unload_lora_adapter", {"lora_name": "attn8-copy"})


def test_structured_output_with_an_adapter(lora_server: LoRAServer) -> None:
    """A grammar constrains an adapter's request as it does the base model's."""
    lora_server.ensure_loaded("mlp16")
    body = {"model": "mlp16", "prompt": "Answer yes or no:", "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                "required": ["answer"]}}}}
    response = lora_server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["choices"][0]["text"])["answer"] in ("yes", "no")


@pytest.mark.slow
def test_qwen_coder_adapters_equal_transformers_peft(tmp_path: Path) -> None:
    """The same parity on Qwen2.5-Coder-0.5B (biased QKV): two adapters of different ranks and
    targets, one batch with the base model, through the real server."""
    model_name = "qwen2.5-coder-0.5b"
    specs = {"qattn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
             "qmlp": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "down_proj"],
                          layers_to_transform=list(range(12)))}
    models = {name: make_adapter(model_name, tmp_path / name, seed, **spec)
              for seed, (name, spec) in enumerate(specs.items(), start=1)}
    args = [model_name, "--dtype", "float32", "--num-threads", "1", "--enable-lora",
            "--lora-modules", *(f"{name}={tmp_path / name}" for name in specs),
            "--max-lora-rank", "16", "--context-length", "256", "--max-total-tokens", "2048"]
    with ServerProcess(args) as server:
        prompt = httpx.post(f"{server.base_url}/tokenize", json={"prompt": TEXTS[0]},
                            timeout=30).json()["tokens"]
        names: list[str | None] = [None, *specs]
        expected = {None: peft_greedy(base_model(model_name), [prompt], NUM_NEW_TOKENS)[0]}
        for name, model in models.items():
            expected[name] = peft_greedy(model, [prompt], NUM_NEW_TOKENS)[0]
        body = {"input_ids": [prompt] * len(names), "lora_path": names,
                "sampling_params": {"max_new_tokens": NUM_NEW_TOKENS, "temperature": 0,
                                    "ignore_eos": True}}
        response = httpx.post(f"{server.base_url}/generate", json=body, timeout=300)
        assert response.status_code == 200, response.text
        for name, item in zip(names, response.json()):
            assert item["output_ids"] == expected[name], name


def test_offline_engine_with_two_replicas_carries_the_adapter(lora_server: LoRAServer) -> None:
    """servelm.Engine with --dp-size 2: requests spread over both replicas keep their adapter, and
    a run-time load reaches both (round robin sends consecutive requests to different replicas)."""
    from servelm import Engine

    root = lora_server.root
    # no start-up warm-up in either replica: it changes no token (its own tests check it)
    with Engine(MODEL, dtype="float32", num_threads=1, data_parallel_size=2, context_length=256,
                max_total_tokens=2048, lora_paths=[f"attn8={root / 'attn8'}"],
                skip_server_warmup=True) as engine:
        names: list[str | None] = ["attn8", None, "attn8", None]
        prompts = [lora_server.prompts[i % 2] for i in range(len(names))]
        params = {"temperature": 0.0, "max_tokens": NUM_NEW_TOKENS, "ignore_eos": True}
        results = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        for i, (name, result) in enumerate(zip(names, results)):
            assert result.token_ids == lora_server.expected[name][i % 2], (i, name)
        assert engine.load_lora_adapter("mixed4", str(root / "mixed4"))["success"]
        results = engine.generate(input_ids=[lora_server.prompts[0]] * 2, sampling_params=params,
                                  lora_path="mixed4")
        assert [r.token_ids for r in results] == [lora_server.expected["mixed4"][0]] * 2
        assert engine.unload_lora_adapter("mixed4")["success"]
        missing = engine.generate(input_ids=lora_server.prompts[0], sampling_params=params,
                                  lora_path="mixed4")
        assert missing.finish_reason == "error" and "is not loaded" in missing.error


def test_bad_startup_adapter_stops_the_server_with_the_reason(lora_server: LoRAServer) -> None:
    """A --lora-paths adapter that cannot be served stops `servelm serve` before any model loads,
    with one line naming the reason."""
    import subprocess
    import sys

    from .server_process import REPO

    path, reason = lora_server.bad["rank-over"]
    result = subprocess.run([sys.executable, "-m", "servelm", "serve", MODEL, "--lora-paths",
                             f"big={path}", "--max-lora-rank", str(MAX_RANK), "--port", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "servelm: --lora-paths: LoRA adapter 'big'" in result.stderr and reason in result.stderr
