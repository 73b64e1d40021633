"""Fixtures shared by the sampling tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from servelm.sampling.params import SamplingParams
from servelm.sampling.sampler import SamplingRow

RowFactory = Callable[..., SamplingRow]


def _make_row(prompt: list[int] | None = None, output: list[int] | None = None,
              eos: list[int] | None = None, **params: object) -> SamplingRow:
    """A SamplingRow whose SamplingParams are built from the keyword arguments."""
    return SamplingRow(params=SamplingParams(**params),  # type: ignore[arg-type]
                       prompt_token_ids=list(prompt or []), output_token_ids=list(output or []),
                       eos_token_ids=list(eos or []))


@pytest.fixture
def make_row() -> RowFactory:
    return _make_row


@pytest.fixture
def random_logits() -> torch.Tensor:
    """[6, 50] float32 logits with a wide spread, fixed seed."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(6, 50, generator=generator) * 3
