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
    """The engine failed a request (finish_reason "error") or could not be reached; answered 500."""
