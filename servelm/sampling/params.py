"""Per-request sampling parameters, validated once at the edge.

Invariants: a constructed SamplingParams is valid (``validate()`` raised otherwise); it is never
mutated by the engine. A temperature below ``GREEDY_TEMPERATURE`` (0 included) means greedy:
``SamplingParams.is_greedy`` is the one definition the sampler, the verifiers and the engine's
draft requests read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: dividing logits by them overflows float32 for no gain."""


class SamplingParamsError(ValueError):
    """A user-supplied sampling parameter is invalid; the message names the parameter."""


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """A grammar the output must follow (servelm.constrained compiles it).

    kind: "json" (JSON schema text), "json_object" (any object), "regex", "ebnf" or "choice" (a JSON
    list of strings). Compiled grammars are cached per (kind, spec).
    """

    kind: str
    spec: str = ""


MAX_BEAM_WIDTH = 16
"""Widest beam search: each step reads max(2, 1 + number of EOS ids) * width candidates per beam."""


@dataclass(frozen=True, slots=True)
class BeamParams:
    """Beam search instead of sampling (vLLM's ``use_beam_search``; servelm/engine/beam.py).

    ``width`` beams are kept, scored by cumulative log-probability; finished beams are ranked by
    ``sum_logprobs / num_output_tokens ** length_penalty`` as transformers' beam search does.
    One search serves ``num_returns`` client requests: the one with ``rank`` r gets the r-th best.
    """

    width: int
    num_returns: int = 1
    """How many of the best finished beams are returned (the client's n)."""
    rank: int = 0
    """Which of them this request returns (0: the best)."""
    length_penalty: float = 1.0
    """Exponent on the output length in the finished-beam score (> 0 favours longer beams)."""
    early_stopping: bool | str = False
    """True: stop once ``width`` beams finished; False: also stop when no running beam can beat
    the worst finished one at its current length; "never": only when none could at max length."""

    def validate(self) -> None:
        for name in ("width", "num_returns", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SamplingParamsError(f"{name} (beam search) must be an integer, got {value!r}")
        if not 1 <= self.width <= MAX_BEAM_WIDTH:
            raise SamplingParamsError(f"best_of (the beam width; n when best_of is not given) must be "
                                      f"in [1, {MAX_BEAM_WIDTH}] with beam search, got {self.width}")
        if not 1 <= self.num_returns <= self.width:
            raise SamplingParamsError(f"n ({self.num_returns}) must not exceed the beam width "
                                      f"(best_of: {self.width})")
        if not 0 <= self.rank < self.num_returns:
            raise SamplingParamsError(f"rank (beam search) must be in [0, {self.num_returns}), got {self.rank}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise SamplingParamsError(f"length_penalty must be a finite number, got {penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise SamplingParamsError(f'early_stopping must be true, false or "never", got '
                                      f"{self.early_stopping!r}")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request, and when to stop."""

    max_tokens: int | None = 16
    """Most new tokens; None means up to the context limit."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens have been generated."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Same seed, same output, whatever else is in the batch."""
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    """Stop strings: matched across token boundaries and left out of the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the sampled token's logprob plus the top k."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: logprob of each prompt token (after the first) plus the top k."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredSpec | None = None
    """Constrain the output to a grammar (structured output); None: free text."""
    beam: BeamParams | None = None
    """Beam search (deterministic, scored by log-probability) instead of sampling; None: sample."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError naming the first bad field; checks nothing vocab-dependent."""
        self._check_int("max_tokens", self.max_tokens, optional=True)
        self._check_int("min_tokens", self.min_tokens)
        self._check_int("top_k", self.top_k)
        self._check_int("seed", self.seed, optional=True)
        self._check_int("logprobs", self.logprobs, optional=True)
        self._check_int("prompt_logprobs", self.prompt_logprobs, optional=True)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SamplingParamsError(f"{name} must be a finite number, got {value!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingParamsError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 or 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                    raise SamplingParamsError(
                        f"logit_bias keys must be non-negative token ids, got {token_id!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                    raise SamplingParamsError(f"logit_bias for token {token_id} must be in [-100, 100], got {bias!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise SamplingParamsError(f"stop_token_ids must be non-negative token ids, got {token_id!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty strings")
        if isinstance(self.structured, dict):  # {"kind": "regex", "spec": "..."} from offline callers
            self.structured = StructuredSpec(**self.structured)
        if self.structured is not None and self.structured.kind not in (
                "json", "json_object", "regex", "ebnf", "choice"):
            raise SamplingParamsError(f"structured kind must be json, json_object, regex, ebnf or "
                                      f"choice, got {self.structured.kind!r}")
        if isinstance(self.beam, dict):  # {"width": 4, ...} from offline callers
            self.beam = BeamParams(**self.beam)
        if self.beam is not None:
            self.beam.validate()
            self._check_beam_compatible()

    def _check_beam_compatible(self) -> None:
        """Beam search ranks beams by the model's own log-probabilities: every option that would
        change them (or draw at random) is refused rather than silently ignored."""
        refused = {
            "temperature": self.temperature != 0.0,
            "top_p": self.top_p != 1.0, "top_k": self.top_k not in (-1, 0), "min_p": self.min_p != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "logit_bias": bool(self.logit_bias), "min_tokens": self.min_tokens != 0,
            "logprobs": self.logprobs is not None, "prompt_logprobs": self.prompt_logprobs is not None,
            "response_format": self.structured is not None,
        }
        for name, is_set in refused.items():
            if is_set:
                detail = " (beams are deterministic: use temperature 0)" if name == "temperature" else ""
                raise SamplingParamsError(f"{name} is not supported with beam search{detail}")

    def validate_token_ids(self, vocab_size: int) -> None:
        """Raise SamplingParamsError if logit_bias or stop_token_ids name a token >= vocab_size.

        Called by whoever knows the vocabulary (server or engine admission); the sampler indexes
        with these ids and would otherwise fail for the whole batch.
        """
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"logit_bias token id {token_id} is out of range for vocab size {vocab_size}")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids entry {token_id} is out of range for vocab size {vocab_size}")

    @staticmethod
    def _check_int(name: str, value: object, optional: bool = False) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise SamplingParamsError(f"{name} must be an integer, got {value!r}")

    def num_appendable_tokens(self, num_output_tokens: int) -> int | None:
        """The output budget: tokens a request with ``num_output_tokens`` outputs may still append
        beside the one its next step samples (drafts, jump-forward text); None without max_tokens."""
        return None if self.max_tokens is None else self.max_tokens - num_output_tokens - 1

    @property
    def is_greedy(self) -> bool:
        """The one definition of greedy: the sampler takes the argmax (ties to the lowest id)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)
