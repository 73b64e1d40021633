"""When an appended token ends a request: its grammar, stop tokens, EOS, max_tokens, the context.

Pure functions of the request's state after the token was appended (the scheduler applies the
result); stop strings are matched later, on text, by the detokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.engine.request import FinishReason, Request


@dataclass(frozen=True, slots=True)
class Ending:
    """Why a request ends after a token."""

    reason: FinishReason
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int | None = None


def ending_after(request: Request, token_id: int) -> Ending | None:
    """How ``request`` ends now that ``token_id`` is its last output token (fed to its grammar
    here), or None when it goes on."""
    matcher = request.grammar.matcher if request.grammar is not None else None
    if matcher is not None:
        if not matcher.accept_token(token_id):
            # Only a grammar that reached a state no token of the vocabulary can continue lets
            # the masked sampler pick a forbidden token: the request's grammar, not the server.
            return Ending(FinishReason.ERROR, error_status=400, error=(
                "the request's grammar allows no further token of this model's vocabulary after "
                f"{len(request.output_token_ids) - 1} output tokens"))
        if matcher.is_terminated():
            return Ending(FinishReason.STOP)
    params = request.params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return Ending(FinishReason.STOP, stop_reason=token_id)
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return Ending(FinishReason.STOP)
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return Ending(FinishReason.LENGTH)
    if request.num_tokens >= request.max_context_tokens:
        return Ending(FinishReason.LENGTH)
    return None
