"""The n-gram (prompt lookup) proposer: continue the text the way it went last time.

For n from ``max_n`` down to ``min_n``, take the request's last n tokens and look for an earlier
occurrence of them in prompt + output; the tokens that followed that occurrence are the draft.
The longest n that matches wins (a longer context disambiguates repeated short phrases), and
among its matches the most recent one (closest context). No model, no state between steps: on
"edit this file" prompts the output copies long runs of the prompt and almost every draft token
is accepted; on free text few matches exist and the step decodes normally.
"""

from __future__ import annotations

import numpy as np

from servelm.spec.proposer import Draft, DraftRequest


class NgramProposer:
    """Prompt-lookup drafts over each request's own tokens."""

    name = "NGRAM"

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, "SpeculativeConfig validates the window"
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(r.prompt_token_ids + r.output_token_ids, r.max_draft_tokens))
                for r in requests]

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest
        matching suffix of ``token_ids`` (n in [min_n, max_n]); [] when nothing matches."""
        num_tokens = len(token_ids)
        if max_tokens <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n:]
            # Occurrences start before the suffix does, so token start + n (the first of the
            # continuation) always exists.
            starts = np.flatnonzero(tokens[:num_tokens - n] == suffix[0])
            for start in starts[::-1]:
                if np.array_equal(tokens[start:start + n], suffix):
                    follow = start + n
                    draft: list[int] = tokens[follow:follow + max_tokens].tolist()
                    return draft
        return []
