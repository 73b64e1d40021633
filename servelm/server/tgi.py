"""Hugging Face TGI's API, which LightLLM's ``--use_tgi_api`` switches /generate to (the request
shape is LightLLM's own: ``inputs``, ``parameters``, and ``multimodal_params`` for images).

``POST /generate`` answers ``{"generated_text", "details"}``; ``POST /generate_stream`` streams
one event per token (``{"index", "token", "top_tokens", "generated_text", "details"}``, the last
with the full text and details); ``POST /`` is TGI's compat route (a one-element list, or the
stream when ``stream`` is true), the one the ``text-generation`` client posts to. ``GET /info``
describes the model.

Invariants:
- ``do_sample`` false with no sampling parameter set is greedy (TGI's rule); any of temperature,
  top_k or top_p turns sampling on, as TGI's router does.
- Streamed ``token.text`` values add up to ``generated_text``: the tokens of one engine output
  carry their detokenized text on the last of them (an incomplete UTF-8 character waits, as TGI's
  incremental decoding does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from servelm.engine.outputs import RequestOutput, TokenLogprob
from servelm.errors import EngineRequestError, InvalidRequestError
from servelm.sampling.params import StructuredSpec
from servelm.server.errors import APIError, api_error_from
from servelm.multimodal.front_door import ImageRef
from servelm.server.openai_serving import SSE_HEADERS, open_stream
from servelm.server.protocol import _Request, make_sampling_params
from servelm.server.serving import Prompt, ServingContext, new_id, require_prompt, safe_logprob
from servelm.server.streaming import ClientDisconnected, Submission, sse, stream_outputs
from servelm.server.structured import validate as validate_structured

MAX_STOP_SEQUENCES = 16
MAX_TOP_N_TOKENS = 20


class TGIGrammar(BaseModel):
    type: str
    value: Any


class TGIParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    do_sample: bool = False
    max_new_tokens: int | None = 100
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    return_full_text: bool | None = False
    stop: list[str] = []
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    best_of: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    grammar: TGIGrammar | None = None
    adapter_id: str | None = None


class TGIRequest(_Request):
    inputs: str
    parameters: TGIParameters | None = None
    stream: bool = False
    multimodal_params: dict[str, Any] | None = None
    """LightLLM's images: ``{"images": [{"type": "url" | "base64", "data": ...}]}``; ``inputs``
    carries the model's image marker where each goes."""


def _image_refs(params: dict[str, Any] | None) -> list[ImageRef]:
    """The images of LightLLM's ``multimodal_params`` (audio is refused: images only)."""
    if not params:
        return []
    for key in params:
        if key != "images" and params[key]:
            raise InvalidRequestError(f"multimodal_params.{key} is not supported: this server takes "
                                      "images only", f"multimodal_params.{key}")
    images = params.get("images") or []
    if not isinstance(images, list):
        raise InvalidRequestError("multimodal_params.images must be a list", "multimodal_params.images")
    refs = []
    for index, item in enumerate(images):
        where = f"multimodal_params.images[{index}]"
        kind = item.get("type") if isinstance(item, dict) else None
        data = item.get("data") if isinstance(item, dict) else None
        if kind not in ("url", "base64") or not isinstance(data, str) or not data:
            raise InvalidRequestError(f'{where} must be {{"type": "url" or "base64", "data": ...}}',
                                      where)
        refs.append(ImageRef(data, where, allow_bare_base64=kind == "base64"))
    return refs


def _structured(grammar: TGIGrammar | None) -> StructuredSpec | None:
    if grammar is None:
        return None
    if grammar.type == "json":
        import json
        value = grammar.value if isinstance(grammar.value, str) else json.dumps(grammar.value)
        return StructuredSpec("json", value)
    if grammar.type == "regex" and isinstance(grammar.value, str) and grammar.value:
        return StructuredSpec("regex", grammar.value)
    raise InvalidRequestError("parameters.grammar must be {type: json, value: schema} or "
                              "{type: regex, value: pattern}", "parameters.grammar")


def _check(parameters: TGIParameters) -> None:
    refused = {"typical_p": parameters.typical_p is not None,
               "watermark": parameters.watermark,
               "best_of": parameters.best_of not in (None, 1),
               "adapter_id": parameters.adapter_id is not None}
    for name, is_set in refused.items():
        if is_set:
            raise InvalidRequestError(f"parameters.{name} is not supported", f"parameters.{name}")
    if len(parameters.stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"parameters.stop: at most {MAX_STOP_SEQUENCES} stop sequences",
                                  "parameters.stop")
    if parameters.top_n_tokens is not None and not 0 <= parameters.top_n_tokens <= MAX_TOP_N_TOKENS:
        raise InvalidRequestError(f"parameters.top_n_tokens must be in [0, {MAX_TOP_N_TOKENS}]",
                                  "parameters.top_n_tokens")
    if parameters.truncate is not None and parameters.truncate < 1:
        raise InvalidRequestError("parameters.truncate must be positive", "parameters.truncate")


