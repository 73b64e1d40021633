"""The xgrammar grammar backend: JSON schema, regex, EBNF and choice grammars over a HF tokenizer.

Bitmasks are xgrammar's packed int32 rows (bit i of word j is token 32*j + i), applied to a whole
batch of logits rows in one call. Stop tokens are the model's EOS ids: a complete grammar allows
only them, and accepting one terminates the matcher.
"""

from __future__ import annotations

from typing import Any

import torch
import xgrammar as xgr

from servelm.constrained.ebnf_check import check_finite
from servelm.constrained.grammar import GrammarError, choice_to_ebnf, parse_json_schema

COMPILER_CACHE_BYTES = 256 << 20
"""Bound on the compiled grammars xgrammar's compiler keeps (its default is unbounded)."""


def _clean(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ".cc:" in text.split(" ", 1)[0]:
        text = text.split(" ", 1)[1] if " " in text else text
    return text.strip()


def _json_options(whitespace_pattern: str | None) -> dict[str, Any]:
    # Compact JSON ("a":1, no newlines) unless a whitespace pattern asks for flexible spacing:
    # small models given free whitespace can loop on spaces until max_tokens.
    if whitespace_pattern is None:
        return {"any_whitespace": False}
    return {"any_whitespace": True}


def grammar_from_spec(kind: str, spec: str, whitespace_pattern: str | None = None,
                      is_checked: bool = False) -> xgr.Grammar:
    """Build the (tokenizer-free) grammar; raises GrammarError naming what is wrong, including a
    grammar with no finite output (xgrammar's compiler would allocate without bound on it).
    ``is_checked``: a compile process already built and checked this spec, so the checks that
    only name a problem (the schema's parse, the finiteness walk: 0.2-0.5 s for a few hundred
    properties, longer than xgrammar's compile) are skipped."""
    grammar = _build(kind, spec, whitespace_pattern, is_checked)
    if not is_checked:
        check_finite(str(grammar))
    return grammar


def _build(kind: str, spec: str, whitespace_pattern: str | None, is_checked: bool) -> xgr.Grammar:
    try:
        if kind == "json":
            if not is_checked:
                parse_json_schema(spec)  # names a bad schema's problem; xgrammar takes the text
            return xgr.Grammar.from_json_schema(spec, **_json_options(whitespace_pattern))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **_json_options(whitespace_pattern))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_to_ebnf(spec))
    except GrammarError:
        raise
    except Exception as error:  # xgrammar raises RuntimeError/ValueError with a parser message
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                "ebnf": "EBNF grammar", "choice": "choice list"}[kind]
        raise GrammarError(f"invalid {what}: {_clean(error)}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


class XGrammarMatcher:
    """A GrammarMatcher over xgrammar.GrammarMatcher."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def forced_text(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return str(self._matcher.find_jump_forward_string())


class XGrammarBackend:
    """Compiles specs against one tokenizer; see servelm.constrained.grammar.GrammarBackend."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 whitespace_pattern: str | None = None, max_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # One thread per compile: compiles already run on the engine's compile workers.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                            cache_limit_bytes=COMPILER_CACHE_BYTES)

    def validate(self, kind: str, spec: str) -> None:
        grammar_from_spec(kind, spec, self.whitespace_pattern)

    def compile(self, kind: str, spec: str, is_checked: bool = False) -> xgr.CompiledGrammar:
        grammar = grammar_from_spec(kind, spec, self.whitespace_pattern, is_checked)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as error:
            raise GrammarError(f"grammar failed to compile: {_clean(error)}") from None

    def make_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab_size)
