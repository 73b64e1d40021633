"""OpenAI (and vLLM/SGLang extension) request schemas, and their conversion to SamplingParams.

Invariants:
- Requests accept unknown extra fields (clients send vendor extensions), but a documented field we
  do not implement (best_of > n, logits processors, structural tags, ...) is rejected
  with a 400 naming it by ``check_supported``; nothing the user asked for is silently ignored.
- Value checks live in SamplingParams.validate(); this module only maps names and types, so each
  rule is written once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from servelm.errors import InvalidRequestError
from servelm.sampling.params import BeamParams, SamplingParams, SamplingParamsError, StructuredSpec

MAX_N = 128
"""Most choices one request may ask for; each is a separate engine request."""


def _first_unencodable(value: Any, path: str) -> str | None:
    """The path of the first string in ``value`` that is not valid Unicode text, or None.

    JSON may carry a lone UTF-16 surrogate ("\\ud800"); Python decodes it into a str that no
    tokenizer, template or UTF-8 writer accepts, so it is refused here, once, for every route.
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode()
            where = f"{path}.{name}" if path else name
            found = _first_unencodable(key, where) or _first_unencodable(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _first_unencodable(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    priority: int | None = None
    """Scheduling priority; only with --enable-priority-scheduling / --scheduling-policy priority."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        where = _first_unencodable(data, "")
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "{where}: the text contains a lone UTF-16 "
                                      "surrogate (such as \\ud800), which is not valid Unicode",
                                      {"where": where})
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: bool = False
    """vLLM's beam search: best_of (else n) beams, the n best returned (engine/beam.py)."""
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    """OpenAI's default for legacy completions; an explicit null means up to the context limit."""
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either a completion-style ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class NativeSamplingParams(BaseModel):
    """SGLang's ``sampling_params`` object of /generate; unknown keys are a 400 (typos matter)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


class GenerateRequest(_Request):
    """SGLang's native /generate request; ``text`` or ``input_ids`` may be a batch (a list)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None
    """The LoRA adapter (its name) to run with; a list gives one per prompt of a batch (None or
    "" for the base model)."""
    image_data: str | dict[str, Any] | list[Any] | None = None
    """The prompt's images: a URL (data:, file://, http(s)), bare base64 or ``{"url": ...}``,
    or a list of them; for a batch, one such entry (or null) per prompt. The prompt text (or
    ids) carries the model's image marker where each goes."""


class LoadLoRAAdapterRequest(BaseModel):
    """SGLang's /load_lora_adapter and vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    pinned: bool = False
    """SGLang: never evict it from memory (refused: --max-loaded-loras evicts only unused ones)."""
    load_inplace: bool = False
    """vLLM: replace an adapter of the same name (refused: unload it first)."""


class UnloadLoRAAdapterRequest(BaseModel):
    """SGLang's /unload_lora_adapter and vLLM's /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None
    """vLLM's optional numeric id; ignored only when absent (refused when given)."""


class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings, plus vLLM's ``truncate_prompt_tokens`` and ``add_special_tokens``."""

    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    """Keep only the last k tokens of each input (-1: as many as the model embeds)."""
    add_special_tokens: bool = True


class EncodeRequest(_Request):
    """SGLang's native /encode: ``text`` or ``input_ids``, one input or a batch (a list)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None


# -- unsupported-parameter checks --------------------------------------------------------------

_GUIDED_FIELDS = ("logits_processors", "prompt_embeds", "lora_request")
"""Structured output (response_format, guided_*, structured_outputs) is read by server/structured.py."""
_CHAT_UNSUPPORTED = ("functions", "function_call", "audio", "prediction", "web_search_options")


def _extra(request: BaseModel) -> dict[str, Any]:
    return request.model_extra or {}


def check_supported(request: _SamplingRequest, beam_mode: bool = False) -> None:
    """Raise InvalidRequestError naming the first documented-but-unimplemented parameter used.

    ``beam_mode`` (--beam-mode): a request with best_of (else n) > 1 that does not set
    use_beam_search gets it (set here, before the checks that depend on it)."""
    if beam_mode and "use_beam_search" not in request.model_fields_set and (request.best_of or request.n) > 1:
        request.use_beam_search = True
    if request.best_of is not None and request.best_of != request.n and not request.use_beam_search:
        raise InvalidRequestError(f"best_of={request.best_of} (different from n={request.n}) is only "
                                  "supported with use_beam_search", "best_of")
    if request.use_beam_search and request.stream:
        raise InvalidRequestError("stream is not supported with use_beam_search: beams are re-ranked "
                                  "until the search ends, so no token is final before then", "stream")
    for name in ("length_penalty", "early_stopping"):
        if name in request.model_fields_set and not request.use_beam_search:
            raise InvalidRequestError(f"{name} only applies with use_beam_search", name)
    extra = _extra(request)
    for name in _GUIDED_FIELDS:
        if extra.get(name) is not None:
            raise InvalidRequestError(f"{name} is not supported yet", name)
    if not 1 <= request.n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {request.n}", "n")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
    if isinstance(request, ChatCompletionRequest):
        for name in _CHAT_UNSUPPORTED:
            if extra.get(name) is not None:
                raise InvalidRequestError(f"{name} is not supported", name)
        modalities = extra.get("modalities")
        if modalities is not None and list(modalities) != ["text"]:
            raise InvalidRequestError("only the text modality is supported", "modalities")
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {request.top_logprobs}",
                                      "top_logprobs")
        if request.add_generation_prompt and request.continue_final_message and \
                "add_generation_prompt" in request.model_fields_set:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both "
                                      "be true", "continue_final_message")


def check_native_supported(params: NativeSamplingParams) -> None:
    for name in ("structural_tag",):
        if getattr(params, name) is not None:
            raise InvalidRequestError(f"sampling_params.{name} is not supported yet (structured "
                                      "output)", f"sampling_params.{name}")
    if not 1 <= params.n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {params.n}", "sampling_params.n")


# -- conversion --------------------------------------------------------------------------------

def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            result[int(key)] = float(value)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                      "logit_bias") from None
    return result


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs), with validation failures turned into a 400 naming the field."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as error:
        message = str(error)
        raise InvalidRequestError(message, message.split(" ", 1)[0]) from None


def _optional(**values: Any) -> dict[str, Any]:
    """Keep only the values the client set, so SamplingParams defaults stay in one place."""
    return {key: value for key, value in values.items() if value is not None}


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                       seed: int | None, structured: StructuredSpec | None = None,
                       choice: int = 0) -> SamplingParams:
    """The SamplingParams of one choice; ``max_tokens`` and ``seed`` are already resolved.
    With use_beam_search, choice i is the i-th best beam of the prompt's search."""
    beam = None
    temperature = request.temperature
    if request.use_beam_search:
        beam = BeamParams(width=request.best_of or request.n, num_returns=request.n, rank=choice,
                          length_penalty=request.length_penalty, early_stopping=request.early_stopping)
        temperature = 0.0 if temperature is None else temperature
    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = request.logprobs
        prompt_logprobs = request.logprobs if request.echo else None
    return make_sampling_params(
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=_stop_list(request.stop),
        stop_token_ids=list(request.stop_token_ids or []),
        seed=seed,
        logit_bias=_logit_bias(request.logit_bias),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        structured=structured,
        beam=beam,
        **_optional(temperature=temperature, top_p=request.top_p, top_k=request.top_k,
                    min_p=request.min_p, frequency_penalty=request.frequency_penalty,
                    presence_penalty=request.presence_penalty,
                    repetition_penalty=request.repetition_penalty),
    )


def native_to_sampling_params(params: NativeSamplingParams, *, max_tokens: int | None,
                              seed: int | None, logprobs: int | None,
                              prompt_logprobs: int | None,
                              structured: StructuredSpec | None = None) -> SamplingParams:
    return make_sampling_params(
        max_tokens=max_tokens,
        min_tokens=params.min_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty,
        stop=_stop_list(params.stop),
        stop_token_ids=list(params.stop_token_ids or []),
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        include_stop_str_in_output=params.no_stop_trim,
        seed=seed,
        logit_bias=_logit_bias(params.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
    )


def requested_max_tokens(request: CompletionRequest | ChatCompletionRequest | NativeSamplingParams
                         ) -> tuple[int | None, bool]:
    """The output budget a request asks for, and whether it is the API's default rather than a
    value the client sent (a default is capped at what the context leaves; a sent value is not).

    Completions: ``max_tokens`` (0 with echo scores the prompt: one token is sampled and dropped,
    ``is_prompt_only``); chat: ``max_completion_tokens``, else ``max_tokens``; SGLang's native
    ``sampling_params``: ``max_new_tokens``. None: up to the context limit."""
    if isinstance(request, NativeSamplingParams):
        return request.max_new_tokens, "max_new_tokens" not in request.model_fields_set
    if isinstance(request, ChatCompletionRequest):
        if request.max_completion_tokens is not None:
            return request.max_completion_tokens, False
        return request.max_tokens, "max_tokens" not in request.model_fields_set
    if is_prompt_only(request):
        return 1, False
    return request.max_tokens, "max_tokens" not in request.model_fields_set


def is_prompt_only(request: CompletionRequest) -> bool:
    """``max_tokens: 0`` with ``echo``: score the prompt, generate nothing (lm-eval's
    loglikelihood requests, as vLLM allows). The engine still samples one token, which is dropped."""
    if request.max_tokens != 0:
        return False
    if not request.echo:
        raise InvalidRequestError("max_tokens 0 is only allowed with echo (to score the prompt)",
                                  "max_tokens")
    return True


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Seed of the ``choice``-th of n samples: distinct yet reproducible (s, s+1, ...)."""
    return None if seed is None else seed + choice
