"""Heavy requests beside normal users (issue 35): n copies of a prompt compute it once, and while
a heavy request and a normal one both have work, the heavy ones' tokens per step are bounded
(--fair-step-tokens; 32 here) and one request's copies take at most a quarter of --max-running-requests
sequences per step, while normal requests are computed as before (test_burst_admission.py)."""

from __future__ import annotations

from servelm.config import EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.policy import LIGHT_GRACE_S, FairShares, StepBudget
from servelm.engine.request import Request
from servelm.engine.scheduler import SchedulerOutput
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner


class StepClock:
    """A clock that moves ``step_s`` per engine step (the fake runner's steps take no time)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_engine(step_s: float = 0.1, **scheduler: int) -> tuple[LLMEngine, list[dict[str, int]], FakeRunner]:
    scheduler.setdefault("fair_step_tokens", 32)
    runner = FakeRunner(num_blocks=600, block_size=16)
    engine = LLMEngine(EngineConfig(scheduler=SchedulerConfig(**scheduler)), runner=runner,
                       eos_token_ids=[96], context_length=4096)
    steps: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule
    clock = StepClock(step_s)
    engine.scheduler.fair_shares.clock = clock

    def recording_schedule() -> SchedulerOutput:
        clock.now += clock.step_s
        output = schedule()
        steps.append({s.request.request_id: s.num_tokens for s in output.scheduled})
        return output

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return engine, steps, runner


def prompt(length: int, seed: int = 0) -> list[int]:
    return [(seed * 13 + position * 7) % 90 + 1 for position in range(length)]


def params(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            assert output.finish_reason in (None, "length"), output.error
    return tokens


def test_a_heavy_prompt_beside_a_decode_moves_at_its_share():
    engine, steps, runner = make_engine()
    assert engine.add_request("user", prompt(16), params(20)) is None
    first = engine.step()
    assert engine.add_request("heavy", prompt(700, 1), params(2, prompt_logprobs=5)) is None
    tokens = drain(engine)
    tokens["user"] = first[0].new_token_ids + tokens["user"]
    shared = [step for step in steps[1:] if "user" in step and "heavy" in step]
    assert len(shared) >= 15 and all(step["user"] == 1 for step in shared)  # decodes every step
    for step in shared:
        assert 0 < step["heavy"] * 2 <= 32  # a prompt-logprob token counts (at least) double
    assert tokens["heavy"] == runner.reference(prompt(700, 1), 2)
    assert tokens["user"] == runner.reference(prompt(16), 20)
    alone = [step["heavy"] for step in steps if list(step) == ["heavy"] and step["heavy"] > 1]
    assert alone and max(alone) > 32  # once the user is done, the heavy one runs at full chunks
    grace = [step["heavy"] for step in steps[len(shared) + 1:][:int(LIGHT_GRACE_S / 0.1) - 1]]
    assert grace and max(grace) * 2 <= 32  # ... after the grace a normal user's next request gets


def test_a_heavy_prompt_stays_at_its_share_to_its_last_token():
    """A heavy prompt whose work left falls under the heavy threshold (here after ~50 of its 300
    prompt-logprob tokens) is still bounded: before, the step in which it turned light computed the
    rest of it at once, a step many times a shared one that the decoding user waited for."""
    engine, steps, runner = make_engine()
    assert engine.add_request("user", prompt(16), params(200)) is None
    first = engine.step()
    assert engine.add_request("heavy", prompt(300, 1), params(2, prompt_logprobs=5)) is None
    tokens = drain(engine)
    tokens["user"] = first[0].new_token_ids + tokens["user"]
    shared = [step for step in steps[1:] if "user" in step and "heavy" in step]
    assert len(shared) >= 300 // 16
    assert all(0 < step["heavy"] * 2 <= 32 for step in shared), [s["heavy"] for s in shared]
    assert tokens["heavy"] == runner.reference(prompt(300, 1), 2)
    assert tokens["user"] == runner.reference(prompt(16), 200)


def test_a_normal_users_next_request_finds_the_heavy_one_at_its_share():
    """Between a normal user's requests (a round trip) the heavy request keeps to its share, so the
    user's next request does not wait for a full-budget heavy step; long after, it runs full."""
    for gap_s, bounded in ((LIGHT_GRACE_S / 2, True), (LIGHT_GRACE_S * 3, False)):
        engine, steps, _ = make_engine(step_s=gap_s)
        assert engine.add_request("heavy", prompt(2000, 1), params(1, prompt_logprobs=1)) is None
        assert engine.add_request("user", prompt(16), params(1)) is None
        engine.step()  # the user's prompt and its one token; the heavy one at its share
        assert steps[0]["user"] == 16 and steps[0]["heavy"] * 2 <= 32
        engine.step()  # the user's last step has just ended: its next request is on its way
        assert "user" not in steps[1] and steps[1]["heavy"] * 2 <= 32, steps[1]
        engine.step()  # one step later (gap_s): the user has not come back
        assert "user" not in steps[2]
        assert (steps[2]["heavy"] * 2 <= 32) is bounded, (gap_s, steps[2])


