"""Load-balancing policies: pick one healthy worker for a request.

``round_robin`` cycles through the pool; ``random`` draws uniformly; ``shortest_queue`` takes the
worker with the fewest requests in flight through this router (ties: the first added);
``cache_aware`` follows SGLang router's approximate-tree idea (servelm.router.prefix_tree):

1. If the load is unbalanced — max in flight - min in flight > ``balance_abs_threshold`` and
   max > min * ``balance_rel_threshold`` — shortest queue decides (caching loses to a hot spot).
2. Otherwise the worker whose remembered prompts share the longest prefix with this one gets it,
   if that prefix covers more than ``cache_threshold`` of the prompt; else the worker with the
   smallest tree (the most cache to spare) gets it.
3. The prompt text is then remembered for the chosen worker.
"""

from __future__ import annotations

import random
from typing import Protocol

from servelm.router.config import RouterConfig
from servelm.router.prefix_tree import PrefixTree
from servelm.router.workers import Worker


class Policy(Protocol):
    def pick(self, workers: list[Worker], text: str) -> Worker:
        """One of ``workers`` (non-empty, all healthy) for a request whose prompt is ``text``."""
        ...

    def forget(self, url: str) -> None:
        """The worker left the router."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._count = 0

    def pick(self, workers: list[Worker], text: str) -> Worker:
        worker = workers[self._count % len(workers)]
        self._count += 1
        return worker

    def forget(self, url: str) -> None:
        pass


class Random:
    def pick(self, workers: list[Worker], text: str) -> Worker:
        return random.choice(workers)

    def forget(self, url: str) -> None:
        pass


class ShortestQueue:
    def pick(self, workers: list[Worker], text: str) -> Worker:
        return min(workers, key=lambda w: w.num_in_flight)  # min keeps the first of equals

    def forget(self, url: str) -> None:
        pass


class CacheAware:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tree = PrefixTree()

    def pick(self, workers: list[Worker], text: str) -> Worker:
        loads = [w.num_in_flight for w in workers]
        if (max(loads) - min(loads) > self.config.balance_abs_threshold
                and max(loads) > min(loads) * self.config.balance_rel_threshold):
            worker = min(workers, key=lambda w: w.num_in_flight)
        else:
            worker = self._by_cache(workers, text)
        self.tree.insert(text, worker.url)
        self.tree.evict(worker.url, self.config.max_tree_size)
        return worker

    def _by_cache(self, workers: list[Worker], text: str) -> Worker:
        by_url = {w.url: w for w in workers}
        match = self.tree.match(text)
        holders = [by_url[t] for t in match.tenants if t in by_url]
        if text and holders and match.num_chars / len(text) > self.config.cache_threshold:
            return holders[0]
        return min(workers, key=lambda w: self.tree.size_chars.get(w.url, 0))

    def forget(self, url: str) -> None:
        self.tree.remove_tenant(url)


def make_policy(name: str, config: RouterConfig) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "cache_aware":
        return CacheAware(config)
    raise ValueError(f"--policy: unknown policy {name!r}")
