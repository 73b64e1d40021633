"""How a burst of requests and a lone request are admitted and chunked (the shape of compare_peers' 32-stream
leg, benchmarks/served_timeline.py): the defaults (--chunked-prefill-size 512, --max-prefill-tokens
4096) take a burst of 32 x 128-token prompts in one prefill step, a lone request is computed in the
first step after it arrives, and a request that arrives while others decode joins the next step.
Any scheduling change that splits the burst, delays the lone request or holds an arrival back
fails here."""

from __future__ import annotations


from servelm.config import EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.scheduler import SchedulerOutput
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner

PROMPT_TOKENS = 128


def make_engine(num_blocks: int = 1200, context_length: int = 1024,
                **scheduler: int) -> tuple[LLMEngine, list[list[int]]]:
    """An engine on the default scheduler config (or ``scheduler``'s fields), recording each step's
    (request, tokens) rows."""
    runner = FakeRunner(num_blocks=num_blocks, block_size=16)
    engine = LLMEngine(EngineConfig(scheduler=SchedulerConfig(**scheduler)), runner=runner, eos_token_ids=[96],
                       context_length=context_length)
    steps: list[list[int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        output = schedule()
        steps.append([scheduled.num_tokens for scheduled in output.scheduled])
        return output

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return engine, steps


def prompt(index: int) -> list[int]:
    return [(index * 7 + position) % 90 + 1 for position in range(PROMPT_TOKENS)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_a_burst_of_32_prompts_is_prefilled_in_one_step() -> None:
    engine, steps = make_engine()
    for index in range(32):
        assert engine.add_request(f"r{index}", prompt(index), params(4)) is None
    first = engine.step()
    assert steps == [[PROMPT_TOKENS] * 32]          # 4096 tokens: the whole burst, one step
    assert sorted(output.request_id for output in first) == sorted(f"r{i}" for i in range(32))
    assert all(len(output.new_token_ids) == 1 for output in first)
    while engine.has_unfinished():
        engine.step()
    assert steps[1:] == [[1] * 32] * 3               # then every stream decodes together


def test_a_burst_larger_than_the_step_budget_takes_the_fewest_steps() -> None:
    engine, steps = make_engine()
    for index in range(40):                          # 5120 prompt tokens > --max-prefill-tokens 4096
        assert engine.add_request(f"r{index}", prompt(index), params(2)) is None
    engine.step()
    engine.step()
    assert steps[0] == [PROMPT_TOKENS] * 32
    assert steps[1] == [1] * 32 + [PROMPT_TOKENS] * 8  # decodes first, then the rest of the burst


def test_a_lone_request_is_computed_in_the_first_step() -> None:
    engine, steps = make_engine()
    assert engine.add_request("alone", prompt(0), params(3)) is None
    outputs = engine.step()
    assert steps == [[PROMPT_TOKENS]]
    assert [output.request_id for output in outputs] == ["alone"]
    assert len(outputs[0].new_token_ids) == 1       # its first token after one step, no wait


def test_an_arrival_during_decode_joins_the_next_step() -> None:
    engine, steps = make_engine()
    for index in range(4):
        assert engine.add_request(f"r{index}", prompt(index), params(8)) is None
    engine.step()
    engine.step()
    assert engine.add_request("late", prompt(9), params(2)) is None
    outputs = engine.step()
    assert steps[2] == [1] * 4 + [PROMPT_TOKENS]     # decodes and the late prompt, same step
    assert "late" in {output.request_id for output in outputs}


def make_chunking_engine(**scheduler: int) -> tuple[LLMEngine, list[list[int]]]:
    return make_engine(num_blocks=400, context_length=4096, **scheduler)


def long_prompt(length: int, seed: int = 0) -> list[int]:
    return [(seed * 13 + position * 7) % 90 + 1 for position in range(length)]


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_a_lone_long_prompt_is_one_step_under_the_default_chunk_size() -> None:
    engine, steps = make_chunking_engine()
    assert engine.add_request("alone", long_prompt(1019), params(2)) is None
    tokens = drain(engine)
    assert steps == [[1019], [1]]                    # not 512 + 507: nothing else waits on it
    reference, _ = make_chunking_engine(chunked_prefill_size=-1)
    assert reference.add_request("alone", long_prompt(1019), params(2)) is None
    assert drain(reference) == tokens


def test_the_step_budget_still_bounds_a_lone_prompt() -> None:
    engine, steps = make_chunking_engine(max_prefill_tokens=700)
    assert engine.add_request("alone", long_prompt(1019), params(1)) is None
    drain(engine)
    assert steps == [[700], [319]]


def test_a_long_prompt_beside_a_decode_is_chunked() -> None:
    engine, steps = make_chunking_engine(fair_step_tokens=0)
    assert engine.add_request("first", long_prompt(16), params(8)) is None
    engine.step()
    assert engine.add_request("long", long_prompt(1019, 1), params(1)) is None
    drain(engine)
    assert steps[1] == [1, 512]                      # the decode keeps streaming beside it
    assert steps[2] == [1, 507]


def test_a_long_prompt_beside_a_decode_moves_at_the_fair_share() -> None:
    """More than 512 prompt tokens beside a decode: a heavy request, bounded to --fair-step-tokens
    (32 here) a step (fewer deep in its context) until the decode is done and LIGHT_GRACE_S more
    (the user's next request may be on its way; each step here takes 0.3 s) (issue 35)."""
    engine, steps = make_chunking_engine(fair_step_tokens=32)
    now = [0.0]
    engine.scheduler.fair_shares.clock = lambda: now[0]
    schedule = engine.scheduler.schedule

    def timed_schedule():
        now[0] += 0.3
        return schedule()

    engine.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
    assert engine.add_request("first", long_prompt(16), params(8)) is None
    engine.step()
    assert engine.add_request("long", long_prompt(1019, 1), params(1)) is None
    drain(engine)
    for step in steps[1:8]:                          # the decode streams beside it, steps stay short
        assert step[0] == 1 and 30 <= step[1] <= 32, steps
    for step in steps[8:12]:                         # within the grace (from the decode's last step's end)
        assert len(step) == 1 and 24 <= step[0] <= 32, steps  # fewer deeper in its context
    assert steps[12] == [1019 - sum(step[-1] for step in steps[1:12])]  # then alone: the rest at once


def test_two_long_prompts_queued_together_are_chunked() -> None:
    engine, steps = make_chunking_engine()
    assert engine.add_request("a", long_prompt(1019), params(1)) is None
    assert engine.add_request("b", long_prompt(1019, 1), params(1)) is None
    engine.step()
    assert steps[0] == [512, 512]


def test_a_chosen_chunk_size_applies_to_a_lone_prompt() -> None:
    engine, steps = make_chunking_engine(chunked_prefill_size=256)
    assert engine.add_request("alone", long_prompt(600), params(1)) is None
    drain(engine)
    assert steps == [[256], [256], [88]]


def test_prompt_logprobs_keep_the_default_chunk() -> None:
    engine, steps = make_chunking_engine()
    logprob_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    assert engine.add_request("alone", long_prompt(1019), logprob_params) is None
    drain(engine)
    assert steps == [[512], [507]]
