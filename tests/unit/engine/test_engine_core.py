"""LLMEngine + Scheduler driven by a fake runner that checks the KV contract (no weights)."""

from __future__ import annotations

import pytest

from servelm.config import EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner

EOS = 96


def make_engine(num_blocks: int = 64, block_size: int = 4, tokenizer=None, context_length: int = 512,
                **scheduler: int) -> tuple[LLMEngine, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size)
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler))
    engine = LLMEngine(config, runner=runner, tokenizer=tokenizer, eos_token_ids=[EOS],
                       context_length=context_length)
    return engine, runner


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for request_id, (prompt, params) in requests.items():
        assert engine.add_request(request_id, prompt, params) is None
    tokens = {request_id: [] for request_id in requests}
    texts = {request_id: "" for request_id in requests}
    finished = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 10_000
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
            texts[output.request_id] += output.new_text
            if output.is_finished:
                assert output.request_id not in finished
                finished[output.request_id] = output
    assert set(finished) == set(requests)
    return tokens, texts, finished


PROMPTS = [[(7 * i + j) % 90 + 1 for j in range(3 + 5 * i)] for i in range(8)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_single_request_matches_reference():
    engine, runner = make_engine()
    tokens, _, finished = run_all(engine, {"a": (PROMPTS[2], greedy(12))})
    assert tokens["a"] == runner.reference(PROMPTS[2], 12)
    assert finished["a"].finish_reason == "length"
    assert finished["a"].num_prompt_tokens == len(PROMPTS[2])
    assert engine.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("chunk", [-1, 3])
def test_batch_equals_alone_with_and_without_chunked_prefill(chunk):
    engine, runner = make_engine(chunked_prefill_size=chunk, max_prefill_tokens=16)
    requests = {f"r{i}": (prompt, greedy(10 + i)) for i, prompt in enumerate(PROMPTS)}
    tokens, _, _ = run_all(engine, requests)
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == runner.reference(prompt, 10 + i)
    assert runner.max_batch_tokens <= 16
    assert engine.stats()["num_used_blocks"] == 0


def test_heavy_preemption_completes_every_request_exactly():
    # 13 blocks x 4 = 52 tokens of KV for 8 requests needing up to 49 each.
    engine, runner = make_engine(num_blocks=13, chunked_prefill_size=4, max_prefill_tokens=8)
    requests = {f"r{i}": (prompt, greedy(12)) for i, prompt in enumerate(PROMPTS)}
    tokens, _, finished = run_all(engine, requests)
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == runner.reference(prompt, 12), f"r{i}"
        assert finished[f"r{i}"].finish_reason == "length"
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["num_used_blocks"] == 0


def test_max_running_requests_bounds_the_batch():
    engine, _ = make_engine(max_running_requests=2)
    for i in range(5):
        engine.add_request(f"r{i}", PROMPTS[i], greedy(3))
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 2


def test_stop_token_eos_and_min_tokens():
    engine, runner = make_engine()
    prompt = PROMPTS[1]
    expected = runner.reference(prompt, 20)
    stop_id = expected[4]
    first = expected.index(stop_id)
    tokens, _, finished = run_all(engine, {
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id])),
        "min": (prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id],
                                       min_tokens=first + 2)),
    })
    assert tokens["stop"] == expected[:first + 1]
    assert finished["stop"].finish_reason == "stop"
    assert finished["stop"].stop_reason == stop_id
    # min_tokens masks the stop id in sampling, so the sequence diverges after it.
    assert len(tokens["min"]) >= first + 2
    assert stop_id not in tokens["min"][:first + 2]


def test_eos_stops_unless_ignored():
    engine, runner = make_engine()
    # Find a prompt whose greedy continuation hits EOS within 40 tokens.
    for base in range(1, 200):
        prompt = [base, base + 1]
        expected = runner.reference(prompt, 40)
        if EOS in expected:
            break
    else:
        pytest.skip("no prompt reaches EOS")
    tokens, _, finished = run_all(engine, {
        "eos": (prompt, SamplingParams(temperature=0, max_tokens=40)),
        "ignore": (prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
    })
    assert tokens["eos"] == expected[:expected.index(EOS) + 1]
    assert finished["eos"].finish_reason == "stop" and finished["eos"].stop_reason is None
    assert tokens["ignore"] == expected
    assert finished["ignore"].finish_reason == "length"


def test_context_length_limit():
    engine, runner = make_engine(context_length=20)
    prompt = PROMPTS[2]  # 13 tokens
    tokens, _, finished = run_all(engine, {"a": (prompt, SamplingParams(temperature=0, max_tokens=None,
                                                                        ignore_eos=True))})
    assert len(prompt) + len(tokens["a"]) == 20
    assert finished["a"].finish_reason == "length"


def test_rejections_finish_with_error():
    engine, _ = make_engine(num_blocks=2, block_size=4, context_length=64)
    assert engine.add_request("empty", [], greedy(1)).finish_reason == "error"
    too_long = engine.add_request("long", list(range(64)), greedy(1))
    assert too_long.finish_reason == "error" and "context length" in too_long.error
    assert engine.add_request("vocab", [1000], greedy(1)).finish_reason == "error"
    # Fits the context but never the 8-token pool: rejected up front...
    rejected = engine.add_request("big", list(range(1, 6)), greedy(5))
    assert rejected.finish_reason == "error" and "KV cache" in rejected.error
    # ...or, without max_tokens, ended when the pool runs out.
    _, _, finished = run_all(engine, {"open": (list(range(1, 6)), SamplingParams(
        temperature=0, max_tokens=None, ignore_eos=True))})
    assert finished["open"].finish_reason == "error"
    assert "pool" in finished["open"].error


def test_abort_frees_blocks():
    engine, _ = make_engine()
    engine.add_request("a", PROMPTS[3], greedy(50))
    engine.add_request("b", PROMPTS[4], greedy(5))
    engine.step()
    assert engine.block_pool.num_used_blocks > 0
    aborted = engine.abort_request("a")
    assert aborted.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["num_used_blocks"] == 0
    assert engine.abort_request("a") is None


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26)."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_string_across_tokens_is_cut_and_streams_consistently():
    engine, runner = make_engine(tokenizer=CharTokenizer())
    prompt = PROMPTS[0]
    expected = runner.reference(prompt, 30)
    text = CharTokenizer().decode(expected)
    stop = text[5:8]  # spans three tokens
    cut = text.index(stop)
    tokens, texts, finished = run_all(engine, {
        "a": (prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)),
        "b": (prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True,
                                     include_stop_str_in_output=True)),
    })
    assert texts["a"] == text[:cut]
    assert texts["b"] == text[:cut + len(stop)]
    assert finished["a"].finish_reason == "stop" and finished["a"].stop_reason == stop
    assert tokens["a"] == expected[:cut + len(stop)]


def test_stream_interval_batches_outputs():
    engine, runner = make_engine(stream_interval=4)
    engine.add_request("a", PROMPTS[0], greedy(10))
    counts = []
    while engine.has_unfinished():
        for output in engine.step():
            counts.append(len(output.new_token_ids))
    assert counts == [4, 4, 2]
