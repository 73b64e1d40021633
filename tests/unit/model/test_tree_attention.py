"""Tree attention (``SequencePlan.tree``): a draft tree's row attends exactly as if its root path
were computed as a chain, on both CPU attention paths (prefill_gemm tiles and SDPA), with
sliding-window layers (Gemma 3, window 8), mixed with plain sequences, and for a tree grown over
two forwards (the EAGLE head's frontier steps); ``copy_slots`` moves K/V between slots."""

from __future__ import annotations

import pytest
import torch

from servelm.model.attention import prefill_gemm
from servelm.model.forward_batch import BatchPlan, DraftTree
from tests.tiny_models import make_tiny_hf_model

from .conftest import BlockAllocator, make_runner, make_source

PROMPT = [5, 17, 42, 99, 3, 250, 8, 61, 77, 140, 12, 33]
TREE_TOKENS = [7, 120, 45, 300, 9, 64, 201]
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def path_tokens(node: int, tokens: list[int], parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def chain_logits(runner, allocator: BlockAllocator, sequence_id: int, tokens: list[int]) -> torch.Tensor:
    """Reference: the tokens computed as a plain causal chain in a fresh sequence."""
    return runner.execute(BatchPlan([allocator.plan(sequence_id, tokens, 1)]))[0]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("use_gemm", [True, False])
def test_tree_rows_equal_their_root_paths(arch: str, use_gemm: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if not use_gemm:
        monkeypatch.setattr(prefill_gemm, "supports", lambda q: False)
    runner = make_runner(make_source(make_tiny_hf_model(arch)))
    allocator = BlockAllocator(runner.num_blocks)
    runner.execute(BatchPlan([allocator.plan(0, PROMPT, 1), allocator.plan(1, PROMPT[:5], 1)]))
    tree_plan = allocator.plan(0, TREE_TOKENS, len(TREE_TOKENS))
    tree_plan.tree = DraftTree(len(PROMPT), list(TREE_PARENTS))
    # a decode and a chain beside the tree: their rows must be unaffected by it
    logits = runner.execute(BatchPlan([allocator.plan(1, [6], 1), tree_plan,
                                       allocator.plan(1, [7, 8], 2)]))
    expected_plain = chain_logits(runner, allocator, 10, PROMPT[:5] + [6, 7, 8])
    torch.testing.assert_close(logits[-1], expected_plain, atol=1e-4, rtol=1e-4)
    for node in range(len(TREE_TOKENS)):
        expected = chain_logits(runner, allocator, 100 + node,
                                PROMPT + path_tokens(node, TREE_TOKENS, TREE_PARENTS))
        torch.testing.assert_close(logits[1 + node], expected, atol=1e-4, rtol=1e-4)


def test_tree_grown_over_two_forwards() -> None:
    """The head's frontier steps: nodes written by an earlier forward are read through the mask."""
    runner = make_runner(make_source(make_tiny_hf_model("qwen2")))
    allocator = BlockAllocator(runner.num_blocks)
    runner.execute(BatchPlan([allocator.plan(0, PROMPT, 1)]))
    tokens, parents = [11, 22, 33, 44, 55, 66], [-1, -1, 0, 1, 0, 3]
    first = allocator.plan(0, tokens[:2], 2)
    first.tree = DraftTree(len(PROMPT), parents[:2])
    runner.execute(BatchPlan([first]))
    second = allocator.plan(0, tokens[2:], 4)
    second.tree = DraftTree(len(PROMPT), parents)
    logits = runner.execute(BatchPlan([second]))
    for row, node in enumerate(range(2, 6)):
        expected = chain_logits(runner, allocator, 100 + node, PROMPT + path_tokens(node, tokens, parents))
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)


def test_copy_slots_moves_an_accepted_path() -> None:
    """After verification the accepted path's K/V is copied to contiguous slots: a decode after
    it equals plain decoding of the accepted tokens."""
    runner = make_runner(make_source(make_tiny_hf_model("llama")))
    allocator = BlockAllocator(runner.num_blocks)
    runner.execute(BatchPlan([allocator.plan(0, PROMPT, 1)]))
    tree_plan = allocator.plan(0, TREE_TOKENS, len(TREE_TOKENS))
    tree_plan.tree = DraftTree(len(PROMPT), list(TREE_PARENTS))
    runner.execute(BatchPlan([tree_plan]))
    path = [0, 2, 5]  # root, node 2, node 5 accepted
    table = allocator.tables[0]

    def slot(position: int) -> int:
        return table[position // 4] * 4 + position % 4

    copies = [(slot(len(PROMPT) + node), slot(len(PROMPT) + index))
              for index, node in enumerate(path) if node != index]
    allocator.num_cached[0] = len(PROMPT) + len(path)
    plan = BatchPlan([allocator.plan(0, [13], 1)], slot_copies=copies)
    logits = runner.execute(plan)
    expected = chain_logits(runner, allocator, 7, PROMPT + [TREE_TOKENS[n] for n in path] + [13])
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
