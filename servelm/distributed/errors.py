"""The one distributed error that crosses into the engine."""

from __future__ import annotations


class RankFailedError(RuntimeError):
    """A rank process died, never joined within --dist-timeout, or its collective failed.

    The model is sharded over every rank, so no step can run without it: the engine ends every
    request with this message and its process exits (the server with it).
    """
