"""The n-gram (prompt lookup) proposer: continue the text the way it went last time.

The request's last tokens are looked up in its own prompt + output: among the earlier places where
its last n tokens occur (n from ``min_n`` up to ``max_n``) the one with the longest match wins (a
longer context disambiguates repeated short phrases), the most recent among equals (closest
context), and the tokens that followed it are the draft. No model: on "edit this file" prompts the
output copies long runs of the prompt and almost every draft token is accepted; on free text few
matches exist and the step decodes normally.

How many tokens to draft (``length="adaptive"``, the default; ``"fixed"`` always drafts
``max_draft_tokens``, vLLM's prompt lookup). A verify step of k drafts costs the model k + 1 rows
(on a CPU a 6-row step costs 2-3x a 1-row one, benchmarks/RESULTS.md), so a draft only pays when
enough of it is accepted. Two signals bound k, both per request:

- the match length m (counted back past ``max_n``, up to the most drafts): text that has agreed
  with an earlier place for m tokens tends to go on agreeing for about as long (a 2-token match in
  prose is often a coincidence; in a copied file the match is dozens of tokens long), so k <= m;
- the recent acceptance, like a congestion window: ``cap`` starts at ``START_CAP``, grows to twice
  a draft accepted whole and halves (never below the accepted count + 1) when one was cut, so a request that leaves the copied text stops paying for
  long drafts after a step, and one that copies grows its drafts to the maximum in a few steps.

The proposer learns a draft's fate from the next call's output (no interface to the verifier): if
the output grew, the new tokens' common prefix with the draft is what was accepted (the model's
own token at the first mismatch differs from the draft, for the exact verifiers); if it did not grow, the
draft was not verified (not scheduled) and nothing is learned.

SGLang's NGRAM keeps a trie shared by all requests with frequencies and widens its draft tree for
short matches; vLLM's prompt lookup drafts a fixed k from the longest match. This proposer stays
per request (no shared state, one chain) and spends its effort on choosing k.

Invariants: ``propose`` never modifies the requests' token lists; a request's state exists from
its first ``propose`` until ``release``; a draft is never longer than ``max_draft_tokens`` nor the
text that followed the match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from servelm.spec.proposer import Draft, DraftRequest

DRAFT_LENGTHS = ("adaptive", "fixed")
START_CAP = 4
"""Drafts a request may propose before its first verification (then the cap adapts)."""


@dataclass(slots=True)
class Match:
    """Where the text's suffix occurred before."""

    follow: int
    """Index of the first token after the earlier occurrence (the draft starts there)."""
    num_tokens: int
    """How many tokens agree, counted back from the two ends (at least min_n)."""


@dataclass(slots=True)
class _Stream:
    """What the adaptive proposer remembers of one request between steps."""

    cap: int = START_CAP
    """Most drafts the recent acceptance allows (>= 1)."""
    num_output_tokens: int = 0
    """Output length when ``draft`` was proposed."""
    draft: list[int] = field(default_factory=list)
    """The last draft proposed (empty: none pending)."""


class NgramProposer:
    """Prompt-lookup drafts over each request's own tokens."""

    name = "NGRAM"

    def __init__(self, min_n: int, max_n: int, length: str = "fixed") -> None:
        assert 1 <= min_n <= max_n, "SpeculativeConfig validates the window"
        assert length in DRAFT_LENGTHS, length
        self.min_n = min_n
        self.max_n = max_n
        self.is_adaptive = length == "adaptive"
        self._streams: dict[str, _Stream] = {}
        self.num_observed = 0
        """Drafts whose verification the adaptive proposer observed (for tests and figures)."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self._propose_one(r)) for r in requests]

    def release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def cap(self, request_id: str) -> int | None:
        """The request's current draft cap (None: not seen, or fixed length)."""
        stream = self._streams.get(request_id)
        return stream.cap if stream is not None else None

    def _propose_one(self, request: DraftRequest) -> list[int]:
        token_ids = request.prompt_token_ids + request.output_token_ids
        max_tokens = request.max_draft_tokens
        if not self.is_adaptive:
            return self.lookup(token_ids, max_tokens)
        stream = self._streams.get(request.request_id)
        if stream is None:
            stream = self._streams[request.request_id] = _Stream()
        self._observe(stream, request.output_token_ids, max_tokens)
        match = self.find(token_ids, max_tokens) if max_tokens > 0 else None
        draft: list[int] = []
        if match is not None:
            num_drafts = min(max_tokens, stream.cap, match.num_tokens)
            draft = token_ids[match.follow:match.follow + num_drafts]
        stream.draft, stream.num_output_tokens = draft, len(request.output_token_ids)
        return draft

    def _observe(self, stream: _Stream, output_token_ids: list[int], max_tokens: int) -> None:
        """Adapt the cap to how much of the pending draft the model kept."""
        if not stream.draft or len(output_token_ids) <= stream.num_output_tokens:
            return  # nothing drafted, or the draft was not verified yet
        new = output_token_ids[stream.num_output_tokens:]
        num_drafts = len(stream.draft)
        accepted = 0
        while accepted < min(num_drafts, len(new)) and new[accepted] == stream.draft[accepted]:
            accepted += 1
        if accepted == num_drafts:
            stream.cap = max(stream.cap, min(2 * num_drafts, max_tokens))
        else:
            stream.cap = max(1, accepted + 1, stream.cap // 2)
        stream.draft = []
        self.num_observed += 1

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the best earlier occurrence of the text's
        suffix (``find``); [] when nothing matches."""
        if max_tokens <= 0:
            return []
        match = self.find(token_ids, 0)
        return [] if match is None else token_ids[match.follow:match.follow + max_tokens]

    def find(self, token_ids: list[int], extend_to: int) -> Match | None:
        """The earlier occurrence of the longest suffix of ``token_ids`` of min_n..max_n tokens
        (the latest of those), with its match counted on back up to ``extend_to`` tokens; None
        when no suffix of min_n tokens occurred before."""
        num_tokens = len(token_ids)
        if num_tokens <= self.min_n:
            return None
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Ends of earlier occurrences matching the last n tokens; an end before the last token
        # leaves at least one token of continuation.
        ends = np.flatnonzero(tokens[:num_tokens - 1] == tokens[-1])
        length = 1
        while ends.size and length < self.max_n:
            reach = ends[ends >= length]
            longer = reach[tokens[reach - length] == tokens[num_tokens - 1 - length]]
            if not longer.size:
                break
            ends, length = longer, length + 1
        if not ends.size or length < self.min_n:
            return None
        end = int(ends[-1])
        while (length < extend_to and end - length >= 0
               and token_ids[end - length] == token_ids[num_tokens - 1 - length]):
            length += 1
        return Match(end + 1, length)
