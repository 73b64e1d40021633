"""DraftModelProposer's bookkeeping with a scripted runner: what each forward computes (the
catch-up after a rollback starts where the cached prefix still agrees), the blocks it holds,
releases and lacks, and the draft distributions of sampling requests."""

from __future__ import annotations

import torch

from servelm.cache.block_pool import BlockPool
from servelm.spec.draft_model import DraftModelProposer, DraftSequence
from servelm.spec.proposer import DraftRequest

VOCAB = 16


class CountingRunner:
    """Logits favour (last token + 1) % VOCAB; records every forward's sequences."""

    block_size = 4

    def __init__(self) -> None:
        self.calls: list[list[tuple[list[int], int]]] = []

    def forward_last(self, sequences: list[DraftSequence]) -> torch.Tensor:
        self.calls.append([(list(s.token_ids), s.start_position) for s in sequences])
        logits = torch.zeros(len(sequences), VOCAB)
        for row, sequence in enumerate(sequences):
            assert len(sequence.block_ids) * self.block_size >= sequence.start_position + len(sequence.token_ids)
            logits[row, (sequence.token_ids[-1] + 1) % VOCAB] = 5.0
        return logits


def request(output: list[int], k: int = 3, temperature: float = 0.0) -> DraftRequest:
    return DraftRequest("a", [1, 2, 3, 4, 5], output, k, temperature=temperature, seed=3)


def test_chain_rollback_and_release() -> None:
    runner, pool = CountingRunner(), BlockPool(8)
    proposer = DraftModelProposer(runner, pool, seed=0)
    [draft] = proposer.propose([request([6])])
    assert draft.token_ids == [7, 8, 9] and draft.probs is None
    # catch-up over the 6 tokens, then drafts 7 and 8 at positions 6 and 7 (9 is never fed)
    assert runner.calls == [[([1, 2, 3, 4, 5, 6], 0)], [([7], 6)], [([8], 7)]]
    assert proposer.num_held_blocks == 2   # 8 positions written
    # The model kept 7 and then said 0 (8 rejected): the cached 1..7 holds, 8 is rolled back.
    runner.calls.clear()
    [draft] = proposer.propose([request([6, 7, 0])])
    assert runner.calls[0] == [([0], 7)]
    assert draft.token_ids == [1, 2, 3]
    proposer.release("a")
    assert pool.num_free_blocks == 8 and proposer.held_request_ids() == set()


def test_short_pool_gives_no_draft() -> None:
    proposer = DraftModelProposer(CountingRunner(), BlockPool(1), seed=0)
    [draft] = proposer.propose([request([6])])
    assert draft.token_ids == [] and proposer.num_pool_misses == 1


def test_sampling_requests_return_their_distributions() -> None:
    proposer = DraftModelProposer(CountingRunner(), BlockPool(8), seed=0)
    [draft] = proposer.propose([request([6], temperature=1.0)])
    assert draft.probs is not None and draft.probs.shape == (3, VOCAB)
    assert torch.allclose(draft.probs.sum(dim=-1), torch.ones(3))
    again = DraftModelProposer(CountingRunner(), BlockPool(8), seed=1).propose([request([6], temperature=1.0)])
    assert again[0].token_ids == draft.token_ids   # seeded request: the same draws


def test_long_catch_up_is_spread_over_steps_within_the_budget() -> None:
    """A 14-token first catch-up with --chunked-prefill-size 4 and --max-prefill-tokens 5: chunks
    of 4, 4, 4 and 2 tokens in four steps, no draft until the last (the request decodes normally
    meanwhile), then the usual chain. A request already drafting (one token to catch up) is
    computed first in every step and keeps drafting."""
    runner, pool = CountingRunner(), BlockPool(16)
    proposer = DraftModelProposer(runner, pool, seed=0, max_catch_up_tokens=4, max_forward_tokens=5)
    assert proposer.propose([DraftRequest("s", [9, 10], [11], 2)])[0].token_ids == [12, 13]
    chunks, drafts = [], []
    for step in range(4):
        runner.calls.clear()
        long = DraftRequest("l", list(range(1, 14)), [14], 3)
        short = DraftRequest("s", [9, 10], [11, 12, 1 + step], 2)
        draft_long, draft_short = proposer.propose([long, short])
        assert draft_short.token_ids == [2 + step, 3 + step]
        catch_up = runner.calls[0]
        assert catch_up[1] == ([1 + step], 4)                    # the short request's token
        assert sum(len(tokens) for tokens, _ in catch_up) <= 5
        assert all(len(tokens) <= 4 for call in runner.calls for tokens, _ in call)
        chunks.append(catch_up[0])
        drafts.append(draft_long.token_ids)
    assert chunks == [([1, 2, 3, 4], 0), ([5, 6, 7, 8], 4), ([9, 10, 11, 12], 8), ([13, 14], 12)]
    assert drafts == [[], [], [], [15, 0, 1]]
    assert proposer.num_held_blocks == 4 + 2   # "l": 16 positions written, blocks of 4; "s": 6
