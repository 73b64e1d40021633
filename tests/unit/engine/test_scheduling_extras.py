"""SGLang's --prefill-only-one-req and LightLLM's --router_max_new_token_len on the engine with
the fake runner (admission is decided by the first step's schedule)."""

from __future__ import annotations

from servelm.config import CacheConfig, EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner

EOS = 96


def engine_with(num_blocks: int = 64, **scheduler: object) -> LLMEngine:
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler),  # type: ignore[arg-type]
                          cache=CacheConfig(page_size=4))
    return LLMEngine(config, runner=FakeRunner(num_blocks=num_blocks, block_size=4), tokenizer=None,
                     eos_token_ids=[EOS], context_length=1024)


def admitted_after_one_step(engine: LLMEngine, max_tokens: int, num_requests: int = 3) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(num_requests):
        assert engine.add_request(str(index), [index + 1] * 8, params) is None
    engine.step()
    return len(engine.scheduler.running)


def test_prefill_only_one_req_admits_one_prompt_per_step() -> None:
    assert admitted_after_one_step(engine_with(), 4) == 3
    engine = engine_with(prefill_only_one_req=True)
    assert admitted_after_one_step(engine, 4) == 1
    engine.step()
    assert len(engine.scheduler.running) == 2  # the next one joins the decoding request
    tokens: dict[str, int] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] = output.num_output_tokens
    assert tokens == {"0": 4, "1": 4, "2": 4}


def test_router_max_new_token_len_shrinks_the_reserve() -> None:
    """With --router_token_ratio, admission reserves each running request's blocks up to its
    max_tokens (200 tokens: 50+ blocks of a 64-block pool), so only one request starts; assuming
    16 output tokens instead lets all three in."""
    assert admitted_after_one_step(engine_with(router_token_ratio=0.01), 200) == 1
    engine = engine_with(router_token_ratio=0.01, router_max_new_token_len=16)
    assert admitted_after_one_step(engine, 200) == 3
