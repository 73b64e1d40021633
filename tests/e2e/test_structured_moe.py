"""Structured output (json_schema, xgrammar) on a tiny random Qwen3-MoE: greedy tokens equal
transformers' greedy decoding under the same grammar (the same xgrammar matcher masking its
logits each step), with jump-forward (forced JSON keys and punctuation appended without a model
step) and without it. The tiny tokenizer has one token per ASCII character, so a forced string has
one tokenization and jump-forward may not change a token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, StructuredOutputConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams, StructuredSpec
from tests.reference import load_reference_model
from tests.tiny_models import TINY_VOCAB_SIZE, make_tiny_model_dir, write_tiny_vlm_tokenizer

MAX_TOKENS = 48
NAME = {"type": "string", "pattern": "^[A-Za-z]{1,6}$"}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 3},
]
PROMPTS = [[30, 31, 32, 33, 34, 35], [40, 41, 42], [50, 51, 52, 53]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    write_tiny_vlm_tokenizer(path)
    return path


def transformers_constrained(path: Path, prompts: list[list[int]], schemas: list[dict],
                             stop_token_ids: list[int]) -> list[list[int]]:
    """Greedy under each prompt's grammar, one full forward per token (no cache): xgrammar's matcher
    masks each step's float32 logits; ends with the stop token the grammar allows once complete."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(path)), vocab_size=TINY_VOCAB_SIZE,
                                              stop_token_ids=stop_token_ids)
    compiler = xgr.GrammarCompiler(info)
    model = load_reference_model(path)
    bitmask = xgr.allocate_token_bitmask(1, TINY_VOCAB_SIZE)
    results = []
    for prompt, schema in zip(prompts, schemas, strict=True):
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        tokens: list[int] = []
        with torch.no_grad():
            while len(tokens) < MAX_TOKENS and not matcher.is_terminated():
                logits = model(torch.tensor([prompt + tokens])).logits[:, -1].float()
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=TINY_VOCAB_SIZE)
                token = int(logits.argmax())
                assert matcher.accept_token(token)
                tokens.append(token)
        results.append(tokens)
    return results


@pytest.mark.parametrize("disable_jump_forward", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_json_schema_greedy_equals_transformers_under_the_grammar(model_dir: Path, disable_jump_forward: bool) -> None:
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"), cache=CacheConfig(max_total_tokens=1024),
        structured=StructuredOutputConfig(disable_jump_forward=disable_jump_forward,
                                          disable_grammar_compile_process=True)))
    try:
        for index, (prompt, schema) in enumerate(zip(PROMPTS, SCHEMAS)):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                    structured=StructuredSpec("json", json.dumps(schema)))
            assert engine.add_request(str(index), prompt, params) is None
        tokens: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        num_steps = 0
        while engine.has_unfinished():
            num_steps += 1
            for output in engine.step():
                assert output.error is None, output.error
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason is not None:
                    finished[output.request_id] = output.finish_reason
        stop_token_ids = list(engine.eos_token_ids)
    finally:
        engine.shutdown()
    longest = max(map(len, tokens.values()))
    # one token a step per request, or fewer steps where forced text was appended without one
    assert num_steps < longest if not disable_jump_forward else num_steps >= longest
    references = transformers_constrained(model_dir, PROMPTS, SCHEMAS, stop_token_ids)
    for index, expected in enumerate(references):
        assert expected[-1] in stop_token_ids, "the reference reached max tokens: pick a tighter schema"
        assert finished[str(index)] == "stop"
        assert tokens[str(index)] == expected, (index, tokens[str(index)], expected)
