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
import time
from collections.abc import Callable, Sequence

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


# -- fair shares within a step -------------------------------------------------------------

LOGITS_ROW_WORK = 1.0
"""Extra work of a prompt token whose logprobs are asked for: a vocabulary-wide logits row
(the LM head, a log-softmax and a top-k) on top of the token's pass through the layers."""
ATTENTION_SPAN = 4096
"""Context length at which a token's attention costs about as much as its pass through the
layers' weights (6 x hidden size for a dense decoder; 3,456 for SmolLM2-135M, 5,376 for
Qwen2.5-0.5B): a chunk deep in a long context costs more per token."""


def prefill_work(request: Request, num_tokens: int) -> float:
    """Work per token of computing ``request``'s next ``num_tokens`` tokens (1 for a plain prompt
    token at the start of its context)."""
    weight = 1.0 + request.num_computed_tokens / ATTENTION_SPAN
    if request.wants_prompt_logprobs:
        weight += LOGITS_ROW_WORK
    return weight


def is_admittable(request: Request) -> bool:
    """A waiting request nothing holds back (a stage, its grammar, its K/V, its beam search)."""
    return (request.held_by is None and not request.is_compiling
            and not request.is_awaiting_kv)


HEAVY_PROMPT_WORK = 512
"""A group with more prompt work than this left (``prefill_work`` units: a prompt over one
default chunk, fewer tokens with echo logprobs or deep in a long context) is heavy."""
HEAVY_SEQUENCES = 4
"""A group computing more sequences than this at once (n copies, beams, a prompt list) is heavy."""


class GroupShares:
    """One step's fair shares while a heavy group and a light one both have work
    (--fair-step-tokens). Every user waits for each step, and a step's time grows with its tokens,
    so the heavy groups together compute at most ``total_work`` per step, in equal shares: prompt
    tokens weighted by ``prefill_work``, a decode row one unit; and every group at most
    ``max_sequences`` sequences (a group of n copies, a wide beam or a prompt list counts as one
    user). Light groups (a normal prompt, a few sequences) compute what they need, as before. So
    a normal user's inter-token time and time to first token stay within a small multiple of
    what they are alone, whatever heavy requests run beside it, and each heavy one moves at its
    share (at least one token of one sequence per step)."""

    def __init__(self, heavy: set[str], total_work: float, max_sequences: int,
                 turn: Sequence[str] | None = None) -> None:
        self.max_sequences = max_sequences
        served = list(turn) if turn is not None else sorted(heavy)
        self.work_left: dict[str, float] = {group: 0.0 for group in heavy}
        """Heavy group -> work it may still compute this step (light groups: no bound)."""
        self.work_left.update({group: total_work / len(served) for group in served})
        self._sequences: dict[str, int] = {}
        self._has_moved: set[str] = set(heavy) - set(served)
        """Groups that moved this step, or may not (not their turn): no minimum token for them."""
        self.light_tokens = 0
        """Tokens the light groups took this step (the controller's reference is a step of as many)."""

    def take(self, request: Request, num_tokens: int) -> int:
        """How many of ``num_tokens`` the request may compute this step (0: its group has had
        its share of this step); records them."""
        group = request.group
        if self._sequences.get(group, 0) >= self.max_sequences:
            return 0
        left = self.work_left.get(group)
        if left is not None:
            weight = prefill_work(request, num_tokens) if num_tokens > 1 else 1.0
            granted = min(num_tokens, int(left / weight))
            if granted <= 0 and group not in self._has_moved:
                granted = 1  # a share smaller than one token still moves the group on
            if granted <= 0:
                return 0
            num_tokens = granted
            self.work_left[group] = left - granted * weight
            self._has_moved.add(group)
        else:
            self.light_tokens += num_tokens
        self._sequences[group] = self._sequences.get(group, 0) + 1
        return num_tokens


SHARED_STEP_RATIO = 2.0
"""What a shared step may cost against a step of only the light groups' tokens. The heavy groups'
tokens per step follow it (``StepBudget``): what a token costs differs by CPU, model, context depth
and kernel (a few decode rows cost about one on a memory-bound machine, several times one where the
GEMM is compute-bound at few rows, as AVX2's int16 block kernel is), so it is measured, not assumed."""


class StepBudget:
    """The heavy groups' work per shared step, adapted to the measured cost of shared steps: an
    additive increase while a shared step costs under ``SHARED_STEP_RATIO`` times a light-only step
    of as many light tokens (the reference: a running mean per power-of-two token count), a
    multiplicative decrease above it; between 1 and the configured --fair-step-tokens. Without a
    reference yet (no light-only step seen at that size) it stays where it is."""

    DECREASE = 0.7
    INCREASE = 1.0
    MEAN_WEIGHT = 0.2
    """Weight of a new light-only step in its running mean."""

    def __init__(self, most: float) -> None:
        self.most = most
        self.work = most
        self.light_step_s: dict[int, float] = {}
        """Power-of-two token count -> running mean of a light-only step's seconds."""

    @staticmethod
    def size_class(tokens: int) -> int:
        return 1 << max(0, tokens - 1).bit_length()

    def observe(self, seconds: float, light_tokens: int, shared: bool) -> None:
        """One finished step: its seconds, the light groups' tokens in it, whether heavy groups
        were held to shares in it."""
        if seconds <= 0 or light_tokens <= 0:
            return
        size = self.size_class(light_tokens)
        if not shared:
            mean = self.light_step_s.get(size)
            self.light_step_s[size] = seconds if mean is None else mean + self.MEAN_WEIGHT * (seconds - mean)
            return
        reference = self.light_step_s.get(size)
        if reference is None:
            return
        if seconds > SHARED_STEP_RATIO * reference:
            self.work = max(1.0, self.work * self.DECREASE)
        else:
            self.work = min(self.most, self.work + self.INCREASE)


