"""An approximate prefix tree of request text per worker, for cache-aware routing.

The router cannot see the workers' KV caches, so it remembers which worker it sent which prompt
text to (SGLang router's idea): a worker that recently got a prompt sharing a long prefix with this
one probably still holds that prefix in its radix cache.

Invariants:
- One radix tree over characters shared by all workers ("tenants"); each node's edge label is a
  non-empty string (the root's is empty) and its children start with distinct characters.
- A tenant is on a node only if it is on the node's parent (text is inserted along a whole path),
  so the tenants on the deepest node a lookup reaches are those with the longest match.
- ``size_chars[t]`` is the sum of the edge lengths of the nodes tenant t is on; eviction removes t
  from its least recently used leaves until the size fits, and a node with no tenant is deleted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    text: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)
    last_used: dict[str, float] = field(default_factory=dict)
    """Tenant -> monotonic time it last inserted or matched through this node."""


@dataclass(frozen=True)
class Match:
    """A lookup's result: how many characters matched and which tenants hold that prefix."""

    num_chars: int
    tenants: tuple[str, ...]
    """Most recently used first; empty when nothing matched."""


class PrefixTree:
    """Prompt text -> the workers that saw its longest prefix."""

    def __init__(self) -> None:
        self._root = _Node("", None)
        self.size_chars: dict[str, int] = {}
        self._clock = itertools.count()

    def match(self, text: str) -> Match:
        """The longest prefix of ``text`` any tenant holds, and those tenants."""
        node, matched = self._root, 0
        deepest, deepest_chars = self._root, 0
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            common = _common_prefix(child.text, text[matched:])
            matched += common
            deepest, deepest_chars = child, matched
            if common < len(child.text):
                break
            node = child
        if deepest is self._root:
            return Match(0, ())
        tenants = sorted(deepest.last_used, key=deepest.last_used.__getitem__, reverse=True)
        return Match(deepest_chars, tuple(tenants))

    def insert(self, text: str, tenant: str) -> None:
        """Remember that ``tenant`` got ``text`` (marks the whole path as just used)."""
        now = time.monotonic() + next(self._clock) * 1e-9  # strictly increasing
        self.size_chars.setdefault(tenant, 0)
        node, position = self._root, 0
        node.last_used[tenant] = now
        while position < len(text):
            child = node.children.get(text[position])
            if child is None:
                child = _Node(text[position:], node)
                node.children[text[position]] = child
            else:
                common = _common_prefix(child.text, text[position:])
                if common < len(child.text):
                    child = self._split(child, common)
            if tenant not in child.last_used:
                self.size_chars[tenant] += len(child.text)
            child.last_used[tenant] = now
            position += len(child.text)
            node = child

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything about ``tenant`` (a worker removed from the router)."""
        self.evict(tenant, 0)
        self.size_chars.pop(tenant, None)
        self._root.last_used.pop(tenant, None)

    def evict(self, tenant: str, max_chars: int) -> None:
        """Drop ``tenant``'s least recently used leaves until it holds at most ``max_chars``."""
        if self.size_chars.get(tenant, 0) <= max_chars:
            return
        heap = [(node.last_used[tenant], id(node), node) for node in self._tenant_leaves(tenant)]
        heapq.heapify(heap)
        while heap and self.size_chars[tenant] > max_chars:
            _, _, node = heapq.heappop(heap)
            del node.last_used[tenant]
            self.size_chars[tenant] -= len(node.text)
            parent = node.parent
            if not node.last_used and parent is not None:
                del parent.children[node.text[0]]
            if parent is not None and parent is not self._root and self._is_tenant_leaf(parent, tenant):
                heapq.heappush(heap, (parent.last_used[tenant], id(parent), parent))

    def _tenant_leaves(self, tenant: str) -> list[_Node]:
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            holders = [c for c in node.children.values() if tenant in c.last_used]
            if node is not self._root and not holders:
                leaves.append(node)
            stack.extend(holders)
        return leaves

    @staticmethod
    def _is_tenant_leaf(node: _Node, tenant: str) -> bool:
        return tenant in node.last_used and not any(
            tenant in child.last_used for child in node.children.values())

    @staticmethod
    def _split(node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` characters; the new upper node is returned."""
        assert node.parent is not None and 0 < at < len(node.text)
        upper = _Node(node.text[:at], node.parent, last_used=dict(node.last_used))
        node.parent.children[upper.text[0]] = upper
        node.text = node.text[at:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index
