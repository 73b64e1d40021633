"""Prefix-cache keys of image placeholders: the image's digest, not the placeholder token id.

Every placeholder of one image has the same token id, so two prompts with the same text and
different images would otherwise share K/V. The prefix cache (and the hierarchical cache's block
hashes, which hash the same keys) reads each placeholder position as ``image_pad_id(digest)``
instead: a negative number (no real token id is negative) derived from the image's digest. Equal
images at equal positions after an equal prefix share K/V; any other difference does not.
(SGLang pads the placeholders with digest-derived values the same way.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def image_pad_id(digest: str) -> int:
    """The key of every placeholder position of the image with ``digest``: in [-2**60, -1]."""
    return -1 - int(digest[:15], 16)


def keyed_tokens(tokens: list[int], start: int, spans: Sequence[Any]) -> list[int]:
    """``tokens`` (positions ``start ..``) with the positions of each ImageSpan replaced by its
    digest's pad id (a new list where anything changes)."""
    end = start + len(tokens)
    out = tokens
    for span in spans:
        first, last = max(span.offset, start), min(span.offset + span.length, end)
        if first < last:
            if out is tokens:
                out = list(tokens)
            out[first - start:last - start] = [image_pad_id(span.digest)] * (last - first)
    return out
