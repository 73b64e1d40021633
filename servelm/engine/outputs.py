"""What the engine reports for a request: one RequestOutput per request per step (a delta).

Invariants: the concatenation of a request's ``new_token_ids`` (and ``new_text``) over its outputs
is its full completion; exactly one output has ``finish_reason`` set, and it is the last.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from servelm.sampling.logprobs import TokenLogprob

__all__ = ["RequestOutput", "TokenLogprob"]


@dataclass(slots=True)
class RequestOutput:
    """What one request produced since its previous output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    """Detokenized text of new_token_ids (stop strings removed); empty without a tokenizer."""
    finish_reason: str | None = None
    """None while running; then "stop", "length", "abort" or "error"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, when finish_reason is "stop"."""
    logprobs: list[TokenLogprob] | None = None
    """One per new token when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Set on the first output only, when asked for: None for the first prompt token."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    """Total so far, including new_token_ids."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    error: str | None = None
    """Why the request failed, when finish_reason is "error"."""
    error_status: int | None = None
    """HTTP status for a request refused before it ran (400: can never fit, 503: queue full);
    None for failures while running (500)."""
    embedding: list[float] | None = None
    """The pooled vector of an embedding request, on its (only) finished output."""
    beam_score: float | None = None
    """Beam search: the returned beam's score, ``cumulative_logprob / num_output_tokens **
    length_penalty`` (transformers' ``sequences_scores``); None otherwise."""
    cumulative_logprob: float | None = None
    """Beam search: the sum of the returned beam's token log-probabilities."""
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill server's vLLM-flow request, on its finished output: what the decode call needs
    (the front end adds the host and port)."""
    timings: dict[str, float] | None = None
    """On a generation request's finished output: the wall-clock times (seconds since the epoch)
    of its phases in the engine, ``arrival``, ``scheduled`` (first step that computed it),
    ``first_token`` and ``finished`` (a phase not reached is left out), and ``detokenize_s``, the
    time spent detokenizing it. Traces and the request time stats log read them."""

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta for two consecutive outputs of a request (``earlier`` not finished): tokens, text and
    logprobs joined, the rest as ``later`` says (its totals are the newer). The front end merges the
    outputs that queued up while its consumer was behind, so a slow client gets one chunk per
    wake-up instead of one per step (vLLM's output collector does the same); the concatenation
    invariant above is unchanged."""
    assert earlier.request_id == later.request_id and not earlier.is_finished
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = [*(earlier.logprobs or []), *(later.logprobs or [])]
    return replace(
        later, new_token_ids=earlier.new_token_ids + later.new_token_ids, new_text=earlier.new_text + later.new_text,
        logprobs=logprobs,
        prompt_logprobs=earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs,
        num_cached_tokens=max(earlier.num_cached_tokens, later.num_cached_tokens))
