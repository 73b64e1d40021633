"""The n-gram proposer: exact drafts for hand-made token sequences."""

from __future__ import annotations

from servelm.config import SpeculativeConfig
from servelm.spec.ngram import NgramProposer
from servelm.spec.proposer import DraftRequest, make_proposer


def test_longest_suffix_wins_then_latest_occurrence() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 4, 1, 2, 3]
    # Suffix (1, 2, 3) occurs at 1 only: its continuation is 9 9 7 ...
    assert proposer.lookup(tokens, 3) == [9, 9, 7]
    # With max_n 2 the suffix (2, 3) last occurred at 7: continuation 4 4 1.
    assert NgramProposer(1, 2).lookup(tokens, 3) == [4, 4, 1]


def test_draft_is_cut_to_max_tokens_and_to_the_text() -> None:
    proposer = NgramProposer(min_n=2, max_n=2)
    tokens = [1, 2, 3, 4, 1, 2]
    assert proposer.lookup(tokens, 10) == [3, 4, 1, 2]   # runs up to the end of the text
    assert proposer.lookup(tokens, 1) == [3]
    assert proposer.lookup(tokens, 0) == []


def test_no_match_below_min_n_proposes_nothing() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.lookup([1, 2, 3, 4, 5, 3], 5) == []   # only a 1-token match exists
    assert NgramProposer(1, 4).lookup([1, 2, 3, 4, 5, 3], 5) == [4, 5, 3]
    assert proposer.lookup([7], 5) == []


def test_repeated_token_run_overlaps_itself() -> None:
    assert NgramProposer(2, 3).lookup([8, 8, 8, 8], 4) == [8]


def test_batch_interface_and_factory() -> None:
    assert make_proposer(SpeculativeConfig()) is None
    proposer = make_proposer(SpeculativeConfig(speculative_algorithm="NGRAM",
                                               ngram_prompt_lookup_min=1, ngram_prompt_lookup_max=2))
    assert proposer is not None and proposer.name == "NGRAM"
    drafts = proposer.propose([DraftRequest("a", [1, 2, 3], [1, 2], 2),
                               DraftRequest("b", [4, 5], [6], 3)])
    assert [d.token_ids for d in drafts] == [[3, 1], []]
    assert all(d.probs is None for d in drafts)
