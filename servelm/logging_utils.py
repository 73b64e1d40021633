"""Logging set-up shared by the server and the engine process."""

from __future__ import annotations

import logging

_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def configure_logging(level: str = "info") -> None:
    """Send servelm's logs to stderr at ``level``; safe to call more than once."""
    logger = logging.getLogger("servelm")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_servelm", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._servelm = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
