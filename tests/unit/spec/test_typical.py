"""Typical acceptance (vLLM's typical_acceptance_sampler): the keep rule against an independent
float64 computation, the recovered and bonus tokens, and a point-mass (greedy) row."""

from __future__ import annotations

import math

import pytest
import torch

from servelm.config import SpeculativeConfig
from servelm.spec.typical import TypicalAcceptance, make_typical_acceptance
from servelm.spec.verify import accept_point_mass

RULE = TypicalAcceptance(posterior_threshold=0.09, posterior_alpha=0.3)


def bound64(row: list[float], threshold: float = 0.09, alpha: float = 0.3) -> float:
    entropy = -sum(p * math.log(p + 1e-5) for p in row)
    return min(threshold, alpha * math.exp(-entropy))


def test_first_refused_draft_gives_the_argmax_and_all_kept_give_the_bonus() -> None:
    probs = torch.tensor([[0.05, 0.80, 0.15, 0.00],    # draft 1 (p .80): kept
                          [0.60, 0.02, 0.30, 0.08],    # draft 2 (p .02 < .09): refused -> 0
                          [0.25, 0.25, 0.25, 0.25]])
    assert RULE.accept(probs, [1, 1], bonus_token_id=3) == [1, 0]
    assert RULE.accept(probs, [1, 2], bonus_token_id=3) == [1, 2, 3]   # all kept: the bonus
    assert RULE.accept(probs, [3, 2], bonus_token_id=3) == [1]         # p = 0: never kept
    assert RULE.accept(probs[:1], [], bonus_token_id=2) == [2]


def test_flat_rows_lower_the_bar_to_alpha_times_the_typical_probability() -> None:
    """Over 100 equally likely tokens exp(-H) is about 1/100: a token of p 0.01 passes the
    0.3 x 0.01 bound although it is far below epsilon; one of p 0.002 does not."""
    flat = torch.full((2, 100), 0.0098)
    flat[:, 0] = 0.0098 + 0.0002
    flat[:, 1] = 0.002
    flat = flat / flat.sum(dim=-1, keepdim=True)
    bound = float(RULE.acceptance_bounds(flat[:1])[0])
    assert bound == pytest.approx(bound64(flat[0].tolist()), rel=1e-4) and bound < 0.004
    assert RULE.accept(flat, [0], bonus_token_id=5) == [0, 5]
    assert RULE.accept(flat, [1], bonus_token_id=5) == [0]


@pytest.mark.parametrize("concentration", [0.05, 0.5, 5.0])
def test_the_rule_matches_a_float64_reference_on_random_rows(concentration: float) -> None:
    """Random rows (Dirichlet: peaked to flat) and random drafts: a draft is kept exactly when
    its probability exceeds min(epsilon, alpha exp(-H)) computed in float64; a token whose
    probability is below that bound, however the rows look, is never kept."""
    generator = torch.Generator().manual_seed(int(concentration * 100))
    dirichlet = torch.distributions.Dirichlet(torch.full((64,), concentration))
    torch.manual_seed(int(concentration * 100))
    num_kept = 0
    for _ in range(300):
        probs = dirichlet.sample((2,)).float()
        draft = int(torch.randint(0, 64, (1,), generator=generator))
        row = probs[0].double().tolist()
        emitted = RULE.accept(probs, [draft], bonus_token_id=7)
        margin = row[draft] - bound64(row)
        if abs(margin) < 1e-6:
            continue  # float32 rounding may decide a tie either way
        assert (emitted == [draft, 7]) == (margin > 0), (row[draft], bound64(row))
        if margin < 0:
            assert emitted == [int(probs[0].argmax())]
        num_kept += margin > 0
    assert 0 < num_kept < 300


def test_a_point_mass_row_is_greedy_verification() -> None:
    """A greedy row's distribution is a point mass on the argmax: typical acceptance then keeps
    exactly the drafts greedy verification keeps."""
    argmaxes = [4, 2, 9, 1]
    probs = torch.zeros(4, 10)
    probs[torch.arange(4), torch.tensor(argmaxes)] = 1.0
    for drafts in ([4, 2, 9], [4, 3, 9], [0, 2, 9], [4, 2, 8]):
        assert RULE.accept(probs, drafts, bonus_token_id=argmaxes[-1]) == \
            accept_point_mass(argmaxes, drafts)


def test_factory_follows_the_config() -> None:
    assert make_typical_acceptance(SpeculativeConfig(speculative_algorithm="NGRAM")) is None
    rule = make_typical_acceptance(SpeculativeConfig(
        speculative_algorithm="NGRAM", spec_decoding_acceptance_method="typical_acceptance_sampler",
        typical_acceptance_sampler_posterior_alpha=0.5))
    assert rule == TypicalAcceptance(posterior_threshold=0.09, posterior_alpha=0.5)


def test_vllm_flags_parse_and_misuse_is_refused() -> None:
    from servelm import cli_args

    config = cli_args.parse_args([
        "--speculative-model", "[ngram]", "--spec-decoding-acceptance-method",
        "typical_acceptance_sampler", "--typical-acceptance-sampler-posterior-threshold", "0.2",
        "--typical-acceptance-sampler-posterior-alpha", "0.4"]).speculative
    assert config.is_typical_acceptance
    assert (config.posterior_threshold, config.posterior_alpha) == (0.2, 0.4)
    assert cli_args.parse_args(["--speculative-model", "[ngram]", "--spec-decoding-acceptance-method",
                                "rejection_sampler"]).speculative.is_typical_acceptance is False
    refusals = [
        (dict(speculative_algorithm="NGRAM", typical_acceptance_sampler_posterior_threshold=0.2),
         "needs --spec-decoding-acceptance-method typical_acceptance_sampler"),
        (dict(spec_decoding_acceptance_method="typical_acceptance_sampler"), "needs --speculative"),
        (dict(speculative_algorithm="NGRAM", spec_decoding_acceptance_method="typical_acceptance_sampler",
              typical_acceptance_sampler_posterior_alpha=-1.0), "positive"),
        (dict(speculative_algorithm="NGRAM", spec_decoding_acceptance_method="typical"), "one of"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**kwargs)  # type: ignore[arg-type]
