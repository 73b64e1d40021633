"""Scheduling policies order a queue as documented in engine/policy.py (on a fixed tree), and the
scheduler honours priorities, the queue limit, conservativeness and admission waits."""

from __future__ import annotations

import random

from servelm.cache.block_pool import BlockPool
from servelm.cache.radix_tree import RadixTree
from servelm.config import EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.policy import order_waiting
from servelm.engine.request import Request
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner
from .test_engine_core import EOS, greedy, make_engine, run_all

BS = 2
A = [1, 1, 2, 2, 3, 3]  # branch A: 3 blocks cached
B = [5, 5, 6, 6]        # branch B: 2 blocks cached


def fixed_tree() -> RadixTree:
    pool = BlockPool(32)
    tree = RadixTree(pool, BS)
    for tokens in (A, B):
        blocks = pool.allocate(len(tokens) // BS)
        assert blocks is not None
        tree.insert(tokens, blocks)
        pool.release(blocks)
    return tree


def request(name: str, prompt: list[int], priority: int = 0) -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=4), [EOS], 512, priority=priority)


def queue() -> list[Request]:
    return [
        request("none", [9, 9, 9, 9, 9]),       # no cached prefix
        request("b1", B + [7]),                 # 4 cached
        request("a1", A[:2] + [8, 8, 8]),       # 2 cached (branch A, first block only)
        request("a3", A + [4, 4, 4]),           # 6 cached
        request("b2", B + [8, 8]),              # 4 cached
        request("a2", A[:4] + [0, 0, 1]),       # 4 cached
    ]


def names(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def order(policy: str, tree: RadixTree | None = None, **config) -> list[str]:
    scheduler_config = SchedulerConfig(schedule_policy=policy, **config)
    return names(order_waiting(queue(), scheduler_config, tree or fixed_tree(), random.Random(0)))


def test_fcfs_keeps_queue_order() -> None:
    assert order("fcfs") == ["none", "b1", "a1", "a3", "b2", "a2"]


def test_lpm_longest_cached_prefix_first_ties_in_queue_order() -> None:
    assert order("lpm") == ["a3", "b1", "b2", "a2", "a1", "none"]


def test_dfs_weight_heaviest_branch_first_then_deeper_nodes() -> None:
    # Branch A holds 3 waiting requests, B 2, the root 1 (no match). The walk visits A first and
    # emits each node's subtree before its own requests: a3 (deepest), a2, a1; then B; then root.
    tree = fixed_tree()
    # Before any split, branch A is one node: its three requests share it, in queue order.
    assert order("dfs-weight", tree) == ["a1", "a3", "a2", "b1", "b2", "none"]
    for r in queue():  # admission-time lookups split A where the prompts diverge
        tree.match_prefix(r.prompt_token_ids[:-1])
    assert order("dfs-weight", tree) == ["a3", "a2", "a1", "b1", "b2", "none"]


def test_random_is_a_seeded_permutation() -> None:
    shuffled = order("random")
    assert sorted(shuffled) == sorted(order("fcfs")) and shuffled == order("random")


def test_priority_first_then_policy_order() -> None:
    requests = queue()
    requests[0].priority = 5
    requests[4].priority = 5
    config = SchedulerConfig(schedule_policy="lpm", enable_priority_scheduling=True)
    assert names(order_waiting(requests, config, fixed_tree(), random.Random(0))) == [
        "b2", "none", "a3", "b1", "a2", "a1"]
    low_first = SchedulerConfig(schedule_policy="fcfs", scheduling_policy="priority")
    assert names(order_waiting(requests, low_first, None, random.Random(0))) == [
        "b1", "a1", "a3", "a2", "none", "b2"]


def make(num_blocks: int = 64, **scheduler) -> tuple[LLMEngine, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=4)
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler))
    return LLMEngine(config, runner=runner, eos_token_ids=[EOS], context_length=512), runner


def test_urgent_request_preempts_beyond_the_threshold_only() -> None:
    engine, runner = make(max_running_requests=1, enable_priority_scheduling=True,
                          priority_scheduling_preemption_threshold=3)
    engine.add_request("low", [1, 2, 3], greedy(30), priority=0)
    engine.step()
    engine.add_request("near", [4, 5, 6], greedy(2), priority=3)   # not more than 3 better
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["low"]
    engine.add_request("urgent", [7, 8, 9], greedy(2), priority=10)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["urgent"]
    tokens: dict[str, list[int]] = {"low": [], "near": [], "urgent": []}
    done: list[str] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.is_finished:
                done.append(output.request_id)
    assert done == ["urgent", "near", "low"]
    assert engine.scheduler.num_preemptions == 1
    # The preempted request was taken out of the step it had been planned in, and resumed exactly.
    assert tokens["low"] == runner.reference([1, 2, 3], 30)[2:]  # 2 came from the first steps
    assert tokens["urgent"] == runner.reference([7, 8, 9], 2)[1:]


