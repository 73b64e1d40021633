"""Verification rules: the greedy/point-mass prefix rule, and the general rejection sampler keeps
the target distribution exactly (a statistical check with a fixed seed)."""

from __future__ import annotations

import torch

from servelm.spec.verify import accept_point_mass, accepted_prefix_length, rejection_sample


def test_accepted_prefix_and_bonus() -> None:
    assert accepted_prefix_length([4, 5, 6, 7], [4, 5, 6]) == 3
    assert accept_point_mass([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]   # all kept + bonus
    assert accept_point_mass([4, 9, 6, 7], [4, 5, 6]) == [4, 9]         # cut at the mismatch
    assert accept_point_mass([1, 5, 6, 7], [4, 5, 6]) == [1]            # the target's own token
    assert accept_point_mass([3], []) == [3]


def _first_token_frequencies(target: torch.Tensor, draft: torch.Tensor, num_trials: int,
                             seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(target.shape[1])
    for _ in range(num_trials):
        token = int(torch.multinomial(draft[0], 1, generator=generator))
        emitted = rejection_sample(target, draft, [token], generator)
        counts[emitted[0]] += 1
    return counts / num_trials


def test_rejection_sampler_keeps_the_target_distribution() -> None:
    """For a draft close to the target and one far from it, the first emitted token's frequencies
    match the target's probabilities within 0.02 (10,000 draws: 4.5 standard deviations of the
    largest probability's frequency)."""
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    close = torch.tensor([[0.45, 0.35, 0.15, 0.05]])
    far = torch.tensor([[0.0, 0.05, 0.05, 0.9]])
    for draft in (close, far):
        frequencies = _first_token_frequencies(target, draft, 10_000, seed=0)
        assert torch.allclose(frequencies, target[0], atol=0.02), (draft, frequencies)


def test_point_mass_draft_is_accepted_with_the_target_probability() -> None:
    target = torch.tensor([[0.6, 0.3, 0.1], [1.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, 1.0, 0.0]])   # always proposes token 1
    generator = torch.Generator().manual_seed(1)
    num_trials = 10_000
    kept = sum(rejection_sample(target, draft, [1], generator)[0] == 1 for _ in range(num_trials))
    assert abs(kept / num_trials - 0.3) < 0.02
