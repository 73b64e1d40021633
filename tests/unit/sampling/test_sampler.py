"""Sampler: greedy, sampling filters, seeding, and the per-row processors end to end."""

from __future__ import annotations


import pytest
import torch

from servelm.sampling.sampler import Sampler, SamplingRow

VOCAB = 50


def test_greedy_equals_argmax(make_row, random_logits):
    rows = [make_row(temperature=0.0) for _ in range(random_logits.shape[0])]
    out = Sampler(seed=0)(random_logits, rows)
    assert out.token_ids == random_logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_greedy_ties_go_to_lowest_id(make_row):
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [7.0, 7.0, 7.0, 7.0]])
    out = Sampler(seed=0)(logits, [make_row(temperature=0.0), make_row(temperature=0.0)])
    assert out.token_ids == [1, 0]


def test_known_argmax_is_taken_for_greedy_rows_only(make_row, random_logits):
    """The caller's argmax of a row (the LM-head screen's) is that row's token, unsearched; the other
    greedy rows are searched and the sampled rows sampled exactly as without it."""
    expected = random_logits.argmax(dim=-1).tolist()
    greedy = [make_row(temperature=0.0) for _ in range(6)]
    wrong = {0: (expected[0] + 1) % VOCAB, 4: (expected[4] + 2) % VOCAB}   # visibly not the rows' argmax
    out = Sampler(seed=0)(random_logits, greedy, wrong)
    assert out.token_ids == [wrong[0], *expected[1:4], wrong[4], expected[5]]
    everything = {row: (token + 3) % VOCAB for row, token in enumerate(expected)}
    assert Sampler(seed=0)(random_logits, greedy, everything).token_ids == [everything[r] for r in range(6)]
    mixed = [make_row(temperature=0.0) if i % 2 == 0 else make_row(temperature=1.2, seed=40 + i) for i in range(6)]
    plain = Sampler(seed=0)(random_logits, mixed).token_ids
    known = {2: wrong[0], 3: 0}   # row 3 samples: its entry is not used
    assert Sampler(seed=0)(random_logits, mixed, known).token_ids == [plain[0], plain[1], wrong[0], *plain[3:]]


def test_sampler_does_not_modify_input(make_row, random_logits):
    before = random_logits.clone()
    rows = [make_row(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                     frequency_penalty=0.5, presence_penalty=0.5, logit_bias={3: 5.0},
                     min_tokens=2, prompt=[1, 2], output=[4], eos=[7], logprobs=2)
            for _ in range(random_logits.shape[0])]
    Sampler(seed=0)(random_logits, rows)
    assert torch.equal(random_logits, before)


def test_greedy_rows_unaffected_by_sampled_rows(make_row, random_logits):
    rows = [make_row(temperature=0.0) if i % 2 == 0 else make_row(temperature=1.5, top_p=0.8)
            for i in range(random_logits.shape[0])]
    expected = random_logits.argmax(dim=-1).tolist()
    for seed in range(5):
        out = Sampler(seed=seed)(random_logits, rows)
        assert out.token_ids[0::2] == expected[0::2]


def test_top_k_one_equals_greedy(make_row, random_logits):
    rows = [make_row(temperature=1.0, top_k=1) for _ in range(random_logits.shape[0])]
    for seed in range(3):
        assert Sampler(seed=seed)(random_logits, rows).token_ids == random_logits.argmax(-1).tolist()


def test_top_k_one_keeps_lowest_id_on_ties(make_row):
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0]])
    for seed in range(5):
        assert Sampler(seed=seed)(logits, [make_row(top_k=1)]).token_ids == [1]


def test_tiny_top_p_equals_greedy(make_row, random_logits):
    rows = [make_row(temperature=2.0, top_p=1e-6) for _ in range(random_logits.shape[0])]
    for seed in range(3):
        assert Sampler(seed=seed)(random_logits, rows).token_ids == random_logits.argmax(-1).tolist()


def test_tiny_temperature_is_greedy(make_row, random_logits):
    rows = [make_row(temperature=1e-9) for _ in range(random_logits.shape[0])]
    assert Sampler(seed=0)(random_logits, rows).token_ids == random_logits.argmax(-1).tolist()


