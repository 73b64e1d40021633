"""Copies of one prompt compute it once: n > 1 (and repeated prompts of one client request).

The server turns a request with ``n`` choices into ``n`` engine requests of one ``group`` and one
prompt. Computed apart, each copy would prefill the prompt again (and, with ``echo`` logprobs, its
prompt logprobs too: a full-vocabulary logits row per prompt token), so ``n=8`` cost eight times
``n=1`` before the first token of any copy. Here the first copy to arrive (the *leader*) computes
the prompt; the others (its *copies*) wait, held back from admission, until its prompt and prompt
logprobs are complete. Then each copy takes the leader's prompt logprobs (a list copy) and, when it
is admitted, forks the leader's K/V (``KVManager.fork``: full blocks shared, the partial last block
copied on write), so it computes only its last prompt token, whose logits it samples its own first
token from (with its own seed). A leader no longer running (finished, preempted) leaves its full
blocks in the prefix cache: the copies match them there instead.

Invariants:
- A copy is held (``Request.held_by``) only while its leader is unfinished and has not computed its
  prompt; a leader that ends first (aborted, failed) passes the lead to its first live copy. A
  leader stays one until it ends, so a copy that arrives after its prompt was computed (the
  server's n submissions may reach the engine over two steps) is released at once.
- Copies share a leader only within one group, one adapter, one prompt and one prompt-logprobs
  setting; embeddings and K/V transfers are never shared.
- Outputs do not depend on sharing: a copy's prompt logprobs are the leader's (the same numbers its
  own prefill would give), and its first token is sampled from its own last-token logits.
"""

from __future__ import annotations

from typing import Any

from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.outputs import RequestOutput
from servelm.engine.request import Request, RequestStatus
from servelm.engine.scheduler import Scheduler
from servelm.engine.stage import Stage, StepCore

HELD_BY = "its prompt's first copy"

_Key = tuple[str, str | None, int | None, tuple[int, ...]]


def _has_prompt(leader: Request) -> bool:
    """The leader's prompt K/V has been computed (at least once) and its prompt logprobs are whole."""
    computed = leader.num_computed_tokens >= leader.num_prompt_tokens or bool(leader.output_token_ids)
    return computed and not leader.wants_prompt_logprobs


class SharedPrompts(Stage):
    """Holds the copies of a prompt until its leader computed it; then they fork from it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._leaders: dict[_Key, Request] = {}
        self._copies: dict[str, list[Request]] = {}
        """Leader request id -> its copies still held."""
        self.num_shared_prompts = 0
        """Copies that took a leader's computed prompt instead of computing their own."""

    def on_add(self, request: Request, submission: SubmitRequest) -> bool:
        if request.pooling is not None or request.transfer is not None or request.group == request.request_id:
            return False
        key: _Key = (request.group, request.adapter_id, request.params.prompt_logprobs,
                     tuple(request.prompt_token_ids))
        leader = self._leaders.get(key)
        if leader is None:
            self._leaders[key] = request
            self._copies[request.request_id] = []
            return False
        request.held_by = HELD_BY
        self._copies[leader.request_id].append(request)
        return False

    def before_schedule(self, core: StepCore) -> list[RequestOutput]:
        if not self._leaders:
            return []
        for key, leader in list(self._leaders.items()):
            copies = self._copies[leader.request_id]
            if copies and _has_prompt(leader):
                for copy in copies:
                    self._release(copy, leader)
                copies.clear()
            if not leader.is_finished:
                continue  # it stays the leader: a copy that arrives later forks from it too
            del self._leaders[key]
            del self._copies[leader.request_id]
            live = [copy for copy in copies if not copy.is_finished]
            if live:  # it ended before its prompt was computed (aborted, failed): pass the lead on
                live[0].held_by = None
                self._leaders[key] = live[0]
                self._copies[live[0].request_id] = live[1:]
        return []

    def _release(self, copy: Request, leader: Request) -> None:
        if copy.is_finished:
            return
        copy.held_by = None
        if leader.prompt_logprobs is not None and copy.params.prompt_logprobs is not None:
            copy.prompt_logprobs = list(leader.prompt_logprobs)
        if leader.status is RequestStatus.RUNNING:
            self.scheduler.kv.prompt_sources[copy.request_id] = leader
        self.num_shared_prompts += 1

    def on_finish(self, request: Request, output: RequestOutput) -> None:
        self.scheduler.kv.prompt_sources.pop(request.request_id, None)

    def stats(self) -> dict[str, Any]:
        return {"num_shared_prompts": self.num_shared_prompts}