def test_a_shared_step_slower_than_the_grace_does_not_end_it():
    """The grace counts from the end of the user's last step: a step that alone takes longer than
    the grace (a loaded machine) still leaves the next one bounded."""
    engine, steps, _ = make_engine(step_s=LIGHT_GRACE_S * 2)
    assert engine.add_request("heavy", prompt(2000, 1), params(1, prompt_logprobs=1)) is None
    assert engine.add_request("user", prompt(16), params(2)) is None
    engine.step()
    engine.step()  # the user's second token: it is done
    assert steps[1]["user"] == 1
    engine.step()  # started the moment the user's last step ended
    assert "user" not in steps[2] and steps[2]["heavy"] * 2 <= 32, steps[2]


def test_a_light_arrival_is_not_bounded_and_fairness_can_be_turned_off():
    for fair, expected in ((32, 32 // 2), (0, 512)):
        engine, steps, _ = make_engine(fair_step_tokens=fair)
        assert engine.add_request("user", prompt(16), params(8)) is None
        engine.step()
        assert engine.add_request("heavy", prompt(700, 1), params(1, prompt_logprobs=1)) is None
        assert engine.add_request("light", prompt(100, 2), params(1)) is None
        engine.step()
        assert steps[1]["user"] == 1 and steps[1]["light"] == 100  # a normal prompt joins whole
        assert steps[1]["heavy"] <= expected and steps[1]["heavy"] >= expected * 0.8


def test_a_group_of_copies_decodes_at_most_its_share_of_sequences_per_step():
    engine, steps, runner = make_engine(max_running_requests=32, fair_step_tokens=64)  # 8 a step
    for index in range(20):
        assert engine.add_request(f"copy-{index}", prompt(12, 3), params(12), group="big") is None
    early = engine.step() + engine.step()
    assert sum(1 for request_id in steps[1] if request_id.startswith("copy-")) == 20  # alone: all
    assert engine.add_request("user", prompt(10), params(8)) is None
    tokens = drain(engine)
    for output in reversed(early):
        tokens[output.request_id] = output.new_token_ids + tokens[output.request_id]
    with_user = [step for step in steps[2:] if "user" in step]
    assert len(with_user) == 8  # the user computes in every step until it is done
    for step in with_user:
        assert sum(1 for request_id in step if request_id.startswith("copy-")) <= 8
    reference = runner.reference(prompt(12, 3), 12)
    assert all(tokens[f"copy-{index}"] == reference for index in range(20))
    assert tokens["user"] == runner.reference(prompt(10), 8)


def test_copies_of_one_prompt_compute_it_once_with_its_prompt_logprobs():
    engine, steps, runner = make_engine()
    for index in range(4):
        assert engine.add_request(f"c{index}", prompt(101), params(3, prompt_logprobs=2), group="g") is None
    prompt_logprobs: dict[str, list] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.prompt_logprobs is not None:
                prompt_logprobs[output.request_id] = output.prompt_logprobs
    assert engine.stats()["num_prefill_tokens"] == 101 + 3   # once, then one last token per copy
    assert engine.stats()["num_shared_prompts"] == 3
    reference = runner.reference(prompt(101), 3)
    assert all(tokens[f"c{index}"] == reference for index in range(4))
    assert all(len(prompt_logprobs[f"c{index}"]) == 101 for index in range(4))
    assert all(prompt_logprobs[f"c{index}"] == prompt_logprobs["c0"] for index in range(4))
    assert engine.stats()["num_used_blocks"] == 0


def test_copies_fork_without_the_prefix_cache():
    runner = FakeRunner(num_blocks=200, block_size=16)
    from servelm.config import CacheConfig
    engine = LLMEngine(EngineConfig(cache=CacheConfig(disable_radix_cache=True)), runner=runner,
                       eos_token_ids=[96], context_length=4096)
    for index in range(3):
        assert engine.add_request(f"c{index}", prompt(77), params(5), group="g") is None
    tokens = drain(engine)
    assert engine.stats()["num_prefill_tokens"] == 77 + 2
    assert all(tokens[f"c{index}"] == runner.reference(prompt(77), 5) for index in range(3))


def test_shares_split_the_step_among_heavy_groups_only():
    def request(group: str, length: int, logprobs: bool = False) -> Request:
        return Request(f"{group}-r", prompt(length), params(1, prompt_logprobs=1 if logprobs else None),
                       [96], 4096, group=group)

    def for_step(waiting: list[Request], total_work: int = 32, max_sequences: int = 16):
        return FairShares(total_work, max_sequences, clock=lambda: 0.0).for_step([], waiting)

    heavy_a, heavy_b, light = request("a", 1000), request("b", 1000, True), request("c", 50)
    assert for_step([heavy_a, heavy_b]) is None  # heavy among themselves: no bound
    assert for_step([light, request("d", 300)]) is None  # normal ones: no bound
    shares = for_step([heavy_a, heavy_b, light], max_sequences=2)
    assert shares is not None
    assert shares.take(light, 50) == 50
    assert shares.take(heavy_a, 512) == 16
    assert shares.take(heavy_b, 512) == 8  # a prompt-logprob token counts double
    assert shares.take(heavy_a, 512) == 0  # its share of the step is used
    assert shares.take(request("c", 10), 1) == 1 and shares.take(request("c", 10), 1) == 0  # 2 rows
    assert for_step([heavy_a, light], total_work=0) is None  # --fair-step-tokens 0: off


def test_the_heavy_budget_follows_the_measured_cost_of_shared_steps():
    """Light-only steps set the reference; a shared step over SHARED_STEP_RATIO times it cuts the
    heavy groups' work, a cheaper one lets it grow back, never past --fair-step-tokens nor under 1."""
    budget = StepBudget(8)
    budget.observe(0.5, 2, shared=True)
    assert budget.work == 8  # no reference yet for 2 light tokens: unchanged
    budget.observe(0.010, 2, shared=False)
    budget.observe(0.050, 2, shared=True)  # 5x a light-only step of 2 tokens
    assert budget.work == 8 * StepBudget.DECREASE
    for _ in range(20):
        budget.observe(0.050, 2, shared=True)
    assert budget.work == 1.0
    budget.observe(0.015, 2, shared=True)  # 1.5x: grows back, one token at a time
    assert budget.work == 2.0
    budget.observe(0.050, 30, shared=True)  # 30 light tokens: another size class, no reference
    assert budget.work == 2.0
    for _ in range(20):
        budget.observe(0.012, 2, shared=True)
    assert budget.work == 8


def test_heavy_groups_take_turns_when_the_budget_is_under_one_token_each():
    def request(group: str) -> Request:
        return Request(f"{group}-r", prompt(1000), params(1), [96], 4096, group=group)

    shares = FairShares(8, 16, clock=lambda: 0.0)
    shares.budget.work = 2.0
    heavy = [request(group) for group in "abcde"]
    light = request("z")
    light.prompt_token_ids = light.prompt_token_ids[:40]
    turns = []
    for _ in range(5):
        step = shares.for_step([], [*heavy, light])
        assert step is not None and step.take(light, 40) == 40
        turns.append([h.group for h in heavy if step.take(h, 512) > 0])
        shares.step_done(40)
    assert all(len(turn) == 2 for turn in turns), turns
    assert sorted(sum(turns, [])) == sorted("abcde" * 2), turns  # every group twice in 5 steps


def test_a_slow_shared_step_cuts_the_heavy_tokens_of_the_next():
    """In the engine: shared steps that cost more than twice a light-only one (here, a clock that
    charges each heavy token) shrink the heavy request's tokens per step."""
    engine, steps, _ = make_engine(step_s=0.0, fair_step_tokens=32)
    clock = engine.scheduler.fair_shares.clock
    update = engine.scheduler.update

    def charged_update(output, results):
        clock.now += 0.01 + 0.01 * sum(s.num_tokens for s in output.scheduled if s.request.request_id == "heavy")
        return update(output, results)

    engine.scheduler.update = charged_update  # type: ignore[method-assign]
    assert engine.add_request("user", prompt(16), params(40)) is None
    for _ in range(3):
        engine.step()  # light-only: the reference for 1 token is 0.01 s
    assert engine.add_request("heavy", prompt(2000, 1), params(1)) is None
    for _ in range(12):
        engine.step()
    heavy = [step.get("heavy", 0) for step in steps[3:]]
    assert heavy[0] == 32 and max(heavy[-4:]) <= 2, heavy


def test_a_heavy_prompt_after_a_light_request_runs_at_full_budget():
    """A long prompt sent right after a short one ended (within the grace) met no light work: it is
    not held to a few tokens a step (each a pass over the weights) for the grace; one that ran
    beside the short request is (test_a_normal_users_next_request_finds_the_heavy_one_at_its_share)."""
    engine, steps, runner = make_engine(step_s=LIGHT_GRACE_S / 10)
    assert engine.add_request("user", prompt(16), params(1)) is None
    engine.step()
    assert engine.add_request("heavy", prompt(1000, 1), params(1)) is None
    tokens = drain(engine)
    assert [step.get("heavy") for step in steps[1:]] == [1000]   # one step: the whole prompt
    assert tokens["heavy"] == runner.reference(prompt(1000, 1), 1)
    # a third request arriving while it runs makes it a neighbour again: held from then on
    engine, steps, _ = make_engine(step_s=LIGHT_GRACE_S / 10)
    assert engine.add_request("heavy", prompt(2000, 1), params(1, prompt_logprobs=1)) is None
    engine.step()
    assert steps[0]["heavy"] > 32
    assert engine.add_request("user", prompt(16), params(3)) is None
    engine.step()
    assert steps[1]["user"] == 16 and steps[1]["heavy"] * 2 <= 32, steps[1]
