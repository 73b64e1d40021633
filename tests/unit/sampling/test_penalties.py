"""Logit processors on known numbers."""

from __future__ import annotations

import math

import pytest
import torch

from servelm.sampling.penalties import (
    apply_logit_bias,
    apply_penalties,
    ban_tokens,
)


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0]])
    # token 0 in the prompt, token 1 in the output; 2, 3 unseen; 4 in both.
    apply_penalties(logits, [[0, 4]], [[1, 4]], [2.0], [0.0], [0.0])
    assert logits.tolist() == [[1.0, -4.0, 3.0, -1.0, 2.0]]


def test_frequency_and_presence_penalties_count_output_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    # output: token 0 three times, token 1 once; token 2 only in the prompt.
    apply_penalties(logits, [[2, 2]], [[0, 0, 1, 0]], [1.0], [0.5], [0.25])
    expected = [1.0 - 0.5 * 3 - 0.25, 1.0 - 0.5 * 1 - 0.25, 1.0, 1.0]
    assert logits[0].tolist() == pytest.approx(expected)


def test_negative_frequency_and_presence_encourage_repeats():
    logits = torch.zeros(1, 3)
    apply_penalties(logits, [[]], [[2, 2]], [1.0], [-1.0], [-0.5])
    assert logits[0].tolist() == pytest.approx([0.0, 0.0, 2.5])


def test_all_penalties_combined_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    apply_penalties(logits, [[0], []], [[1, 1], [0]], [2.0, 1.0], [1.0, 0.0], [0.0, 1.0])
    # row 0: repetition on 0 (prompt) and 1 (output), then frequency 1.0 * 2 on token 1
    # row 1: only presence 1.0 on token 0
    assert logits.tolist() == [[1.0, -2.0 - 2.0, 0.5], [1.0, -1.0, 0.5]]


def test_penalties_keep_minus_infinity():
    logits = torch.tensor([[-math.inf, 1.0]])
    apply_penalties(logits, [[0]], [[0, 0]], [1.5], [1.0], [1.0])
    assert logits[0, 0] == -math.inf


def test_logit_bias_accumulates_per_row():
    logits = torch.zeros(2, 3)
    apply_logit_bias(logits, [(0, 1, 2.5), (1, 1, -1.0), (1, 2, 100.0)])
    assert logits.tolist() == [[0.0, 2.5, 0.0], [0.0, -1.0, 100.0]]


def test_ban_tokens():
    logits = torch.zeros(2, 3)
    ban_tokens(logits, [(1, [0, 2]), (0, [])])
    assert logits.tolist() == [[0.0, 0.0, 0.0], [-math.inf, 0.0, -math.inf]]


def test_penalties_on_ragged_rows_including_empty():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]] * 3)
    apply_penalties(logits, [[], [3], []], [[2, 2, 0], [], []], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0],
                    [0.5, 0.5, 0.5])
    # row 0: token 0 seen once, token 2 twice; row 1: token 3 in the prompt only; row 2: nothing.
    assert logits.tolist() == [[0.5 - 1.5, -1.0, 1.0 - 2.5, 0.5],
                               [1.0, -1.0, 2.0, 0.25],
                               [1.0, -1.0, 2.0, 0.5]]
