"""The proposer interface of speculative decoding: who guesses the next tokens of a request.

A step of speculative decoding is: the proposer drafts up to k tokens for each decoding request,
the target model scores the last accepted token plus the drafts in one forward pass (k + 1 logits
rows, the scheduler's catch-up arithmetic), and ``verify`` keeps the longest run the target agrees
with plus one token of its own. The proposer only guesses; it never decides what is emitted.

Invariants:
- A proposer sees a request's tokens (prompt + accepted output), never a Request: spec/ sits
  below engine/ and above model/.
- ``Draft.probs`` is None for a deterministic proposer (n-gram: the draft is a point mass on each
  token); a model proposer returns the distribution it sampled each draft token from, which the
  rejection sampler needs (``verify.rejection_sample``).
- ``release`` is called once when a request ends (finished, aborted or preempted), so a proposer
  holding per-request state (a draft model's KV blocks) frees it; the n-gram proposer holds none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from servelm.config import SpeculativeConfig


@dataclass(slots=True)
class DraftRequest:
    """One request the proposer may draft for this step."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Accepted output so far (the proposer must not modify either list)."""
    max_draft_tokens: int
    """Most tokens to propose (k, already cut to what max_tokens and the context leave)."""
    temperature: float = 0.0
    """The request's sampling temperature (a draft model samples its drafts at it); 0: greedy (the
    engine sends 0 for every request SamplingParams.is_greedy calls greedy)."""
    top_k: int = 0
    """The request's top_k (0 or >= vocab: off); a draft model samples within it, as the model will."""
    top_p: float = 1.0
    """The request's top_p (1: off)."""
    seed: int | None = None
    """The request's sampling seed (its own or the server-derived one), for reproducible drafts."""


@dataclass(slots=True)
class Draft:
    """The tokens proposed for one request (possibly none)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    """``[len(token_ids), vocab]`` float32 draft distribution each token was sampled from; None
    for a deterministic proposer (a point mass on each token)."""
    parents: list[int] | None = None
    """A draft tree (EAGLE topk > 1, ``spec/tree.py``): the index of each token's parent among
    ``token_ids`` (-1: the last accepted token), parents first; None: a chain."""


class Proposer(Protocol):
    """Drafts tokens for a batch of decoding requests."""

    name: str
    """The --speculative-algorithm value it implements, for stats and logs."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in order; an empty Draft means "decode normally"."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a request (it finished or was preempted)."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The proposer for ``--speculative-algorithm`` (None: speculation off)."""
    if config.speculative_algorithm is None:
        return None
    from servelm.spec.ngram import NgramProposer

    assert config.speculative_algorithm == "NGRAM", \
        "SpeculativeConfig refuses the others; the engine builds STANDALONE (it loads a model)"
    return NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max,
                         config.ngram_draft_length)
