"""Log-probabilities reported to users: log_softmax of the raw model logits.

Invariant: values come from the logits exactly as the model produced them (before logit_bias,
penalties, masks and temperature), so they describe the model, not the sampling recipe. The top-k
list is ordered most likely first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one chosen token and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """(token_id, logprob) of the top-k tokens at this position, most likely first."""


def gather_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row of ``logits`` ``[n, vocab_size]``.

    Row i reports ``log_softmax(logits[i])[token_ids[i]]`` and its ``num_top[i]`` most likely
    (token_id, logprob) pairs.
    """
    num_rows = logits.shape[0]
    assert len(token_ids) == len(num_top) == num_rows
    if num_rows == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    max_top = max(num_top)
    if max_top > 0:
        top_values, top_ids = torch.topk(logprobs, k=min(max_top, logprobs.shape[1]), dim=-1)
        top_value_rows: list[list[float]] = top_values.tolist()
        top_id_rows: list[list[int]] = top_ids.tolist()
    else:
        top_value_rows = [[] for _ in range(num_rows)]
        top_id_rows = [[] for _ in range(num_rows)]
    return [
        TokenLogprob(
            token_id=token_ids[i],
            logprob=chosen[i],
            top=list(zip(top_id_rows[i][: num_top[i]], top_value_rows[i][: num_top[i]])),
        )
        for i in range(num_rows)
    ]


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of each target token under the preceding position's logits (echo / prompt_logprobs).

    ``logits[i]`` is the model's prediction at position i and ``target_ids[i]`` the token that
    actually follows it (prompt token i + 1); ``k`` most likely alternatives per position.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(target_ids), "one logits row per target"
    assert k >= 0
    return gather_logprobs(logits, target_ids, [k] * len(target_ids))