def test_queue_limit_refuses_with_503() -> None:
    engine, _ = make(max_queued_requests=2)
    for name in ("a", "b"):
        assert engine.add_request(name, [1, 2], greedy(2)) is None
    refused = engine.add_request("c", [1, 2], greedy(2))
    assert refused is not None and refused.error_status == 503
    assert "--max-queued-requests" in (refused.error or "")
    too_big = engine.add_request("d", [1] * 10, greedy(300))
    assert too_big is None or too_big.error_status in (400, 503)


def test_conservative_admission_avoids_preemption() -> None:
    requests = {f"r{i}": ([i + 1] * 6, greedy(20)) for i in range(6)}
    counts = {}
    for conservativeness in (0.0, 1.0):
        engine, runner = make(num_blocks=16, schedule_conservativeness=conservativeness)
        tokens, _, _ = run_all(engine, requests)
        for name, (prompt, _) in requests.items():
            assert tokens[name] == runner.reference(prompt, 20)
        counts[conservativeness] = engine.scheduler.num_preemptions
    assert counts[0.0] > 0 and counts[1.0] == 0
    engine, _ = make(num_blocks=16, router_token_ratio=0.01)  # always busy: fully conservative
    run_all(engine, requests)
    assert engine.scheduler.num_preemptions == 0


def test_router_max_wait_tokens_batches_admissions() -> None:
    engine, _ = make(router_max_wait_tokens=3)
    engine.add_request("a", [1, 2, 3], greedy(20))
    engine.step()                                   # nothing running: admitted at once
    engine.add_request("b", [4, 5, 6], greedy(2))
    engine.step()
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"]
    engine.step()                                   # the third step admits
    assert not engine.scheduler.waiting


def test_groups_take_turns_in_admission() -> None:
    def member(name: str, group: str) -> Request:
        return Request(name, [1, 2, 3], SamplingParams(max_tokens=4), [EOS], 512, group=group)

    waiting = [member(f"big{i}", "big") for i in range(4)] + [member("u1", "u"), member("u2", "u"),
                                                               member("solo", "")]
    ordered = names(order_waiting(waiting, SchedulerConfig(), None, random.Random(0)))
    assert ordered == ["big0", "u1", "solo", "big1", "u2", "big2", "big3"]


def test_a_big_batch_does_not_starve_another_user() -> None:
    """100 sequences of one client request are queued first; a later single request is admitted
    at the next free slot, not after the whole batch (as it was with plain FCFS)."""
    engine, _ = make_engine(num_blocks=256, block_size=4, max_running_requests=4)
    for index in range(100):
        prompt = [10 + index % 50, 11, 12, 13, 14]
        assert engine.add_request(f"big-{index}", prompt, greedy(6), group="big") is None
    for _ in range(3):
        engine.step()
    assert engine.add_request("user", [7, 8, 9], greedy(6)) is None
    num_big_finished = 0
    while True:
        outputs = engine.step()
        if any(o.request_id == "user" and o.is_finished for o in outputs):
            break
        num_big_finished += sum(o.is_finished for o in outputs if o.request_id.startswith("big"))
    assert num_big_finished <= 8, num_big_finished  # about one round of the running slots
    while engine.has_unfinished():
        engine.step()


def test_a_group_takes_at_most_its_share_while_others_have_work() -> None:
    engine, _ = make_engine(num_blocks=256, block_size=4, max_running_requests=8)
    for index in range(40):
        assert engine.add_request(f"big-{index}", [20 + index, 11, 12], greedy(4), group="big") is None
    engine.step()
    assert len(engine.scheduler.running) == 8  # alone, the batch may use every slot
    assert engine.add_request("user", [7, 8, 9], greedy(12)) is None
    num_checked = 0
    for _ in range(30):
        before = {r.request_id for r in engine.scheduler.running}
        engine.step()
        running = engine.scheduler.running
        is_new_big = any(r.request_id not in before and r.group == "big" for r in running)
        if is_new_big and any(r.group == "user" for r in running):
            assert sum(r.group == "big" for r in running) <= 2  # 8 slots x GROUP_SHARE
            num_checked += 1
    assert num_checked > 0  # big sequences were admitted beside the user, within the share
    while engine.has_unfinished():
        engine.step()
