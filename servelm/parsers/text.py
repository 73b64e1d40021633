"""Text helpers shared by the streaming parsers."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``.

    A streaming parser holds those characters back: the next delta may complete the marker.
    """
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
