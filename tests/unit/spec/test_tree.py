"""Draft trees (spec/tree.py): the nodes kept form a breadth-first, connected tree of the best
cumulative scores; the walk accepts the branch carrying the model's token at each node; the
accepted path's K/V copies; typical acceptance along a tree."""

from __future__ import annotations

import torch

from servelm.spec.tree import (Candidate, accept_tree, accepted_path_copies, path_tokens,
                               select_tree, tree_plan_parents)
from servelm.spec.typical import TypicalAcceptance


def test_select_tree_keeps_best_connected_nodes_breadth_first() -> None:
    candidates = [Candidate(10, -1, -0.1, 1), Candidate(11, -1, -2.0, 1),
                  Candidate(20, 0, -0.3, 2), Candidate(21, 0, -2.5, 2),
                  Candidate(22, 1, -2.1, 2), Candidate(23, 1, -9.0, 2),
                  Candidate(30, 2, -0.3, 3)]          # tie with its parent: parent first
    assert select_tree(candidates, 4) == ([10, 11, 20, 30], [-1, -1, 0, 2])
    assert select_tree(candidates, 2) == ([10, 20], [-1, 0])
    tokens, parents = select_tree(candidates, 7)
    assert all(parent < index for index, parent in enumerate(parents))
    assert path_tokens(tokens.index(30), tokens, parents) == [10, 20, 30]


def test_accept_tree_walks_the_models_tokens() -> None:
    drafts, parents = [5, 6, 7, 8, 9], [-1, -1, 0, 1, 1]
    # root row says 6 (second child), node 1's row says 9 (its second child), node 4's row: 3
    target = [6, 0, 9, 0, 0, 3]
    assert accept_tree(target, drafts, parents) == ([6, 9, 3], [1, 4])
    assert accept_tree([4, 0, 0, 0, 0, 0], drafts, parents) == ([4], [])
    assert accept_tree([5, 7, 0, 1, 0, 0], drafts, parents) == ([5, 7, 1], [0, 2])


def test_accepted_path_copies_move_kv_next_to_the_root() -> None:
    blocks = [3, 7, 1]                      # block size 4: positions 0-3 in block 3, 4-7 in 7, ...
    # root at position 5; drafts j at 6 + j; path drafts [1, 4] -> positions 7, 10 -> 6, 7
    assert accepted_path_copies(blocks, 4, 5, [1, 4]) == [(7 * 4 + 3, 7 * 4 + 2), (1 * 4 + 2, 7 * 4 + 3)]
    assert accepted_path_copies(blocks, 4, 5, [0, 1]) == []       # already contiguous
    assert tree_plan_parents([-1, -1, 0]) == [-1, 0, 0, 1]


def test_typical_acceptance_along_a_tree() -> None:
    rule = TypicalAcceptance(posterior_threshold=0.3, posterior_alpha=0.3)
    vocab = 8
    probs = torch.full((4, vocab), 0.01)
    probs[0, 2], probs[0, 3] = 0.1, 0.8       # root: second child (3) is plausible, first (2) not
    probs[2, 5] = 0.9                         # node 1 (token 3): its child 5 is kept
    probs[3, 6] = 0.9
    probs = probs / probs.sum(dim=-1, keepdim=True)
    drafts, parents = [2, 3, 5], [-1, -1, 1]
    sampled = [0, 0, 0, 4]
    # 2 refused, 3 kept, 5 kept (a leaf): the model's own sample of the leaf's row follows
    assert rule.accept_tree(probs, drafts, parents, sampled) == ([3, 5, 4], [1, 2])
    probs[0, 3] = 0.0
    assert rule.accept_tree(probs, drafts, parents, sampled)[0] == [int(probs[0].argmax())]