def _draw(rows: list[SamplingRow], probs: list[float], seed: int = 0) -> list[int]:
    """Sample each row once from the same distribution (logits = log probs)."""
    logits = torch.tensor(probs).log().expand(len(rows), -1).contiguous()
    return Sampler(seed=seed)(logits, rows).token_ids


def _chi_square(samples: list[int], expected_probs: list[float]) -> float:
    counts = [samples.count(i) for i in range(len(expected_probs))]
    total = len(samples)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, expected_probs) if p > 0)


PROBS = [0.5, 0.3, 0.15, 0.05]
CHI2_LIMIT_DF3 = 16.27  # p = 0.001 for 3 degrees of freedom; draws are fixed-seed anyway


def test_sampling_matches_distribution_unseeded(make_row):
    samples = _draw([make_row() for _ in range(4000)], PROBS)
    assert _chi_square(samples, PROBS) < CHI2_LIMIT_DF3


def test_sampling_matches_distribution_across_seeds(make_row):
    samples = _draw([make_row(seed=s) for s in range(4000)], PROBS)
    assert _chi_square(samples, PROBS) < CHI2_LIMIT_DF3


def test_seeded_row_over_steps_matches_distribution(make_row):
    # One seed, many steps: the per-step streams must be independent of each other.
    samples = _draw([make_row(seed=42, output=[0] * step) for step in range(4000)], PROBS)
    assert _chi_square(samples, PROBS) < CHI2_LIMIT_DF3


def test_temperature_reshapes_distribution(make_row):
    temperature = 2.0
    tempered = [p ** (1 / temperature) for p in PROBS]
    expected = [t / sum(tempered) for t in tempered]
    samples = _draw([make_row(temperature=temperature) for _ in range(4000)], PROBS)
    assert _chi_square(samples, expected) < CHI2_LIMIT_DF3


@pytest.mark.parametrize("kwargs, kept", [
    ({"top_k": 2}, [0, 1]),
    ({"top_p": 0.7}, [0, 1]),        # mass before token 2 is 0.8 >= 0.7
    ({"top_p": 0.85}, [0, 1, 2]),    # mass before token 3 is 0.95 >= 0.85
    ({"min_p": 0.5}, [0, 1]),        # threshold 0.25
    ({"min_p": 0.2}, [0, 1, 2]),     # threshold 0.10
    ({"top_k": 3, "top_p": 0.6}, [0, 1]),  # top_p on the top-3 renormalised: 0.526, 0.842
])
def test_filters_keep_renormalised_distribution(make_row, kwargs, kept):
    samples = _draw([make_row(**kwargs) for _ in range(3000)], PROBS)
    assert set(samples) == set(kept)
    mass = sum(PROBS[i] for i in kept)
    expected = [PROBS[i] / mass if i in kept else 0.0 for i in range(len(PROBS))]
    # df = len(kept) - 1 <= 2; 13.8 is p = 0.001 for df 2.
    assert _chi_square(samples, expected) < 13.8


def test_min_p_filters_on_a_single_row(make_row):
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, 2.95]])
    seen = {Sampler(seed=s)(logits, [make_row(min_p=0.8)]).token_ids[0] for s in range(60)}
    # exp(-0.1) = 0.905 >= 0.8 keeps tokens 0, 1 and 4; exp(-3) drops 2 and 3.
    assert seen == {0, 1, 4}


def _seeded_tokens(logits_row: torch.Tensor, seed: int, steps: int, **params: object):
    """What `seed` picks at each step, sampled alone."""
    from servelm.sampling.params import SamplingParams

    sampler = Sampler()
    tokens = []
    for step in range(steps):
        row = SamplingRow(SamplingParams(seed=seed, **params), [1, 2, 3], [5] * step, [])  # type: ignore[arg-type]
        tokens.append(sampler(logits_row[None, :], [row]).token_ids[0])
    return tokens


