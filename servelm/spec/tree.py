"""Draft trees (EAGLE with --speculative-eagle-topk > 1): which nodes a tree keeps, and which path
of it the model accepts.

A tree is a list of draft tokens with ``parents`` (the index of each draft's parent among the
drafts, -1: it continues the last accepted token, the root). The model scores the root and every
draft in one pass with a tree attention mask (``model.forward_batch.DraftTree``): row 0 is the
distribution after the accepted text, row j + 1 the one after the root path of draft j.

Building (SGLang's scheme, our code): the head's top-k tokens after the root are the first
frontier; each further head step expands every frontier node into its top-k children, all of which
become candidates, and keeps the ``topk`` candidates of best cumulative log-probability as the next
frontier. ``select_tree`` then keeps the ``num_nodes`` best candidates overall. A child's score is
its parent's plus a log-probability (<= 0), so ordering by (score desc, depth asc) puts every
parent before its children and the kept set is a connected tree; it is returned in breadth-first
order, so any prefix of it (the scheduler cuts drafts to its budget) is a tree too.

Verification (``accept_tree``): start at the root; take the model's token x of the current node's
row; if a child of the node carries x, accept it and continue from it, else emit x and stop. The
emitted tokens are the model's own tokens along the accepted path plus the one after it, each row
sampled as plain decoding would sample that position (same context: the path; same seeded
stream: the output length), so greedy output is token for token plain decoding, and sampling
keeps the model's distribution exactly: the drafts are fixed before the model samples (the head's
top-k, a deterministic choice), and for such point-mass candidates the multi-candidate rejection
rule (try child c with probability p(c) / q(c), q = 1, then the residual without c, ...) accepts
child c with probability exactly p(c), which is what "the model's sample equals c" does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Candidate:
    """A token the head proposed at some depth of the tree."""

    token_id: int
    parent: int
    """Index of the parent candidate (-1: the root)."""
    score: float
    """Cumulative log-probability of the path root -> this token under the head."""
    depth: int
    """1 for a child of the root."""


def select_tree(candidates: list[Candidate], num_nodes: int) -> tuple[list[int], list[int]]:
    """The ``num_nodes`` best candidates as (token ids, parents) in breadth-first order; parents
    index the returned drafts (-1: the root)."""
    order = sorted(range(len(candidates)),
                   key=lambda i: (-candidates[i].score, candidates[i].depth, i))
    kept: set[int] = set()
    for index in order:
        if len(kept) == num_nodes:
            break
        parent = candidates[index].parent
        if parent < 0 or parent in kept:
            kept.add(index)
    rank = {index: position for position, index in enumerate(order)}
    nodes = sorted(kept, key=lambda i: (candidates[i].depth, rank[i]))
    new_index = {old: new for new, old in enumerate(nodes)}
    parents = [new_index[candidates[i].parent] if candidates[i].parent >= 0 else -1 for i in nodes]
    return [candidates[i].token_id for i in nodes], parents


def path_to(node: int, parents: list[int]) -> list[int]:
    """Draft indices root-exclusive from the root's first child down to ``node`` (-1: [])."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def path_tokens(node: int, draft_token_ids: list[int], parents: list[int]) -> list[int]:
    """The draft tokens on the root path of draft ``node`` (-1, the root: none)."""
    return [draft_token_ids[index] for index in path_to(node, parents)]


def children(parents: list[int]) -> dict[int, list[int]]:
    """Node (-1: the root) -> its child drafts, in draft order."""
    found: dict[int, list[int]] = {}
    for index, parent in enumerate(parents):
        found.setdefault(parent, []).append(index)
    return found


def accept_tree(target_token_ids: list[int], draft_token_ids: list[int],
                parents: list[int]) -> tuple[list[int], list[int]]:
    """(emitted tokens, accepted draft indices) for the model's token of each row
    (``target_token_ids[0]``: the root's row, ``[j + 1]``: draft j's row)."""
    assert len(target_token_ids) == len(draft_token_ids) + 1, "one row per node and the root"
    by_parent = children(parents)
    node, accepted = -1, []
    while True:
        token_id = target_token_ids[node + 1]
        child = next((c for c in by_parent.get(node, []) if draft_token_ids[c] == token_id), None)
        if child is None:
            return [draft_token_ids[index] for index in accepted] + [token_id], accepted
        accepted.append(child)
        node = child


def accepted_path_copies(block_ids: list[int], block_size: int, root_position: int,
                         accepted: list[int]) -> list[tuple[int, int]]:
    """(source, destination) K/V slots that move the accepted drafts (indices, in path order)
    from their tree positions (draft j at ``root_position + 1 + j``) to the sequence's contiguous
    positions after the root. A path's indices increase, so ``accepted[i] >= i`` and no copy
    overwrites a later one's source."""
    def slot(position: int) -> int:
        return block_ids[position // block_size] * block_size + position % block_size

    return [(slot(root_position + 1 + node), slot(root_position + 1 + index))
            for index, node in enumerate(accepted) if node != index]


def tree_plan_parents(parents: list[int]) -> list[int]:
    """The verify pass's node parents: node 0 is the root (the last accepted token), draft j is
    node j + 1 (``model.forward_batch.DraftTree``)."""
    return [-1] + [parent + 1 for parent in parents]
