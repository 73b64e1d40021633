"""Prompt logprobs and the logprob gatherer."""

from __future__ import annotations

import pytest
import torch

from servelm.sampling.logprobs import gather_logprobs
from servelm.sampling.sampler import compute_prompt_logprobs


def test_prompt_logprobs_match_log_softmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(3))
    targets = [4, 0, 29, 7, 7]
    entries = compute_prompt_logprobs(logits, targets, k=4)
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in entries] == targets
    for i, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(expected[i, targets[i]]), abs=1e-6)
        values, ids = expected[i].sort(descending=True)
        assert [t for t, _ in entry.top] == ids[:4].tolist()
        assert [v for _, v in entry.top] == pytest.approx(values[:4].tolist(), abs=1e-6)
        assert entry.top[0][1] >= entry.top[-1][1]


def test_prompt_logprobs_k_zero_and_empty():
    logits = torch.randn(2, 10)
    assert all(e.top == [] for e in compute_prompt_logprobs(logits, [1, 2], k=0))
    assert compute_prompt_logprobs(torch.zeros(0, 10), [], k=3) == []


def test_gather_logprobs_mixed_k():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    entries = gather_logprobs(logits, [0, 1], [1, 3])
    assert [t for t, _ in entries[0].top] == [2]
    assert [t for t, _ in entries[1].top][0] == 0 and len(entries[1].top) == 3


def test_gather_logprobs_k_larger_than_vocab():
    entries = gather_logprobs(torch.zeros(1, 2), [1], [5])
    assert len(entries[0].top) == 2