def test_seeded_row_independent_of_batch(make_row):
    generator = torch.Generator().manual_seed(7)
    target = torch.randn(VOCAB, generator=generator)  # flat enough that draws vary
    alone = _seeded_tokens(target, seed=123, steps=8, top_p=0.95, temperature=1.3)
    assert len(set(alone)) > 1

    for batch_size, position in [(2, 0), (5, 3), (9, 8)]:
        sampler = Sampler()  # unseeded shared generator: other rows draw differently each time
        for step in range(8):
            others = torch.randn(batch_size, VOCAB, generator=generator) * 2
            logits = others.clone()
            logits[position] = target
            rows = [make_row(temperature=0.9, top_k=10, seed=None if i % 2 else 999 + i,
                             repetition_penalty=1.2, output=[3, 4], logprobs=2)
                    if i % 3 else make_row(temperature=0.0, logit_bias={1: 4.0})
                    for i in range(batch_size)]
            rows[position] = make_row(seed=123, top_p=0.95, temperature=1.3, prompt=[1, 2, 3],
                                      output=[5] * step)
            assert sampler(logits, rows).token_ids[position] == alone[step]


def test_different_seeds_differ():
    generator = torch.Generator().manual_seed(8)
    target = torch.randn(VOCAB, generator=generator)
    first = _seeded_tokens(target, seed=1, steps=12)
    second = _seeded_tokens(target, seed=2, steps=12)
    assert first == _seeded_tokens(target, seed=1, steps=12)
    assert first != second


def test_logit_bias_forces_token(make_row, random_logits):
    row_logits = random_logits[:1]
    least_likely = int(row_logits.argmin())
    for temperature in (0.0, 1.0):
        out = Sampler(seed=0)(row_logits, [make_row(temperature=temperature,
                                                    logit_bias={least_likely: 100.0})])
        assert out.token_ids == [least_likely]


def test_logit_bias_can_ban_token(make_row):
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert Sampler(seed=0)(logits, [make_row(temperature=0.0, logit_bias={0: -100.0})]).token_ids == [1]


def test_min_tokens_suppresses_eos_and_stop_token_ids(make_row):
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # eos 1 and stop id 2 dominate
    sampler = Sampler(seed=0)

    def pick(num_output: int) -> int:
        row = make_row(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[2],
                       eos=[1], output=[0] * num_output)
        return sampler(logits, [row]).token_ids[0]

    assert [pick(n) for n in range(5)] == [3, 3, 3, 1, 1]


def test_min_tokens_suppresses_every_eos_id_when_sampling(make_row):
    logits = torch.tensor([[10.0, 10.0, 0.0, 0.0]])
    rows = [make_row(min_tokens=1, eos=[0, 1], seed=s) for s in range(40)]
    assert set(Sampler(seed=0)(logits.expand(40, -1), rows).token_ids) <= {2, 3}


def test_penalties_change_greedy_choice(make_row):
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    sampler = Sampler(seed=0)
    assert sampler(logits, [make_row(temperature=0.0, output=[0])]).token_ids == [0]
    assert sampler(logits, [make_row(temperature=0.0, output=[0], presence_penalty=0.5)]).token_ids == [1]
    assert sampler(logits, [make_row(temperature=0.0, prompt=[0], repetition_penalty=1.2)]).token_ids == [1]
    # frequency/presence ignore the prompt
    assert sampler(logits, [make_row(temperature=0.0, prompt=[0], frequency_penalty=2.0)]).token_ids == [0]


def test_logprobs_are_raw_log_softmax(make_row, random_logits):
    rows = [make_row(temperature=0.0, logprobs=3),
            make_row(temperature=0.0),
            make_row(temperature=0.8, logprobs=0, logit_bias={2: 50.0}),
            make_row(temperature=1.0, logprobs=5, repetition_penalty=1.5, prompt=[1, 2]),
            make_row(temperature=0.0, logprobs=20),
            make_row(temperature=2.0)]
    out = Sampler(seed=0)(random_logits, rows)
    expected = torch.log_softmax(random_logits, dim=-1)
    assert out.logprobs is not None
    assert out.logprobs[1] is None and out.logprobs[5] is None
    for i, k in [(0, 3), (2, 0), (3, 5), (4, 20)]:
        entry = out.logprobs[i]
        assert entry is not None
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(float(expected[i, entry.token_id]), abs=1e-6)
        assert len(entry.top) == k
        order = expected[i].argsort(descending=True)[:k].tolist()
        assert [t for t, _ in entry.top] == order
        assert [v for _, v in entry.top] == pytest.approx(expected[i, order].tolist(), abs=1e-6)
    assert out.token_ids[2] == 2  # biased, yet its logprob is the raw one
    assert out.logprobs[2].logprob < -1.0
