"""The top_k/top_p candidate shortcut must agree with the full stable sort."""

from __future__ import annotations

import math

import pytest
import torch

from servelm.sampling import sampler as sampler_module
from servelm.sampling.sampler import _apply_top_k_top_p, _filter_sorted, _top_p_bound


def _reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    removed = _filter_sorted(logits, torch.tensor(top_k), _top_p_bound(top_p, logits.device))
    return logits.masked_fill(removed, -math.inf)


@pytest.mark.parametrize("num_candidates", [8, 32])
def test_shortcut_matches_full_sort(monkeypatch, num_candidates):
    monkeypatch.setattr(sampler_module, "_NUM_CANDIDATES", num_candidates)
    generator = torch.Generator().manual_seed(11)
    vocab = 200
    settings = [(vocab, 0.9), (5, 1.0), (1, 1.0), (7, 0.5), (vocab, 0.05), (vocab, 0.999),
                (100, 0.9), (vocab, 1.0), (3, 0.3), (num_candidates, 0.8)]
    for scale in (0.5, 3.0, 10.0):
        logits = torch.randn(len(settings), vocab, generator=generator) * scale
        logits[2, [10, 20, 30]] = logits[2].max() + 1       # tie for the top
        logits[3] = logits[3].round()                       # many ties everywhere
        logits[8, :] = 0.0                                  # all tied
        top_k = [k for k, _ in settings]
        top_p = [p for _, p in settings]
        assert torch.equal(_apply_top_k_top_p(logits, top_k, top_p), _reference(logits, top_k, top_p))


def test_shortcut_on_a_real_sized_vocab():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 32000, generator=generator) * 4
    top_k, top_p = [32000, 40, 32000, 2000], [0.9, 0.95, 0.999999, 0.5]
    assert torch.equal(_apply_top_k_top_p(logits, top_k, top_p), _reference(logits, top_k, top_p))


def test_ties_keep_lowest_ids():
    logits = torch.zeros(1, 10)
    out = _apply_top_k_top_p(logits, [3], [1.0])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1, 2]
