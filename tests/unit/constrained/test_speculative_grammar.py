"""Structured output under speculative decoding (fake model, one-token-per-byte tokenizer, each
installed backend): each verify row is masked with the grammar's state after the drafts before it
(the matcher advances over them and rolls back), so outputs equal plain decoding's, sampled with
seeds included, whether the drafts follow the grammar or break it."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from servelm.config import EngineConfig, SpeculativeConfig, StructuredOutputConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams, StructuredSpec
from servelm.spec.proposer import Draft, DraftRequest
from tests.unit.engine.fake_runner import FakeRunner

from .test_grammar import SCHEMA, backend, installed_backends, tokenizer  # noqa: F401 (fixtures)


class ReplayProposer:
    """Proposes the plain run's own continuation, with one byte in three replaced by a random one
    (usually one the grammar forbids)."""

    name = "REPLAY"

    def __init__(self, reference: dict[str, list[int]], vocab_size: int, noise: float) -> None:
        self.reference = reference
        self.vocab_size = vocab_size
        self.noise = noise
        self.rng = random.Random(0)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            done = len(r.output_token_ids)
            tokens = self.reference[r.request_id][done:done + r.max_draft_tokens]
            drafts.append(Draft([self.rng.randrange(self.vocab_size) if self.rng.random() < self.noise
                                 else t for t in tokens]))
        return drafts

    def release(self, request_id: str) -> None:
        pass


def make_engine(tokenizer, backend: str, jump_forward: bool, proposer=None) -> LLMEngine:  # noqa: F811
    speculative = SpeculativeConfig(speculative_algorithm="NGRAM" if proposer else None,
                                    num_speculative_tokens=5)
    config = EngineConfig(structured=StructuredOutputConfig(grammar_backend=backend,
                                                            disable_jump_forward=not jump_forward),
                          speculative=speculative)
    runner = FakeRunner(num_blocks=128, block_size=4, vocab_size=len(tokenizer))
    return LLMEngine(config, runner=runner, tokenizer=tokenizer,
                     eos_token_ids=[tokenizer.eos_token_id], context_length=512, proposer=proposer)


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str]]:
    for request_id, params in requests.items():
        assert engine.add_request(request_id, [5, 6, 7], params) is None
    results: dict[str, tuple[list[int], str]] = {r: ([], "") for r in requests}
    while engine.has_unfinished():
        for output in engine.step():
            tokens, text = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, text + output.new_text)
            if output.is_finished:
                assert output.finish_reason == "stop", output.error
    return results


# the default run: drafts partly right (some accepted, some rejected) with jump-forward on, per
# backend; every other pairing with -m slow
@pytest.mark.parametrize("jump_forward, noise", [
    (True, 0.34), *(pytest.param(jump, noise, marks=pytest.mark.slow)
                    for jump in (True, False) for noise in (0.0, 0.34, 1.0) if (jump, noise) != (True, 0.34))])
def test_json_schema_outputs_equal_plain_decoding(tokenizer, backend, jump_forward, noise):  # noqa: F811
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    requests = {f"s{seed}": SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured=spec)
                for seed in range(4)}
    requests["greedy"] = SamplingParams(temperature=0.0, max_tokens=80, structured=spec)
    plain = run(make_engine(tokenizer, backend, jump_forward), requests)
    proposer = ReplayProposer({r: tokens for r, (tokens, _) in plain.items()}, len(tokenizer), noise)
    engine = make_engine(tokenizer, backend, jump_forward, proposer)
    speculative = run(engine, requests)
    assert speculative == plain
    for _, text in speculative.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if noise == 0.0:
        assert stats["spec_acceptance_rate"] == 1.0
    assert engine.stats()["num_used_blocks"] == 0
