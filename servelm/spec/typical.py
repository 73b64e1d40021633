"""Typical acceptance (vLLM's ``typical_acceptance_sampler``, MEDUSA section 3.3.1): keep a draft
token the model finds plausible enough, instead of only as often as the model would sample it.

Rule, for row i of the model's processed distribution p_i (temperature, top-k/p, penalties and
grammar mask applied: what the sampler draws from) and draft d_{i+1}:

    keep d_{i+1}  iff  p_i(d_{i+1}) > min(epsilon, delta * exp(-H(p_i))),
    H(p) = -sum p log(p + 1e-5)        (the 1e-5 keeps log(0) out, as vLLM does)

with epsilon = --typical-acceptance-sampler-posterior-threshold and delta = ...-posterior-alpha.
A confident row (low entropy) asks for up to epsilon; a flat one only for a share of the
typical probability exp(-H). The drafts kept are the leading run of kept tokens; at the first
refused one the model's most likely token is emitted (vLLM's recovered token: the argmax of
p_i), and when all k are kept the model's own sample of the last row (the bonus token) follows.

The draft's own distribution q plays no part (vLLM's sampler is deterministic in the drafts), so
it applies alike to n-gram and draft-model drafts. It is not exact: the output no longer follows
the model's distribution (a kept token is never resampled, a refused one is replaced by the
argmax). Greedy requests never come here: their drafts are verified by ``verify.accept_point_mass``,
token for token plain decoding (a greedy row's p is a point mass on the argmax, and this rule
would give the same tokens).

Invariants: a token with p_i = 0 (outside top-k/p, banned by the grammar) is never kept, since
the bound is positive; at least one token is emitted; at most k + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from servelm.config import SpeculativeConfig

_LOG_EPSILON = 1e-5
"""Added inside the entropy's log (vLLM's constant), so a zero probability contributes 0."""


@dataclass(frozen=True, slots=True)
class TypicalAcceptance:
    """The two knobs of the rule (``SpeculativeConfig.posterior_threshold`` / ``posterior_alpha``)."""

    posterior_threshold: float
    """epsilon: the bound never exceeds it."""
    posterior_alpha: float
    """delta: the bound is delta * exp(-entropy) when that is lower."""

    def acceptance_bounds(self, probs: torch.Tensor) -> torch.Tensor:
        """``[rows]`` the probability a draft must exceed at each row of ``probs`` ``[rows, vocab]``."""
        entropy = -(probs * torch.log(probs + _LOG_EPSILON)).sum(dim=-1)
        return (self.posterior_alpha * torch.exp(-entropy)).clamp(max=self.posterior_threshold)

    def accept(self, target_probs: torch.Tensor, draft_token_ids: list[int],
               bonus_token_id: int) -> list[int]:
        """The emitted tokens (1..k + 1) for k drafts scored by ``target_probs`` ``[k + 1, vocab]``
        (normalised rows); ``bonus_token_id`` is the model's sample of row k, emitted when every
        draft is kept."""
        num_drafts = len(draft_token_ids)
        assert target_probs.shape[0] == num_drafts + 1, "k drafts are scored by k + 1 rows"
        if not num_drafts:
            return [bonus_token_id]
        probs = target_probs[:num_drafts].float()
        index = torch.tensor(draft_token_ids, dtype=torch.int64, device=probs.device)
        draft_probs = probs.gather(1, index[:, None]).squeeze(1)
        is_kept = (draft_probs > self.acceptance_bounds(probs)).tolist()
        for position, kept in enumerate(is_kept):
            if not kept:
                return draft_token_ids[:position] + [int(probs[position].argmax())]
        return draft_token_ids + [bonus_token_id]


    def accept_tree(self, target_probs: torch.Tensor, draft_token_ids: list[int], parents: list[int],
                    sampled_token_ids: list[int]) -> tuple[list[int], list[int]]:
        """The rule along a draft tree (``spec/tree.py``): at each node keep its first child (in
        draft order) the rule keeps; with none kept emit the node row's argmax, at a leaf the
        model's own sample of the leaf's row (``sampled_token_ids``, one per row). Returns
        (emitted tokens, accepted draft indices)."""
        from servelm.spec.tree import children

        assert target_probs.shape[0] == len(draft_token_ids) + 1, "one row per node and the root"
        probs = target_probs.float()
        bounds = self.acceptance_bounds(probs).tolist()
        by_parent = children(parents)
        node, accepted = -1, []
        while True:
            row = node + 1
            kids = by_parent.get(node, [])
            if not kids:
                return [draft_token_ids[i] for i in accepted] + [sampled_token_ids[row]], accepted
            kept = next((c for c in kids if float(probs[row, draft_token_ids[c]]) > bounds[row]), None)
            if kept is None:
                return [draft_token_ids[i] for i in accepted] + [int(probs[row].argmax())], accepted
            accepted.append(kept)
            node = kept


def make_typical_acceptance(config: SpeculativeConfig) -> TypicalAcceptance | None:
    """The rule --spec-decoding-acceptance-method typical_acceptance_sampler asks for (None:
    rejection sampling, the default)."""
    if not config.is_typical_acceptance:
        return None
    return TypicalAcceptance(config.posterior_threshold, config.posterior_alpha)
