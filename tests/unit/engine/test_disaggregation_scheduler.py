"""The scheduler's part in disaggregation, on the CPU with exact block ids: a decode request
awaiting K/V is never admitted, ``reserve_remote`` shares its cached prefix and refuses without
room, ``start_arrived`` runs it; a prefill request's blocks are parked, not freed, when it
finishes normally (and freed when aborted)."""

from __future__ import annotations

from servelm.cache.block_pool import BlockPool
from servelm.cache.radix_tree import RadixTree
from servelm.config import SchedulerConfig
from servelm.engine.request import FinishReason, Request, RequestStatus, TransferState
from servelm.engine.disaggregation import reserve_remote, start_arrived
from servelm.engine.kv_manager import KVManager
from servelm.engine.scheduler import Scheduler
from servelm.sampling.params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def make(num_blocks: int = 16) -> Scheduler:
    pool = BlockPool(num_blocks)
    return Scheduler(SchedulerConfig(), KVManager(pool, 4, RadixTree(pool, 4, "lru")))


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, PARAMS, eos_token_ids=[0], max_context_tokens=128)


def test_awaiting_request_is_skipped_then_reserved_and_admitted() -> None:
    scheduler = make()
    waiting = request("d", list(range(1, 11)))  # 10 tokens: 3 blocks
    waiting.transfer = TransferState(is_awaiting_kv=True)
    scheduler.add_request(waiting)
    assert scheduler.schedule().is_empty  # never computed here
    assert reserve_remote(scheduler, waiting, reserve_tokens=0)
    assert waiting.block_ids == [0, 1, 2] and waiting.num_computed_tokens == 0
    start_arrived(scheduler, waiting)
    assert waiting.status is RequestStatus.RUNNING and not waiting.is_awaiting_kv
    assert scheduler.running == [waiting] and not scheduler.waiting


def test_reserve_shares_the_cached_prefix_and_refuses_without_headroom() -> None:
    scheduler = make(num_blocks=6)
    prefix = list(range(1, 9))  # two full blocks
    assert scheduler.kv.prefix_cache is not None
    scheduler.kv.prefix_cache.insert(prefix, scheduler.kv.block_pool.allocate(2) or [], None)
    scheduler.kv.block_pool.release([0, 1])  # the tree holds them now
    late = request("d", prefix + [20, 21, 22])
    late.transfer = TransferState(is_awaiting_kv=True)
    scheduler.add_request(late)
    # 1 new block needed, 4 free: refused while 16 tokens (4 blocks) per request must stay free
    assert not reserve_remote(scheduler, late, reserve_tokens=16)
    assert late.block_ids == [] and scheduler.kv.block_pool.num_used_blocks == 2
    assert reserve_remote(scheduler, late, reserve_tokens=8)
    assert late.block_ids == [0, 1, 2] and late.num_computed_tokens == 8
    assert late.num_cached_tokens == 8
    scheduler.finish(late, FinishReason.ABORT)  # aborted while its K/V travels: all freed
    assert scheduler.kv.block_pool.num_used_blocks == 2  # only the tree's two blocks


def test_prefill_request_parks_its_blocks_on_a_normal_finish_only() -> None:
    scheduler = make()
    for request_id, reason in (("p", FinishReason.LENGTH), ("q", FinishReason.ABORT)):
        prefill = request(request_id, list(range(30, 39)))
        prefill.transfer = TransferState(key=f"7/{request_id}")
        scheduler.add_request(prefill)
        output = scheduler.schedule()
        assert [s.request for s in output.scheduled] == [prefill]
        prefill.num_computed_tokens = 9  # as update would after the step
        scheduler.finish(prefill, reason)
        if reason is FinishReason.LENGTH:
            assert prefill.transfer.parked_block_ids == [0, 1, 2] and prefill.block_ids == []
            assert scheduler.kv.block_pool.ref_count(2) == 1  # held for the decode server
            scheduler.kv.block_pool.release(prefill.transfer.parked_block_ids)
        else:
            assert prefill.transfer.parked_block_ids == []
    assert scheduler.kv.block_pool.ref_count(2) == 0
