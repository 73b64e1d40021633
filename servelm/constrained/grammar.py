"""Grammar backends for constrained decoding: the interface, the registry and the compile cache.

A backend turns a (kind, spec) pair into a compiled grammar (once, on a worker thread:
``compiler.GrammarCompiler`` caches them per (kind, spec)) and makes one matcher per engine
request from it. A matcher is the grammar's
state for one output: the engine feeds it every accepted token, asks it which tokens may come next
(a packed bitmask row) and whether it has terminated.

Invariants:
- A matcher has accepted exactly the request's output tokens so far. It lives on the Request (not
  in model/), so preemption, which recomputes K/V but never re-samples, leaves it valid, and each
  of n samples (n engine requests) has its own.
- Kinds: "json" (a JSON schema text), "json_object" (any JSON object; spec ignored), "regex",
  "ebnf" (GBNF-style, ``root`` rule) and "choice" (a JSON list of strings: exactly one of them).
- ``validate_spec`` needs no tokenizer, so the server can reject a bad spec with a 400 before the
  request reaches the engine; ``spec_check`` (size budget, satisfiability) runs there and again
  before every compile.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the CLI checks the backend's package at start-up, before torch is loaded
    import torch

GRAMMAR_KINDS = ("json", "json_object", "regex", "ebnf", "choice")
BACKENDS = ("xgrammar", "outlines", "llguidance", "none")


class GrammarError(ValueError):
    """A schema, regex or grammar is invalid or unsupported; the message names the problem."""


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (the backend's packed layout)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative drafts the model rejected)."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar has accepted its final (stop) token."""
        ...

    def forced_text(self) -> str:
        """Text the grammar allows as the only continuation from here ('' when there is a choice)."""
        ...


class GrammarBackend(Protocol):
    """Compiles specs and applies packed bitmasks to logits."""

    name: str

    def validate(self, kind: str, spec: str) -> None:
        """Raise GrammarError when the spec cannot be compiled (no tokenizer needed)."""
        ...

    def compile(self, kind: str, spec: str, is_checked: bool = False) -> Any:
        """An opaque compiled grammar (slow: runs on a GrammarCompiler worker, never the step).
        ``is_checked``: a compile process already compiled this spec with every check, so only
        the work that builds the result runs."""
        ...

    def make_matcher(self, compiled: Any) -> GrammarMatcher: ...

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor: ...

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set disallowed tokens of each logits row to -inf, in place."""
        ...


def apply_packed_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Set to -inf, in place, every token of ``logits[r]`` whose bit is 0 in ``bitmask[r]``.

    The packed layout is xgrammar's and llguidance's: bit i of int32 word j is token 32*j + i.
    Uses xgrammar's CPU/GPU kernel when it is installed, else plain torch ops.
    """
    try:
        import xgrammar as xgr
    except ImportError:
        pass
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=vocab_size)
        return
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words[:, :, None] >> shifts) & 1).view(words.shape[0], -1)[:, :vocab_size]
    logits[:, :vocab_size].masked_fill_(allowed == 0, float("-inf"))


def parse_json_schema(spec: str) -> dict[str, Any] | bool:
    """A request's JSON schema text, parsed; GrammarError when it is not JSON or not a schema."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as error:
        raise GrammarError(f"JSON schema is not valid JSON: {error}") from None
    except RecursionError:
        raise GrammarError("JSON schema is nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object")
    return schema


def choice_to_ebnf(spec: str) -> str:
    """A "choice" spec (JSON list of strings) as an EBNF grammar: ``root ::= "a" | "b"``."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as error:
        raise GrammarError(f"choice list is not valid JSON: {error}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choices must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _unavailable(name: str) -> Callable[..., GrammarBackend]:
    def factory(*args: Any, **kwargs: Any) -> GrammarBackend:
        raise ValueError(f"--grammar-backend {name} is not available in this build: use xgrammar "
                         "(the default) or none")
    return factory


def _xgrammar(tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
              whitespace_pattern: str | None) -> GrammarBackend:
    from servelm.constrained.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, whitespace_pattern)


def _llguidance(tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                whitespace_pattern: str | None) -> GrammarBackend:
    from servelm.constrained.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids, whitespace_pattern)


BACKEND_FACTORIES: dict[str, Callable[..., GrammarBackend]] = {
    "xgrammar": _xgrammar,
    "outlines": _unavailable("outlines"),
    "llguidance": _llguidance,
}
_BACKEND_PACKAGES = {"xgrammar": "xgrammar", "llguidance": "llguidance"}
"""The package each available backend imports (checked at start-up)."""


def check_backend_installed(name: str) -> None:
    """Raise ValueError when ``name`` cannot be used in this build or its package is not installed.
    Imports nothing (the CLI's check: xgrammar's import alone loads torch and transformers);
    ``check_backend_available`` also imports the package."""
    if name == "none":
        return
    if name not in BACKEND_FACTORIES:
        raise ValueError(f"--grammar-backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name not in _BACKEND_PACKAGES:
        BACKEND_FACTORIES[name]()
    package = _BACKEND_PACKAGES[name]
    if importlib.util.find_spec(package) is None:
        raise ValueError(_missing_package(name, "not installed"))


def check_backend_available(name: str) -> None:
    """Raise ValueError at start-up when ``name`` cannot be used in this build."""
    check_backend_installed(name)
    if name == "none":
        return
    try:
        importlib.import_module(_BACKEND_PACKAGES[name])
    except ImportError as error:
        raise ValueError(_missing_package(name, str(error))) from None


def _missing_package(name: str, reason: str) -> str:
    package = _BACKEND_PACKAGES[name]
    return f"--grammar-backend {name} needs the {package} package (pip install {package}): {reason}"


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 whitespace_pattern: str | None = None) -> GrammarBackend | None:
    """The backend called ``name`` for this tokenizer; None for "none"."""
    if name == "none":
        return None
    check_backend_available(name)
    return BACKEND_FACTORIES[name](tokenizer, vocab_size, stop_token_ids, whitespace_pattern)


def validate_spec(backend_name: str, kind: str, spec: str, whitespace_pattern: str | None = None,
                  max_spec_bytes: int | None = None) -> None:
    """Check a spec without a tokenizer (server side): the size budget (when given), whether it
    can match anything, then the backend's own parse; raises GrammarError naming the problem."""
    from servelm.constrained.spec_check import check_spec

    if backend_name == "none":
        raise GrammarError("structured output is disabled on this server (--grammar-backend none)")
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}")
    check_spec(kind, spec, max_spec_bytes)
    if backend_name == "llguidance":
        from servelm.constrained.llguidance_backend import grammar_from_spec as llguidance_grammar

        llguidance_grammar(kind, spec, whitespace_pattern)
        return
    from servelm.constrained.xgrammar_backend import grammar_from_spec

    grammar_from_spec(kind, spec, whitespace_pattern)
