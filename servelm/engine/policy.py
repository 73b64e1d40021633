"""Scheduling policies: the order in which waiting requests are considered for admission.

The scheduler admits waiting requests in the order ``order_waiting`` returns, stopping at the
first one that does not fit, so the order decides who runs first under load.

- fcfs: queue order (arrival; a preempted request is re-queued at the front).
- lpm: longest cached prefix first, so cache hits are used before other work evicts them. Ties
  keep queue order. Beyond ``LPM_MAX_QUEUE`` waiting requests it falls back to fcfs (each
  match is a tree walk).
- dfs-weight: walk the prefix tree depth first, visiting the branch with the most waiting
  requests first. Each request belongs to the deepest cached node it reaches and is emitted after
  that node's subtree (deeper matches first). Requests sharing a prefix therefore run back to
  back while that prefix is cached.
- random: a shuffle (seeded by the scheduler, so runs are reproducible).

Fairness between client requests comes next: the requests of one client request (its prompts
times n, sharing ``Request.group``) are taken in turn with other groups' (a stable sort by rank
within the group), so a 100-prompt x n=128 batch admits one sequence per turn, like any other
user's request, instead of all of its sequences first.

Priority scheduling is a stable sort on top: more urgent first, the fair order within a
priority. Urgent means larger ``priority`` values unless low values come first (vLLM).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from servelm.cache.radix_tree import RadixTree
from servelm.config import SchedulerConfig
from servelm.engine.request import Request

POLICIES = ("fcfs", "lpm", "dfs-weight", "random")
LPM_MAX_QUEUE = 128


def cache_key(request: Request) -> list[int]:
    """The tokens looked up in the prefix cache: all but the last, whose logits must be computed
    (image placeholders keyed by their image's digest: ``Request.cache_slice``)."""
    return request.cache_slice(0, request.num_tokens - 1)


def urgency(request: Request, low_values_first: bool) -> int:
    """Sort key: smaller runs first."""
    return request.priority if low_values_first else -request.priority


def order_waiting(waiting: Sequence[Request], config: SchedulerConfig, tree: RadixTree | None,
                  rng: random.Random) -> list[Request]:
    ordered = _take_groups_in_turn(_order_by_policy(list(waiting), config.schedule_policy, tree, rng))
    if config.is_priority_scheduling:
        low_first = config.is_low_priority_value_first
        ordered.sort(key=lambda r: urgency(r, low_first))  # stable: policy order within a priority
    return ordered


def _take_groups_in_turn(ordered: list[Request]) -> list[Request]:
    """Round-robin over groups: each request's rank within its group is its turn."""
    if len(ordered) <= 1:
        return ordered
    first_group = ordered[0].group
    if all(request.group == first_group for request in ordered):
        return ordered
    rank: dict[int, int] = {}
    seen: dict[str, int] = {}
    for request in ordered:
        turn = seen.get(request.group, 0)
        seen[request.group] = turn + 1
        rank[id(request)] = turn
    return sorted(ordered, key=lambda request: rank[id(request)])


def _order_by_policy(waiting: list[Request], policy: str, tree: RadixTree | None,
                     rng: random.Random) -> list[Request]:
    assert policy in POLICIES, policy
    if policy == "random":
        rng.shuffle(waiting)
        return waiting
    if tree is None or policy == "fcfs" or len(waiting) <= 1:
        return waiting
    if policy == "lpm":
        if len(waiting) > LPM_MAX_QUEUE:
            return waiting
        lengths = {id(r): tree.match_length(cache_key(r), r.adapter_id) for r in waiting}
        return sorted(waiting, key=lambda r: -lengths[id(r)])
    return _dfs_weight(waiting, tree)


def _dfs_weight(waiting: list[Request], tree: RadixTree) -> list[Request]:
    # Attach each request to the deepest cached node on its path, then weigh every node by the
    # requests in its subtree; the walk takes heavier children first (ties: first seen first).
    attached: dict[int, list[Request]] = {}
    paths: dict[int, list[object]] = {}
    weight: dict[int, int] = {}
    children: dict[int, list[object]] = {}
    order_seen: dict[int, int] = {}
    roots: list[object] = []
    for request in waiting:
        path = tree.path(cache_key(request), request.adapter_id)
        attached.setdefault(id(path[-1]), []).append(request)
        paths[id(request)] = path
        for depth, node in enumerate(path):
            key = id(node)
            if key not in weight:
                weight[key] = 0
                order_seen[key] = len(order_seen)
                children[key] = []
                if depth == 0:
                    roots.append(node)
                else:
                    children[id(path[depth - 1])].append(node)
            weight[key] += 1
    def heaviest_last(nodes: list[object]) -> list[object]:
        return sorted(nodes, key=lambda n: (weight[id(n)], -order_seen[id(n)]))

    result: list[Request] = []
    stack: list[tuple[object, bool]] = [(n, False) for n in heaviest_last(roots)]
    while stack:  # post-order: a node's subtree (heaviest child first), then its own requests
        node, is_expanded = stack.pop()
        if is_expanded:
            result.extend(attached.get(id(node), []))
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in heaviest_last(children[id(node)]))
    return result