class _TGIOutput:
    """One request's tokens in TGI's shapes."""

    def __init__(self, ctx: ServingContext, prompt: Prompt, parameters: TGIParameters) -> None:
        self.ctx = ctx
        self.prompt = prompt
        self.parameters = parameters
        self.text = ""
        self.tokens: list[dict[str, Any]] = []
        self.top_tokens: list[list[dict[str, Any]]] = []
        self.prefill: list[dict[str, Any]] = []
        self.finish_reason = "length"
        special = getattr(ctx.tokenizer, "all_special_ids", None) or []
        self.special_ids = set(special)

    def _token(self, token_id: int, logprob: float | None, text: str | None = None) -> dict[str, Any]:
        return {"id": token_id, "text": self.ctx.token_text(token_id) if text is None else text,
                "logprob": None if logprob is None else safe_logprob(logprob),
                "special": token_id in self.special_ids}

    def _top(self, entry: TokenLogprob | None) -> list[dict[str, Any]]:
        count = self.parameters.top_n_tokens or 0
        return [self._token(tid, lp) for tid, lp in (entry.top[:count] if entry else [])]

    def add(self, output: RequestOutput) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """The (token, top tokens) of each new token."""
        if output.prompt_logprobs is not None and not self.prefill:
            for token_id, entry in zip(self.prompt.token_ids, output.prompt_logprobs):
                token = self._token(token_id, entry.logprob if entry else None)
                del token["special"]
                self.prefill.append(token)
        new = []
        logprobs = output.logprobs or [None] * len(output.new_token_ids)
        last = len(output.new_token_ids) - 1
        for position, (token_id, entry) in enumerate(zip(output.new_token_ids, logprobs)):
            text = output.new_text if position == last else ""
            token = self._token(token_id, entry.logprob if entry else None, text)
            new.append((token, self._top(entry)))
            self.tokens.append(token)
            self.top_tokens.append(new[-1][1])
        if not output.new_token_ids and output.new_text and self.tokens:
            self.tokens[-1]["text"] += output.new_text  # text released at the end (stop trimming)
        self.text += output.new_text
        if output.finish_reason == "stop":
            self.finish_reason = "stop_sequence" if isinstance(output.stop_reason, str) else "eos_token"
        elif output.finish_reason is not None:
            self.finish_reason = "length"
        return new

    @property
    def generated_text(self) -> str:
        if self.parameters.return_full_text:
            prefix = self.prompt.text if self.prompt.text is not None else self.ctx.decode(self.prompt.token_ids)
            return prefix + self.text
        return self.text

    def details(self, *, full: bool) -> dict[str, Any]:
        details: dict[str, Any] = {"finish_reason": self.finish_reason,
                                   "generated_tokens": len(self.tokens),
                                   "seed": self.parameters.seed}
        if full:
            details["prefill"] = self.prefill
            details["tokens"] = self.tokens
            details["top_tokens"] = self.top_tokens if self.parameters.top_n_tokens else None
        return details


async def _prepare(ctx: ServingContext, request: TGIRequest) -> tuple[Submission, _TGIOutput]:
    parameters = request.parameters or TGIParameters()
    _check(parameters)
    structured = _structured(parameters.grammar)
    await validate_structured(ctx.config, structured, "parameters.grammar" if structured else None)
    ctx.check_stop(parameters.stop, None, "parameters.stop", token_ids_param=None)
    require_prompt(request.inputs, "inputs")
    refs = _image_refs(request.multimodal_params)
    ctx.multimodal.check(refs)
    images = await ctx.multimodal.load(refs) if refs else None
    expanded = await ctx.multimodal.expand_text(request.inputs, images or [])
    token_ids = await ctx.encode(expanded, add_special_tokens=True, param="inputs")
    text: str | None = request.inputs
    if parameters.truncate is not None and len(token_ids) > parameters.truncate:
        if images:
            raise InvalidRequestError("parameters.truncate would cut a prompt with images (their "
                                      "tokens must stay whole)", "parameters.truncate")
        token_ids, text = token_ids[-parameters.truncate:], None
    prompt = await ctx.prompt_from_ids(token_ids, text, parameters.max_new_tokens, param="inputs",
                                       images=images)
    is_sampling = parameters.do_sample or any(value is not None for value in (
        parameters.temperature, parameters.top_k, parameters.top_p))
    sampling: dict[str, Any] = {"temperature": 0.0}
    if is_sampling:
        sampling = {key: value for key, value in (
            ("temperature", parameters.temperature), ("top_k", parameters.top_k),
            ("top_p", parameters.top_p)) if value is not None}
    for key in ("repetition_penalty", "frequency_penalty"):
        if getattr(parameters, key) is not None:
            sampling[key] = getattr(parameters, key)
    params = make_sampling_params(
        max_tokens=prompt.max_tokens, stop=list(parameters.stop), seed=parameters.seed,
        logprobs=parameters.top_n_tokens or 0,
        prompt_logprobs=0 if parameters.decoder_input_details
        or ctx.config.server.return_all_prompt_logprobs else None,
        structured=structured, **sampling)
    request_id = new_id("tgi")
    submission = Submission(0, request_id, prompt.token_ids, params,
                            ctx.request_priority(request.priority), group=request_id,
                            mm_inputs=prompt.mm_inputs)
    return submission, _TGIOutput(ctx, prompt, parameters)


