"""The llguidance grammar backend (``--grammar-backend llguidance``): JSON schema, regex, EBNF/Lark
and choice grammars over a HF fast tokenizer.

llguidance builds token masks lazily from a lexer and an Earley parser, so compiling is cheap
(no per-grammar token-mask precomputation as in xgrammar) and the work happens when a mask is
filled. Bitmasks use the same packed int32 layout as xgrammar's (bit i of word j is token
32*j + i), so the executor treats both backends alike.

Invariants:
- The "compiled grammar" is a fresh LLMatcher built (on a compile worker: building the lexer is
  the slow part, 9 s for 10k properties) from llguidance's grammar text; each request's matcher
  is a deep copy of it (cheap). Every matcher runs under ``LIMITS``, so the lexer states and
  Earley items one grammar may build are bounded.
- Stop tokens are the model's EOS ids. The matcher is terminated once the grammar is complete and
  can take nothing but EOS (llguidance's "stopped" state), so a request may end one step before
  the EOS token xgrammar would sample; the output text is the same. A stopped matcher (reached by
  jump-forward, which does not check termination) accepts exactly the stop tokens.
- JSON uses the separators ", " and ": " with no free whitespace (as the xgrammar backend does),
  unless ``--constrained-json-whitespace-pattern`` gives a pattern, which is then used as is.
  An object schema with ``properties`` and no word on other keys allows no other keys (xgrammar's
  strict reading), so the two backends accept the same outputs.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import torch

from servelm.constrained.ebnf_check import check_ebnf_finite
from servelm.constrained.grammar import (GrammarError, apply_packed_bitmask, choice_to_ebnf,
                                         parse_json_schema)

_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar",
         "choice": "choice list"}


def _json_options(whitespace_pattern: str | None) -> dict[str, Any]:
    if whitespace_pattern is None:
        return {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
    return {"item_separator": ",", "key_separator": ":", "whitespace_flexible": True,
            "whitespace_pattern": whitespace_pattern}


LIMITS = llguidance.LLParserLimits(max_lexer_states=50_000, verbose_errors=False)
"""llguidance's defaults but at most 50k lexer states (about 100 MB; default 250k) and no
grammar text in error messages (they reach clients)."""

_LITERAL_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: _strict leaves them alone."""


def _strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever an object schema lists
    ``properties`` and says nothing about other keys: xgrammar's (and OpenAI strict mode's)
    reading, so both backends produce the same objects. Explicit settings are kept."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: value if key in _LITERAL_KEYWORDS else _strict(value) for key, value in schema.items()}
    if "properties" in result and not any(key in result for key in (
            "additionalProperties", "patternProperties", "unevaluatedProperties")):
        result["additionalProperties"] = False
    return result


def grammar_from_spec(kind: str, spec: str, whitespace_pattern: str | None = None,
                      tokenizer: Any = None, is_checked: bool = False) -> str:
    """llguidance's grammar text for (kind, spec), checked; raises GrammarError naming the problem.
    ``is_checked``: a compile process already checked this spec (skips the finiteness walk and
    the validation pass; the matcher's own build still refuses a bad grammar)."""
    try:
        if kind in ("json", "json_object"):
            text = spec if kind == "json" else '{"type": "object"}'
            schema = parse_json_schema(text)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(_strict(schema)),
                overrides=_json_options(whitespace_pattern))  # type: ignore[arg-type]
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind in ("ebnf", "choice"):
            if kind == "ebnf" and not is_checked:
                check_ebnf_finite(spec)  # llguidance would decode a no-way-out grammar to max_tokens
            grammar = llguidance.grammar_from("ebnf", spec if kind == "ebnf" else choice_to_ebnf(spec))
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}")
    except GrammarError:
        raise
    except ValueError as error:
        raise GrammarError(f"invalid {_WHAT[kind]}: {error}") from None
    if is_checked:
        return grammar
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer,
                                                                             limits=LIMITS)
    if is_error:
        raise GrammarError(f"invalid {_WHAT[kind]}: {messages[0] if messages else 'rejected'}")
    return grammar


class LLGuidanceMatcher:
    """A GrammarMatcher over llguidance.LLMatcher."""

    __slots__ = ("_matcher", "_stop_token_ids", "_non_stop_bits", "_num_unconsumed")

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int],
                 non_stop_bits: torch.Tensor) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._non_stop_bits = non_stop_bits
        """A packed bitmask row with every token but the stop tokens set (shared, read-only)."""
        self._num_unconsumed = 0
        """Stop tokens accepted after the matcher stopped (llguidance does not consume them); they
        are always the latest accepts, so a rollback undoes them first."""

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_stopped():  # complete (e.g. after jump-forward): only a stop token
            if token_id not in self._stop_token_ids:
                return False
            self._num_unconsumed += 1
            return True
        if self._matcher.validate_tokens([token_id]) != 1:
            return False  # checked first: a refused consume_token would poison the matcher
        return bool(self._matcher.consume_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        assert target.is_contiguous() and bitmask.dtype == torch.int32
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        # llguidance allows a stop token in a dead state (no text can follow, and the grammar is
        # not complete): clear it, so a dead state is an empty mask under both backends (the
        # compiler refuses such a grammar up front; the scheduler ends a request that reaches one).
        if not self._matcher.is_accepting() and not bool((target & self._non_stop_bits).any()):
            target.zero_()

    def rollback(self, num_tokens: int) -> None:
        unconsumed = min(num_tokens, self._num_unconsumed)
        self._num_unconsumed -= unconsumed
        if num_tokens > unconsumed:
            self._matcher.rollback(num_tokens - unconsumed)
            assert not self._matcher.is_error(), self._matcher.get_error()

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    def forced_text(self) -> str:
        if self._matcher.is_stopped():
            return ""
        # Forced bytes may end inside a UTF-8 sequence: jump only over the complete characters.
        return self._matcher.compute_ff_bytes().decode("utf-8", errors="ignore")


class LLGuidanceBackend:
    """Compiles specs against one tokenizer; see servelm.constrained.grammar.GrammarBackend."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 whitespace_pattern: str | None = None) -> None:
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self.stop_token_ids = frozenset(stop_token_ids)
        self._non_stop_bits = self.allocate_bitmask(1)[0]
        for token_id in self.stop_token_ids:
            if token_id < vocab_size:
                word = (~(1 << (token_id % 32))) & 0xFFFFFFFF   # as a signed int32 below
                self._non_stop_bits[token_id // 32] &= word - (1 << 32) if word >= 1 << 31 else word
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                          eos_token=list(stop_token_ids))
        except ValueError as error:
            raise ValueError(f"--grammar-backend llguidance cannot use this tokenizer: {error}") from None

    def validate(self, kind: str, spec: str) -> None:
        grammar_from_spec(kind, spec, self.whitespace_pattern)

    def compile(self, kind: str, spec: str, is_checked: bool = False) -> llguidance.LLMatcher:
        grammar = grammar_from_spec(kind, spec, self.whitespace_pattern, self.tokenizer, is_checked)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(f"grammar failed to compile: {matcher.get_error()}")
        return matcher

    def make_matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self.stop_token_ids, self._non_stop_bits)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        apply_packed_bitmask(logits, bitmask, self.vocab_size)
