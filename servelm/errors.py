"""The few exceptions that cross a module boundary.

Invariant: an exception defined here carries everything its catcher needs to answer the user
(a message naming the offending input, and for requests the parameter name), so no layer has to
parse another layer's message text.
"""

from __future__ import annotations


class ServelmError(Exception):
    """Base class of servelm's own exceptions."""


class InvalidRequestError(ServelmError):
    """A client request is invalid or asks for something unsupported; the server answers 400.

    ``param`` names the offending request field (OpenAI's ``error.param``); ``code`` is a short
    machine-readable reason such as ``"context_length_exceeded"``, or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineRequestError(ServelmError):
    """The engine failed a request (finish_reason "error") or could not be reached; answered
    ``status_code``: 500, or the engine's own status for a request it refused up front (400: it
    can never fit the KV pool; 503: the waiting queue is full)."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.status_code = status_code

    @classmethod
    def from_output(cls, output: object) -> EngineRequestError:
        """From a RequestOutput that finished with an error."""
        message = getattr(output, "error", None) or "the engine failed the request"
        return cls(message, getattr(output, "error_status", None) or 500)
