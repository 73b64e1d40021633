"""Logit processors that run before token selection: bias, bans and repetition penalties.

Every function edits a float32 logits tensor ``[num_rows, vocab_size]`` in place, touches only the
rows it is told about, and never turns a ``-inf`` logit back into a finite one. Token ids are
trusted to lie in ``[0, vocab_size)`` (``SamplingParams.validate_token_ids`` checks user-supplied
ones at admission).

Penalty definitions (what vLLM/SGLang/HF users expect):
- repetition (HF/CTRL): for every token seen in prompt + output, a positive logit is divided by
  the penalty and a negative one multiplied by it.
- frequency / presence (OpenAI): ``logit -= frequency * count + presence * (count > 0)``, where
  count is how often the token occurs in the output so far (the prompt is not counted).
"""

from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, biases: list[tuple[int, int, float]]) -> None:
    """Add ``bias`` to ``logits[row, token_id]`` for each ``(row, token_id, bias)``."""
    if not biases:
        return
    rows, token_ids, values = zip(*biases)
    device = logits.device
    logits.index_put_(
        (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device)),
        torch.tensor(values, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def ban_tokens(logits: torch.Tensor, bans: list[tuple[int, list[int]]]) -> None:
    """Set ``logits[row, token_id] = -inf`` for each token_id of each ``(row, token_ids)``."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, ids in bans:
        rows.extend([row] * len(ids))
        token_ids.extend(ids)
    if not rows:
        return
    device = logits.device
    logits[torch.tensor(rows, device=device), torch.tensor(token_ids, device=device)] = float("-inf")


def _pad(sequences: list[list[int]], pad_ids: list[int], device: torch.device) -> torch.Tensor:
    """int64 [len(sequences), longest] with row i padded by pad_ids[i] (at least one column)."""
    width = max(1, max((len(seq) for seq in sequences), default=0))
    padded = [seq + [pad] * (width - len(seq)) for seq, pad in zip(sequences, pad_ids)]
    return torch.tensor(padded, dtype=torch.int64, device=device)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalties: list[float],
    frequency_penalties: list[float],
    presence_penalties: list[float],
) -> None:
    """Apply the three penalties to every row of ``logits`` (all lists have one entry per row).

    Neutral values (1, 0, 0) leave a row unchanged, so callers pass only the rows that need it.
    Works on the seen token ids only (gather/scatter), never on dense [rows, vocab] count tables:
    a step touches prompt+output tokens, not the 150k-token vocabulary.
    """
    num_rows, vocab_size = logits.shape
    assert len(prompt_token_ids) == len(output_token_ids) == num_rows
    device = logits.device

    if any(p != 1.0 for p in repetition_penalties):
        seen = [prompt + output for prompt, output in zip(prompt_token_ids, output_token_ids)]
        # Padding repeats a token already in the row, so duplicate scatters write equal values;
        # a row with no tokens gets penalty 1 and rewrites token 0 unchanged.
        index = _pad(seen, [seq[0] if seq else 0 for seq in seen], device)
        penalty = torch.tensor([p if seq else 1.0 for p, seq in zip(repetition_penalties, seen)],
                               dtype=logits.dtype, device=device)[:, None]
        values = logits.gather(1, index)
        logits.scatter_(1, index, torch.where(values > 0, values / penalty, values * penalty))

    if any(p != 0.0 for p in frequency_penalties) or any(p != 0.0 for p in presence_penalties):
        # Sorted ids with padding (vocab_size) last; presence counts each id's first occurrence.
        ids = _pad(output_token_ids, [vocab_size] * num_rows, device).sort(dim=1).values
        is_token = ids < vocab_size
        is_first = torch.ones_like(is_token)
        is_first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        frequency = torch.tensor(frequency_penalties, dtype=logits.dtype, device=device)[:, None]
        presence = torch.tensor(presence_penalties, dtype=logits.dtype, device=device)[:, None]
        weight = (frequency + presence * is_first.to(logits.dtype)) * is_token.to(logits.dtype)
        logits.scatter_add_(1, ids.masked_fill(~is_token, 0), -weight)
