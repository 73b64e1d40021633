"""servelm.Engine: offline batches through the engine process, on the real SmolLM2-135M."""

from __future__ import annotations

import pytest

from servelm import Engine, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def engine():
    # float32: the tests compare tokens across batch orders, and in bf16 (--dtype auto on a CPU
    # with native bf16) a row's rounding depends on the step's shape (README, "Fast on CPU").
    # No start-up warm-up: it changes no token (tests/unit/engine/test_warmup.py,
    # tests/e2e/test_warmup_live.py check it), as tests.e2e.server_process does for the servers.
    with Engine(model_path="smollm2-135m", max_total_tokens=4096, chunked_prefill_size=8,
                dtype="float32", skip_server_warmup=True) as running:
        yield running
    assert not any(process.is_alive() for process in running._engine.processes)


def test_batch_equals_one_by_one(engine):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = engine.generate(PROMPTS, params)
    assert [len(result.token_ids) for result in batch] == [16, 16, 16]
    for prompt, result in zip(PROMPTS, batch):
        alone = engine.generate(prompt, params)
        assert alone.token_ids == result.token_ids
        assert alone.text == result.text == engine.tokenizer.decode(result.token_ids)
        assert result.finish_reason == "length"


def test_input_ids_stop_and_seed(engine):
    ids = engine.tokenizer.encode("1, 2, 3, 4,")
    result = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_tokens": 12,
                                                             "stop": [","]})
    assert result.finish_reason == "stop" and result.stop_reason == ","
    assert "," not in result.text
    sampled = dict(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    first = engine.generate(PROMPTS, [SamplingParams(**sampled)] * 3)
    second = engine.generate(PROMPTS[::-1], [SamplingParams(**sampled)] * 3)
    assert [r.token_ids for r in first] == [r.token_ids for r in second[::-1]]


def test_kv_returns_to_the_pool(engine):
    engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    info = engine.get_server_info()
    assert info["num_used_blocks"] == 0 and info["num_running"] == 0
