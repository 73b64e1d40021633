"""EAGLE trees on SmolLM2-135M in-process (its real tokenizer; a random-weight EAGLE-3 head, so
mechanics only): the same text, tokens, logprobs and finish as plain decoding for free text, a
stop string inside the output, max_tokens, and a JSON schema (the grammar masks each tree row
after its root path)."""

from __future__ import annotations

import json

import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.model.eagle_checkpoint import main as write_head
from servelm.sampling.params import SamplingParams, StructuredSpec

MODEL = "smollm2-135m"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PROMPT = "Copy the list exactly.\nList: alpha, beta, gamma, delta, epsilon.\nCopy: alpha,"


def run(head: str | None, requests: dict[str, SamplingParams]) -> dict[str, tuple]:
    speculative = SpeculativeConfig() if head is None else SpeculativeConfig(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
        speculative_eagle_topk=3, speculative_num_steps=2, num_speculative_tokens=5)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=MODEL, dtype="float32"),
                                    cache=CacheConfig(max_total_tokens=4096), speculative=speculative))
    ids = engine.tokenizer.encode(PROMPT)
    for request_id, params in requests.items():
        assert engine.add_request(request_id, ids, params) is None
    found: dict[str, list] = {key: [[], "", [], None] for key in requests}
    while engine.has_unfinished():
        for output in engine.step():
            entry = found[output.request_id]
            entry[0] += output.new_token_ids
            entry[1] += output.new_text
            entry[2] += [(lp.token_id, lp.logprob) for lp in output.logprobs or []]
            entry[3] = output.finish_reason
    engine.shutdown()
    return {key: tuple(value if not isinstance(value, list) else tuple(value) for value in entry)
            for key, entry in found.items()}


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    path = tmp_path_factory.mktemp("tree-text") / "head"
    write_head(["--model", MODEL, "--algorithm", "EAGLE3", "--out", str(path)])
    return str(path)


def test_tree_text_equals_plain(head):
    requests = {"free": SamplingParams(temperature=0.0, max_tokens=24, logprobs=1),
                "short": SamplingParams(temperature=0.0, max_tokens=7),
                "stop": SamplingParams(temperature=0.0, max_tokens=24, stop=[", delta"]),
                "json": SamplingParams(temperature=0.0, max_tokens=40,
                                       structured=StructuredSpec("json", json.dumps(SCHEMA)))}
    plain = run(None, requests)
    assert plain["free"][1].startswith(" beta, gamma, delta") and plain["json"][1].startswith("{")
    assert plain["stop"][1] == " beta, gamma" and plain["stop"][3] == "stop"
    assert plain["short"][3] == "length" and len(plain["short"][0]) == 7
    tree = run(head, requests)
    for key in requests:  # tokens, text and finish exactly; logprob values to float rounding
        assert (tree[key][0], tree[key][1], tree[key][3]) == (plain[key][0], plain[key][1], plain[key][3])
        assert [t for t, _ in tree[key][2]] == [t for t, _ in plain[key][2]]
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(tree[key][2], plain[key][2]))