async def generate(ctx: ServingContext, request: TGIRequest, raw: Request) -> dict[str, Any]:
    """The TGI ``/generate`` body of a request (not streamed)."""
    submission, result = await _prepare(ctx, request)
    try:
        async with aclosing(stream_outputs(ctx.engine, [submission], raw)) as stream:
            async for _, output in stream:
                if output.finish_reason == "error":
                    raise EngineRequestError.from_output(output)
                result.add(output)
    except ClientDisconnected:
        raise APIError(499, "client disconnected") from None
    body: dict[str, Any] = {"generated_text": result.generated_text}
    if result.parameters.details:
        body["details"] = result.details(full=True)
    if ctx.config.server.return_all_prompt_logprobs:  # LightLLM's --return_all_prompt_logprobs
        body["prompt_token_ids"] = list(result.prompt.token_ids)
        body["prompt_logprobs"] = [token["logprob"] for token in result.prefill]
    return body


async def generate_stream(ctx: ServingContext, request: TGIRequest, raw: Request) -> Response:
    submission, result = await _prepare(ctx, request)
    opened = await open_stream(ctx, [submission], raw)
    return StreamingResponse(_events(opened, result), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _events(opened: AsyncIterator[tuple[int, RequestOutput]], result: _TGIOutput
                  ) -> AsyncIterator[str]:
    index = 0
    try:
        async with aclosing(opened) as outputs:  # type: ignore[type-var]
            async for _, output in outputs:
                if output.finish_reason == "error":
                    raise EngineRequestError.from_output(output)
                new = result.add(output)
                for position, (token, top) in enumerate(new):
                    is_last = output.finish_reason is not None and position == len(new) - 1
                    index += 1
                    yield sse({"index": index, "token": token,
                               "top_tokens": top if result.parameters.top_n_tokens else None,
                               "generated_text": result.generated_text if is_last else None,
                               "details": result.details(full=False) if is_last else None})
    except ClientDisconnected:
        return
    except Exception as error:  # the stream has started: TGI reports errors in-band
        api_error = api_error_from(error)
        yield sse({"error": api_error.message, "error_type": api_error.type})


async def route(ctx: ServingContext, request: TGIRequest, raw: Request, *, path: str) -> Response:
    """POST /generate, /generate_stream and / (compat: a list, or the stream)."""
    if path == "/generate_stream" or (path == "/" and request.stream):
        return await generate_stream(ctx, request, raw)
    body = await generate(ctx, request, raw)
    return JSONResponse([body] if path == "/" else body)


def info(ctx: ServingContext, version: str) -> dict[str, Any]:
    model = ctx.config.model
    return {"model_id": ctx.served_model_name, "model_sha": None,
            "model_dtype": str(ctx.engine.model_info.dtype or model.dtype),
            "model_device_type": str(ctx.engine.model_info.device or "cpu"),
            "model_pipeline_tag": "text-generation" if ctx.task == "generate" else "feature-extraction",
            "max_concurrent_requests": ctx.config.scheduler.max_running_requests,
            "max_best_of": 1, "max_stop_sequences": MAX_STOP_SEQUENCES,
            "max_input_tokens": ctx.context_length - 1, "max_input_length": ctx.context_length - 1,
            "max_total_tokens": ctx.context_length, "validation_workers": 1,
            "max_client_batch_size": ctx.config.server.max_sequences_per_request,
            "router": "servelm", "version": version, "sha": None, "docker_label": None}
