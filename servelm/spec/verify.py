"""Verification: which drafted tokens the target model keeps.

The target scores the last accepted token and the k drafts in one forward pass: row i of its
logits is the distribution p_i of the token after draft i (row 0: after the accepted text).

Exactness. Emitting the target's own sample x_i at each row, up to and including the first row
where x_i differs from draft d_{i+1}, gives exactly the tokens plain decoding would give, provided
row i is sampled as plain decoding would sample that position: the same processors over the same
context (penalties and min_tokens see output + d_1..d_i, the grammar mask its state after them)
and the same random stream (the seed and output length of that position). Every row before the
first mismatch has that context, because its drafts were all accepted. So:

- greedy: accept the longest prefix of drafts equal to the argmaxes, then the argmax after it
  (the "bonus" token): token for token plain decoding;
- sampling with a point-mass draft (n-gram): d is kept with probability p(d) (x_i == d), and on a
  mismatch x_i is distributed as p restricted to tokens other than d, renormalised, which is
  normalize(max(p - q, 0)) for q = one-hot(d): this *is* the rejection sampler of Leviathan et
  al. / Chen et al. for that q, and, with seeded rows, the same tokens as plain decoding.

A proposer that samples its drafts from a distribution q (a draft model) needs the general rule,
``rejection_sample``: keep d_i with probability min(1, p_i(d_i) / q_i(d_i)), else sample the
residual normalize(max(p_i - q_i, 0)) and stop; if all k are kept, sample p_k (the bonus row).
"""

from __future__ import annotations

import torch


def accepted_prefix_length(target_token_ids: list[int], draft_token_ids: list[int]) -> int:
    """How many leading drafts equal the target's tokens (``target_token_ids`` has one row more
    than the drafts: its token at that index is the one emitted after them)."""
    assert len(target_token_ids) == len(draft_token_ids) + 1, "k drafts are scored by k + 1 rows"
    for index, draft in enumerate(draft_token_ids):
        if target_token_ids[index] != draft:
            return index
    return len(draft_token_ids)


def accept_point_mass(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The emitted tokens for deterministic drafts: the agreeing prefix plus the target's next."""
    return target_token_ids[:accepted_prefix_length(target_token_ids, draft_token_ids) + 1]


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_token_ids: list[int], generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling for drafts drawn from ``draft_probs`` ``[k, vocab]``;
    ``target_probs`` ``[k + 1, vocab]`` are the target's processed distributions (temperature,
    top-k/p applied). Returns the emitted tokens (1..k + 1): their distribution is exactly that
    of sampling the target token by token."""
    num_drafts = len(draft_token_ids)
    assert target_probs.shape[0] == num_drafts + 1 and draft_probs.shape[0] == num_drafts
    device = target_probs.device
    uniforms = torch.rand(num_drafts + 1, generator=generator, device=device).tolist()
    emitted: list[int] = []
    for index, token_id in enumerate(draft_token_ids):
        p = float(target_probs[index, token_id])
        q = float(draft_probs[index, token_id])
        if q > 0 and uniforms[index] * q < p:  # u < min(1, p / q) without dividing
            emitted.append(token_id)
            continue
        residual = (target_probs[index] - draft_probs[index]).clamp_(min=0)
        total = float(residual.sum())
        if total <= 0:  # p == q: a rejection has probability 0; fall back to p
            residual = target_probs[index]
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[num_drafts], 1, generator=generator)))
    return emitted