LIGHT_GRACE_S = 1.0
"""How long after a light group's last work ended (the end of the last step that computed for it)
the heavy groups keep to their shares. A normal user's next request follows its last one within a
round trip; without this, every such gap let the heavy groups take a full-budget step (several
512-token chunks with prompt logprobs: seconds on two cores) that the user's next request then
waited for. Counted from the step's end, not its start: a shared step slower than the grace (a
loaded machine, a deep context) must not end the grace by itself."""


def group_weights(running: Sequence[Request], waiting: Sequence[Request]) -> tuple[set[str], set[str]]:
    """The heavy and the light groups among those with work."""
    needs: dict[str, float] = {}
    sequences: dict[str, int] = {}
    for requests, is_waiting in ((running, False), (waiting, True)):
        for request in requests:
            if is_waiting and not is_admittable(request):
                continue
            gap = request.num_tokens - request.num_computed_tokens
            if gap <= 0:
                continue
            group = request.group
            sequences[group] = sequences.get(group, 0) + 1
            needs[group] = needs.get(group, 0.0) + (gap * prefill_work(request, gap) if gap > 1 else 0.0)
    heavy = {group for group, count in sequences.items()
             if count > HEAVY_SEQUENCES or needs[group] > HEAVY_PROMPT_WORK}
    return heavy, set(sequences) - heavy


class FairShares:
    """--fair-step-tokens over time: each step's ``GroupShares``, kept for ``LIGHT_GRACE_S`` after
    another group's last light work (``clock``: seconds, monotonic). The heavy groups' work per
    step follows the measured cost of shared steps (``StepBudget``, at most ``total_work``); when
    it is less than one token per heavy group, the heavy groups take their turns (a few per step,
    in rotation), so a deep context is read for a larger share every few steps rather than for a
    token or two every step."""

    def __init__(self, total_work: int, max_sequences: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_work = total_work
        self.max_sequences = max_sequences
        self.clock = clock
        self.budget = StepBudget(total_work)
        self._turn = 0
        """Where the next step's turn starts in the sorted heavy groups."""
        self._step: tuple[float, GroupShares | None] | None = None
        """The step in progress: when its schedule began, and its shares (None: light work only)."""
        self._light_seen_s: dict[str, float] = {}
        """Light group -> when its last work ended (within the grace)."""
        self._light_last_step: set[str] = set()
        """The light groups with work in the previous step: busy until that step ended (now)."""
        self._heavy: set[str] = set()
        """Groups found heavy that still have work: they stay heavy to their last token, or the
        step in which their work left falls under the thresholds would compute all of it at once
        (up to a whole chunk with prompt logprobs: the long step a normal user waited for)."""
        self._met_light: set[str] = set()
        """Heavy groups that have had work in a step where a light group had work too. Only they
        are held to shares during the grace: the grace keeps a light user's next request from
        waiting on a heavy request that ran beside its last one. A heavy request that arrives after
        the light work ended (a long prompt sent right after a short one) met nobody: held to a few
        tokens a step, it paid a pass over the weights per few tokens for up to ``LIGHT_GRACE_S``
        (+0.7 to 1 s on a 1,019-token prompt's first token, Qwen2.5-Coder-0.5B, 2 cores)."""

    def for_step(self, running: Sequence[Request], waiting: Sequence[Request]) -> GroupShares | None:
        """The step's shares; None while fairness is off (``total_work`` 0), without a heavy group,
        when no other group has had light work for ``LIGHT_GRACE_S`` (heavy requests among
        themselves, or a burst of normal ones, are computed at the full step budget as before), or
        when no heavy group has had work beside light work (it came after the light work ended)."""
        if self.total_work <= 0:
            return None
        heavy, light = group_weights(running, waiting)
        heavy |= self._heavy & light
        light -= heavy
        self._heavy = heavy
        now = self.clock()
        self._light_seen_s.update(dict.fromkeys(self._light_last_step, now))
        self._light_seen_s = {group: seen for group, seen in self._light_seen_s.items()
                              if now - seen <= LIGHT_GRACE_S and group not in heavy}
        self._light_seen_s.update(dict.fromkeys(light, now))
        self._light_last_step = light
        self._met_light = set(heavy) if light else self._met_light & heavy
        if not heavy:
            self._step = (now, None) if light else None
            return None
        if not self._light_seen_s or not self._met_light:
            self._step = None
            return None
        ordered = sorted(heavy)
        served = min(len(ordered), max(1, int(self.budget.work)))
        start = self._turn % len(ordered)
        self._turn = start + served
        shares = GroupShares(heavy, self.budget.work, self.max_sequences,
                             turn=[ordered[(start + i) % len(ordered)] for i in range(served)])
        self._step = (now, shares)
        return shares

    def step_done(self, num_tokens: int) -> None:
        """The step scheduled by the last ``for_step`` ended (``num_tokens``: all it computed): its
        time goes to the budget's reference (light work only) or to its control (shared)."""
        if self._step is None:
            return
        started, shares = self._step
        self._step = None
        light_tokens = num_tokens if shares is None else shares.light_tokens
        self.budget.observe(self.clock() - started, light_tokens, shares is not None)
