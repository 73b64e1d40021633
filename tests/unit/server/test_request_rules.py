"""Each request rule is written once (issue 31, part 4) and every route gives the same answer:
the empty prompt, stop strings without a tokenizer, greedy, the output budget."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import FakeEngine

from servelm.sampling.params import GREEDY_TEMPERATURE, SamplingParams


def _error(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_greedy_has_one_definition_the_samplers() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 10).is_greedy  # the sampler takes its argmax
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_the_output_budget_counts_what_a_request_may_still_append() -> None:
    params = SamplingParams(max_tokens=5)
    assert params.num_appendable_tokens(0) == 4  # the next step samples one, four more may follow
    assert params.num_appendable_tokens(4) == 0
    assert SamplingParams(max_tokens=None).num_appendable_tokens(100) is None


@pytest.mark.parametrize("use_tgi_api", [False, True])
def test_stop_strings_without_a_tokenizer_are_refused_alike_on_every_route(make_client: Any,
                                                                          use_tgi_api: bool) -> None:
    client = make_client(FakeEngine(None), model={"skip_tokenizer_init": True}, use_tgi_api=use_tgi_api)
    completion = _error(client.post("/v1/completions", json={"prompt": [1, 2], "stop": "x"}))
    assert completion["param"] == "stop" and "use stop_token_ids" in completion["message"]
    if use_tgi_api:  # TGI has no stop token ids to suggest
        tgi = _error(client.post("/generate", json={"inputs": "x", "parameters": {"stop": ["x"]}}))
        assert tgi["param"] == "parameters.stop" and tgi["message"].startswith("stop strings need a tokenizer")
        assert "stop_token_ids" not in tgi["message"]
    else:
        native = _error(client.post("/generate", json={"input_ids": [1, 2],
                                                       "sampling_params": {"stop": "x"}}))
        assert native["param"] == "sampling_params.stop"
        assert "use sampling_params.stop_token_ids" in native["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"input_ids": [[1], []]}, "input_ids"),
])
def test_an_empty_prompt_gets_one_answer(client: Any, path: str, body: dict[str, Any],
                                         param: str) -> None:
    error = _error(client.post(path, json=body))
    assert error["message"] == "the prompt must not be empty" and error["param"] == param


def test_an_empty_tgi_input_gets_the_same_answer(engine: FakeEngine, make_client: Any) -> None:
    error = _error(make_client(engine, use_tgi_api=True).post("/generate", json={"inputs": ""}))
    assert error["message"] == "the prompt must not be empty" and error["param"] == "inputs"
