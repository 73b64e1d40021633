"""SamplingParams validation: one failure per bad field, and the name appears in the message."""

from __future__ import annotations

import math

import pytest

from servelm.sampling.params import SamplingParams, SamplingParamsError


def test_defaults_are_valid():
    params = SamplingParams()
    assert not params.is_greedy and not params.needs_penalties
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(presence_penalty=0.1).needs_penalties


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_bad_field_raises_naming_it(kwargs, name):
    with pytest.raises(SamplingParamsError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": None}, {"top_k": 0}, {"top_k": -1}, {"top_k": 1}, {"temperature": 0},
    {"top_p": 1.0}, {"min_p": 1.0}, {"seed": -5}, {"seed": 2**70}, {"logprobs": 0},
    {"logit_bias": {0: -100, 3: 100}}, {"min_tokens": 4, "max_tokens": 4},
])
def test_edge_values_are_valid(kwargs):
    SamplingParams(**kwargs)


def test_validate_token_ids_against_vocab():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).validate_token_ids(10)
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).validate_token_ids(10)
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).validate_token_ids(10)
