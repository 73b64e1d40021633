"""The n-gram proposer: exact drafts for hand-made token sequences."""

from __future__ import annotations

import pytest

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


def test_the_longer_match_wins_over_the_later_one() -> None:
    # (3, 4) occurs at 2 (after 1 2) and at 7 (after 9 9); the text ends with 1 2 3 4: the
    # occurrence with the longer match (4 tokens) is drafted from although another is later.
    tokens = [1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 8, 1, 2, 3, 4]
    assert NgramProposer(2, 16).lookup(tokens, 2) == [5, 6]
    assert NgramProposer(2, 2).lookup(tokens, 2) == [7, 8]   # window 2: the latest (3, 4)
    match = NgramProposer(2, 2).find(tokens, 10)
    assert match is not None and (match.follow, match.num_tokens) == (9, 2)   # 9 != 2: stops
    match = NgramProposer(2, 2).find([5, 1, 2, 3, 4, 0, 5, 1, 2, 3, 4], 10)
    assert match is not None and (match.follow, match.num_tokens) == (5, 5)   # counted on past max_n


def adaptive(min_n: int = 2, max_n: int = 16) -> NgramProposer:
    return NgramProposer(min_n, max_n, length="adaptive")


def test_adaptive_drafts_no_more_than_the_match_length() -> None:
    proposer = adaptive()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    # (1, 2) matched: two tokens of agreement, so at most 2 drafts though 8 are allowed
    [draft] = proposer.propose([DraftRequest("a", prompt, [1, 2], 8)])
    assert draft.token_ids == [3, 4]
    # a single-token match (below min_n) drafts nothing: the step is a plain one
    [draft] = proposer.propose([DraftRequest("b", prompt, [5], 8)])
    assert draft.token_ids == []


def test_adaptive_cap_grows_on_full_accepts_and_halves_on_a_cut() -> None:
    proposer = adaptive()
    prompt = list(range(100, 160)) + [7] + list(range(100, 110))   # a 60-token file, then its start
    output: list[int] = []
    text = list(range(110, 160))   # the model goes on copying the file

    def step(max_tokens: int = 32) -> list[int]:
        [draft] = proposer.propose([DraftRequest("r", prompt, output, max_tokens)])
        return draft.token_ids

    assert len(step()) == 4 and proposer.cap("r") == 4          # START_CAP before any verification
    lengths = []
    for _ in range(3):   # each draft accepted whole (+ the model's own token): the cap doubles
        draft = step()
        lengths.append(len(draft))
    assert lengths == [4, 4, 4]   # not verified yet: the output did not grow, nothing learned
    output.extend(text[:5])        # 4 accepted + the model's token
    assert len(step()) == 8 and proposer.cap("r") == 8
    output.extend(text[5:14])
    assert len(step()) == 16 and proposer.cap("r") == 16
    # the model leaves the copy after 3 drafts: its own token differs, the cap halves
    draft = step()
    output.extend(draft[:3] + [999])
    assert proposer.num_observed == 2
    step()
    assert proposer.cap("r") == 8 and proposer.num_observed == 3
    proposer.release("r")
    assert proposer.cap("r") is None


def test_adaptive_cap_never_drops_below_the_accepted_count() -> None:
    proposer = adaptive()
    prompt = list(range(50)) + [99] + list(range(20))
    output: list[int] = []
    [draft] = proposer.propose([DraftRequest("r", prompt, output, 4)])
    output.extend(draft.token_ids + [24])   # 4 of 4 accepted, then the model's own token
    [draft] = proposer.propose([DraftRequest("r", prompt, output, 16)])
    assert proposer.cap("r") == 8 and len(draft.token_ids) == 8
    output.extend(draft.token_ids[:7] + [555])   # 7 of 8: half the cap (4) would lose what was earned
    proposer.propose([DraftRequest("r", prompt, output, 16)])
    assert proposer.cap("r") == 8


def test_factory_builds_the_configured_length() -> None:
    config = SpeculativeConfig(speculative_algorithm="NGRAM")
    assert config.ngram_draft_length == "adaptive" and config.max_draft_tokens == 24
    proposer = make_proposer(config)
    assert isinstance(proposer, NgramProposer) and proposer.is_adaptive
    fixed = SpeculativeConfig(speculative_algorithm="NGRAM", ngram_draft_length="fixed")
    assert fixed.max_draft_tokens == 5
    proposer = make_proposer(fixed)
    assert isinstance(proposer, NgramProposer) and not proposer.is_adaptive
    assert SpeculativeConfig(speculative_algorithm="NGRAM", num_speculative_tokens=7).max_draft_tokens == 7
    with pytest.raises(ValueError, match="--ngram-draft-length"):
        SpeculativeConfig(speculative_algorithm="NGRAM", ngram_draft_length="greedy")
