"""first_argmax against torch.argmax: ties to the lowest id across and within chunks, -inf rows,
NaN rows, vocabularies that are not a multiple of the chunk, bf16 and float32."""

from __future__ import annotations

import pytest
import torch

from servelm.sampling.argmax import CHUNK_TOKENS, first_argmax


@pytest.mark.parametrize("vocab", [262_144, 151_936, 4 * CHUNK_TOKENS + 7, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax(vocab: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, vocab).to(dtype)
    logits[1, [5, vocab - 1]] = 50.0                       # a tie in different chunks: 5 wins
    logits[2, [vocab - 2, vocab - 1]] = 50.0               # a tie in the last (short) chunk
    logits[3] = float("-inf")                              # nothing allowed: 0
    logits[4, vocab - 1] = 60.0                            # the very last token
    logits[5] = 1.0                                        # all equal: 0
    logits[6, 3 * (vocab // 4)] = float("inf")
    logits[7, [vocab // 2 + 1, vocab // 2]] = 70.0         # a tie inside one chunk: the lower id
    expected = logits.argmax(dim=-1)
    assert torch.equal(first_argmax(logits), expected)
    assert first_argmax(logits)[1] == 5 and first_argmax(logits)[2] == vocab - 2


def test_nan_rows_follow_torch() -> None:
    logits = torch.randn(3, 8192)
    logits[1, 4000] = float("nan")
    logits[1, 7000] = 100.0
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    assert first_argmax(logits)[1] == 4000


def test_empty_batch() -> None:
    assert first_argmax(torch.zeros(0, 8192)).shape == (0,)
