"""first_argmax against torch.argmax: ties to the lowest id across and within chunks, -inf rows,
NaN rows, vocabularies that are not a multiple of the chunk, bf16 and float32; by its torch ops and
by the fused ops' native call (``native``, where this machine built them)."""

from __future__ import annotations

import pytest
import torch

from servelm.model.layers import fused
from servelm.sampling.argmax import CHUNK_TOKENS, NativeArgmax, first_argmax


@pytest.fixture(params=["torch", "native"])
def native(request: pytest.FixtureRequest) -> NativeArgmax | None:
    if request.param == "torch":
        return None
    if fused.load_kernel() is None:
        pytest.skip(f"no fused kernel: {fused.kernel_status()}")
    return fused.first_argmax


@pytest.mark.parametrize("vocab", [262_144, 151_936, 4 * CHUNK_TOKENS + 7, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax(vocab: int, dtype: torch.dtype, native: NativeArgmax | None) -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, vocab).to(dtype)
    logits[1, [5, vocab - 1]] = 50.0                       # a tie in different chunks: 5 wins
    logits[2, [vocab - 2, vocab - 1]] = 50.0               # a tie in the last (short) chunk
    logits[3] = float("-inf")                              # nothing allowed: 0
    logits[4, vocab - 1] = 60.0                            # the very last token
    logits[5] = 1.0                                        # all equal: 0
    logits[6, 3 * (vocab // 4)] = float("inf")
    logits[7, [vocab // 2 + 1, vocab // 2]] = 70.0         # a tie inside one chunk: the lower id
    logits[8, [7, 9]] = torch.tensor([-0.0, 0.0]).to(dtype) + 80   # equal values: the first
    expected = logits.argmax(dim=-1)
    assert torch.equal(first_argmax(logits, native), expected)
    assert first_argmax(logits, native)[1] == 5 and first_argmax(logits, native)[2] == vocab - 2
    wide = torch.randn(9, vocab + 5).to(dtype)   # rows with a stride past their width
    wide[:, :vocab] = logits
    assert torch.equal(first_argmax(wide[:, :vocab], native), expected)


def test_nan_rows_follow_torch(native: NativeArgmax | None) -> None:
    logits = torch.randn(4, 8192)
    logits[1, 4000] = float("nan")
    logits[1, 7000] = 100.0
    logits[2, [8191, 6000]] = float("nan")   # the first NaN, not the last seen
    logits[3, 1] = float("nan")
    logits[3, 0] = float("inf")
    assert torch.equal(first_argmax(logits, native), logits.argmax(dim=-1))
    assert first_argmax(logits, native).tolist()[1:] == [4000, 6000, 1]


def test_empty_batch(native: NativeArgmax | None) -> None:
    assert first_argmax(torch.zeros(0, 8192), native).shape == (0,)
    assert torch.equal(first_argmax(torch.tensor([[3.0]]), native), torch.tensor([0]))
