"""/v1/completions and /v1/chat/completions: prompts in, OpenAI responses or SSE chunks out.

Invariants:
- Every choice is one engine request (n choices per prompt, choice index = prompt * n + i, seed
  s + i); a choice's text and logprobs are built by the same ``*Choice.delta`` for streaming and
  non-streaming, so the concatenated stream equals the non-streamed response.
- All validation happens before the first engine request is submitted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from servelm.engine.outputs import RequestOutput, TokenLogprob
from servelm.errors import EngineRequestError, InvalidRequestError
from servelm.sampling.params import StructuredSpec
from servelm.server.chat import chat_job, first_image_part, render_job, sandbox_job
from servelm.server.chat_outputs import ChatOutputParser, merge_tool_call_entries
from servelm.server.errors import APIError, api_error_from, error_body
from servelm.multimodal.front_door import ImageRef
from servelm.server.protocol import (ChatCompletionRequest, CompletionRequest, check_supported,
                                     choice_seed, is_prompt_only, requested_max_tokens,
                                     to_sampling_params)
from servelm.server.serving import Prompt, ServingContext, new_id, require_prompt, safe_logprob
from servelm.server.disagg import attach_transfers, transfer_params
from servelm.server.streaming import (SSE_DONE, ClientDisconnected, Submission, open_outputs,
                                      sse, stream_outputs)
from servelm.server.structured import (check_tools, forced_tool_spec, openai_structured_spec,
                                       validate as validate_structured)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Choice:
    """Per-choice bookkeeping common to completions and chat."""

    def __init__(self, ctx: ServingContext, index: int, prompt_index: int, prompt: Prompt) -> None:
        self.ctx = ctx
        self.index = index
        self.prompt_index = prompt_index
        self.prompt = prompt
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def record(self, output: RequestOutput) -> None:
        self.num_output_tokens += len(output.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason


class CompletionChoice(_Choice):
    """Turns one choice's engine outputs into (text, logprobs) deltas in the completions shape."""

    def __init__(self, ctx: ServingContext, index: int, prompt_index: int, prompt: Prompt,
                 echo: bool, num_logprobs: int | None, is_prompt_only: bool = False) -> None:
        super().__init__(ctx, index, prompt_index, prompt)
        self.is_echo_pending = echo
        self.is_prompt_only = is_prompt_only
        """max_tokens 0: the one sampled token is not part of the answer."""
        self.num_logprobs = num_logprobs
        self.text_offset = 0
        self.text = ""
        self.logprobs = self._empty_logprobs() if num_logprobs is not None else None

    @staticmethod
    def _empty_logprobs() -> dict[str, list[Any]]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _add(self, logprobs: dict[str, list[Any]], token_id: int, entry: TokenLogprob | None,
             offset: int) -> int:
        token = self.ctx.logprob_token(token_id)
        logprobs["tokens"].append(token)
        logprobs["text_offset"].append(offset)
        if entry is None:
            logprobs["token_logprobs"].append(None)
            logprobs["top_logprobs"].append(None)
        else:
            top = {self.ctx.logprob_token(tid): safe_logprob(lp)
                   for tid, lp in entry.top[:self.num_logprobs]}
            top.setdefault(token, safe_logprob(entry.logprob))
            logprobs["token_logprobs"].append(safe_logprob(entry.logprob))
            logprobs["top_logprobs"].append(top)
        return offset + len(token)

    def delta(self, output: RequestOutput) -> tuple[str, dict[str, list[Any]] | None]:
        if self.is_prompt_only:
            finished = output.finish_reason not in (None, "error", "abort")
            output = dataclasses.replace(
                output, new_token_ids=[], new_text="", logprobs=None,
                finish_reason="length" if finished else output.finish_reason,
                stop_reason=None if finished else output.stop_reason)
        self.record(output)
        text = output.new_text
        logprobs = self._empty_logprobs() if self.num_logprobs is not None else None
        offset = self.text_offset
        if self.is_echo_pending:
            self.is_echo_pending = False
            prompt_ids = self.prompt.token_ids
            echo_text = self.prompt.text if self.prompt.text is not None else self.ctx.decode(prompt_ids)
            if logprobs is not None:
                entries = output.prompt_logprobs or []
                for position, token_id in enumerate(prompt_ids):
                    entry = entries[position] if position < len(entries) else None
                    offset = self._add(logprobs, token_id, entry, offset)
            offset = self.text_offset + len(echo_text)
            text = echo_text + text
        if logprobs is not None and output.logprobs:
            for token_id, entry in zip(output.new_token_ids, output.logprobs):
                offset = self._add(logprobs, token_id, entry, offset)
        self.text_offset += len(text)
        self.text += text
        if logprobs is not None and self.logprobs is not None:
            for key, values in logprobs.items():
                self.logprobs[key].extend(values)
        return text, logprobs


class ChatChoice(_Choice):
    """Turns one choice's engine outputs into content deltas and chat-shaped logprobs."""

    def __init__(self, ctx: ServingContext, index: int, prompt: Prompt, num_logprobs: int | None) -> None:
        super().__init__(ctx, index, 0, prompt)
        self.num_logprobs = num_logprobs
        self.text = ""
        self.logprobs: list[dict[str, Any]] | None = [] if num_logprobs is not None else None

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.ctx.logprob_token(token_id)
        return {"token": token, "logprob": safe_logprob(logprob), "bytes": list(token.encode("utf-8"))}

    def delta(self, output: RequestOutput) -> tuple[str, list[dict[str, Any]] | None]:
        self.record(output)
        logprobs: list[dict[str, Any]] | None = None
        if self.num_logprobs is not None:
            logprobs = []
            for token_id, entry in zip(output.new_token_ids, output.logprobs or []):
                item = self._entry(token_id, entry.logprob)
                item["top_logprobs"] = [self._entry(tid, lp) for tid, lp in entry.top[:self.num_logprobs]]
                logprobs.append(item)
            assert self.logprobs is not None
            self.logprobs.extend(logprobs)
        self.text += output.new_text
        return output.new_text, logprobs


def _usage(choices: list[Any], prompts: list[Prompt], report_cached: bool) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice), as OpenAI does for n > 1. Cached
    prompt tokens are reported only with --enable-cache-report (as SGLang does)."""
    prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
    completion_tokens = sum(choice.num_output_tokens for choice in choices)
    cached: dict[int, int] = {}
    for choice in choices:
        cached[choice.prompt_index] = max(cached.get(choice.prompt_index, 0), choice.num_cached_tokens)
    cached_tokens = sum(cached.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}
            if cached_tokens and report_cached else None}


def _submissions(request: CompletionRequest | ChatCompletionRequest, prompts: list[Prompt],
                 base_id: str, structured: StructuredSpec | None = None,
                 priority: int = 0, lora_name: str | None = None) -> list[Submission]:
    submissions = []
    for prompt_index, prompt in enumerate(prompts):
        for sample in range(request.n):
            index = prompt_index * request.n + sample
            params = to_sampling_params(request, max_tokens=prompt.max_tokens,
                                        seed=choice_seed(request.seed, sample), structured=structured,
                                        choice=sample)
            submissions.append(Submission(index, f"{base_id}-{index}", prompt.token_ids, params,
                                          priority, group=base_id, lora_name=lora_name,
                                          mm_inputs=prompt.mm_inputs))
    return submissions


def _check_stop_strings(ctx: ServingContext, request: CompletionRequest | ChatCompletionRequest) -> None:
    ctx.check_stop(request.stop, request.stop_token_ids)
    if request.logit_bias:
        for key in request.logit_bias:
            if key.lstrip("-").isdigit():
                ctx.check_token_ids([int(key)], "logit_bias")


async def _collect(ctx: ServingContext, submissions: list[Submission], raw: Request,
                   handle: Callable[[int, RequestOutput], None]) -> None:
    """Run submissions to the end, feeding every output to ``handle``; errors raise."""
    try:
        async with aclosing(stream_outputs(ctx.engine, submissions, raw)) as outputs:
            async for index, output in outputs:
                if output.finish_reason == "error":
                    raise EngineRequestError.from_output(output)
                handle(index, output)
    except ClientDisconnected:
        raise APIError(499, "client disconnected") from None


async def open_stream(ctx: ServingContext, submissions: list[Submission], raw: Request
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The engine outputs of a streamed request, once the engine has taken it (see
    streaming.open_outputs): a refusal raises before the 200 and its headers are sent."""
    try:
        return await open_outputs(ctx.engine, submissions, raw)
    except ClientDisconnected:
        raise APIError(499, "client disconnected") from None


async def sse_events(opened: AsyncIterator[tuple[int, RequestOutput]],
                     prelude: list[dict[str, Any]],
                     chunk_for: Callable[[int, RequestOutput], dict[str, Any] | None],
                     final: Callable[[], dict[str, Any] | None]) -> AsyncIterator[str]:
    """The SSE body: prelude chunks, one chunk per useful output, the final chunk, [DONE].

    An error after the stream has started is sent as an error event before [DONE].
    """
    try:
        for chunk in prelude:
            yield sse(chunk)
        async with aclosing(opened) as outputs:  # type: ignore[type-var]
            async for index, output in outputs:
                if output.finish_reason == "error":
                    raise EngineRequestError.from_output(output)
                chunk = chunk_for(index, output)
                if chunk is not None:
                    yield sse(chunk)
        last = final()
        if last is not None:
            yield sse(last)
    except ClientDisconnected:
        return
    except Exception as error:  # the stream has started: report in-band, as OpenAI does
        api_error = api_error_from(error)
        yield sse(error_body(api_error.message, api_error.type, api_error.param, api_error.code))
    yield SSE_DONE


# -- completions -------------------------------------------------------------------------------

async def _completion_prompts(ctx: ServingContext, request: CompletionRequest) -> list[Prompt]:
    raw_prompt = request.prompt
    if isinstance(raw_prompt, str):
        items: list[str | list[int]] = [raw_prompt]
    elif raw_prompt and all(isinstance(item, int) for item in raw_prompt):
        items = [list(raw_prompt)]  # type: ignore[arg-type]
    else:
        items = list(raw_prompt)  # type: ignore[arg-type]
    require_prompt(items, "prompt")
    ctx.check_num_sequences(len(items) * request.n)
    max_tokens, is_default = requested_max_tokens(request)
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(await ctx.prompt_from_text(item, max_tokens,
                                                      add_special_tokens=request.add_special_tokens,
                                                      is_default_max_tokens=is_default))
        else:
            prompts.append(ctx.fit_prompt(list(item), None, max_tokens,
                                          is_default_max_tokens=is_default))
    return prompts


async def create_completion(ctx: ServingContext, request: CompletionRequest, raw: Request) -> Response:
    lora_name = ctx.resolve_model(request.model)
    check_supported(request, ctx.config.server.beam_mode)
    _check_stop_strings(ctx, request)
    structured, structured_param = openai_structured_spec(request)
    await validate_structured(ctx.config, structured, structured_param)
    prompts = await _completion_prompts(ctx, request)
    base_id, created = new_id("cmpl"), int(time.time())
    submissions = _submissions(request, prompts, base_id, structured,
                               ctx.request_priority(request.priority), lora_name)
    attach_transfers(ctx.config, request, submissions)
    report_cached = ctx.config.server.enable_cache_report
    prompt_only = is_prompt_only(request)
    choices = [CompletionChoice(ctx, s.index, s.index // request.n, prompts[s.index // request.n],
                                request.echo, request.logprobs, prompt_only)
               for s in submissions]
    header = {"id": base_id, "object": "text_completion", "created": created,
              "model": request.model if lora_name else ctx.served_model_name}

    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk_for(index: int, output: RequestOutput) -> dict[str, Any] | None:
            text, logprobs = choices[index].delta(output)
            if not text and not (logprobs and logprobs["tokens"]) and output.finish_reason is None:
                return None
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
            chunk = {**header, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            return chunk

        def final() -> dict[str, Any] | None:
            return {**header, "choices": [], "usage": _usage(choices, prompts, report_cached)} if include_usage else None

        opened = await open_stream(ctx, submissions, raw)
        return StreamingResponse(sse_events(opened, [], chunk_for, final),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    await _collect(ctx, submissions, raw, lambda index, output: choices[index].delta(output))
    body = {**header,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in choices],
            "usage": _usage(choices, prompts, report_cached)}
    params = transfer_params(ctx.config, raw, submissions)
    if params is not None:
        body["kv_transfer_params"] = params
    return JSONResponse(body)


# -- chat --------------------------------------------------------------------------------------

async def render_chat_request(ctx: ServingContext, request: Any,
                              tools: list[dict[str, Any]] | None = None
                              ) -> tuple[str, list[ImageRef]]:
    """The prompt text of a chat request (also used by /tokenize with messages), rendered off
    the event loop, and the images its messages carry (unread; refused here at once when the
    model takes none); a request's own template only with --trust-request-chat-template."""
    tokenizer = ctx.require_tokenizer("chat", "messages")
    image_at = first_image_part(request.messages)
    if image_at is not None:
        ctx.multimodal.check_accepts(image_at)
    is_request_template = request.chat_template is not None
    if is_request_template and not ctx.config.server.trust_request_chat_template:
        raise InvalidRequestError("chat_template: this server does not accept chat templates in "
                                  "requests (start it with --trust-request-chat-template)",
                                  "chat_template")
    job = chat_job(tokenizer, request.messages,
                   template=request.chat_template if is_request_template else ctx.chat_template,
                   add_generation_prompt=request.add_generation_prompt,
                   continue_final_message=request.continue_final_message,
                   template_kwargs=request.chat_template_kwargs, tools=tools,
                   content_format=ctx.config.multimodal.chat_template_content_format,
                   image_marker=ctx.multimodal.image_marker)
    images: list[ImageRef] = job.pop("images")
    ctx.multimodal.check(images)
    if is_request_template:
        return await ctx.template_sandbox().render(sandbox_job(tokenizer, job)), images
    return await ctx.run_on_tokenizer_thread(lambda: render_job(tokenizer, job)), images


async def _chat_plan(ctx: ServingContext, request: ChatCompletionRequest
                     ) -> tuple[StructuredSpec | None, list[dict[str, Any]] | None, str | None]:
    """(grammar, tools for the template, tool-call parser) of a chat request; 400s for bad input."""
    structured, structured_param = openai_structured_spec(request)
    functions = check_tools(request.tools, request.tool_choice)
    tool_choice = request.tool_choice or ("auto" if functions else "none")
    if not functions or tool_choice == "none":
        await validate_structured(ctx.config, structured, structured_param)
        return structured, None, None
    tools = [tool for tool in request.tools or []]
    forced = forced_tool_spec(functions, tool_choice, request.parallel_tool_calls)
    if forced is not None:
        if structured is not None:
            raise InvalidRequestError(f"{structured_param} cannot be combined with tool_choice "
                                      f"{tool_choice!r}", structured_param)
        await validate_structured(ctx.config, forced, "tools")
        return forced, tools, "json"
    parser = ctx.tool_parser.parser
    if parser is None:
        raise InvalidRequestError(
            f'tool_choice "auto" needs a tool-call parser and {ctx.tool_parser.reason}: start the '
            'server with --tool-call-parser (or --enable-auto-tool-choice), or use "required" or a '
            "named function", "tool_choice")
    await validate_structured(ctx.config, structured, structured_param)
    return structured, tools, parser


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest,
                                 raw: Request) -> Response:
    lora_name = ctx.resolve_model(request.model)
    check_supported(request, ctx.config.server.beam_mode)
    _check_stop_strings(ctx, request)
    ctx.check_num_sequences(request.n)
    structured, tools, tool_parser = await _chat_plan(ctx, request)
    max_tokens, is_default = requested_max_tokens(request)
    prompt_text, images = await render_chat_request(ctx, request, tools)
    prompt = await ctx.prompt_from_text(prompt_text, max_tokens,
                                        add_special_tokens=request.add_special_tokens,
                                        param="messages", is_default_max_tokens=is_default,
                                        images=images)
    base_id, created = new_id("chatcmpl"), int(time.time())
    submissions = _submissions(request, [prompt], base_id, structured,
                               ctx.request_priority(request.priority), lora_name)
    attach_transfers(ctx.config, request, submissions)
    report_cached = ctx.config.server.enable_cache_report
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    choices = [ChatChoice(ctx, s.index, prompt, num_logprobs) for s in submissions]
    parsers = [ChatOutputParser(ctx.config.server.reasoning_parser, tool_parser, prompt_text)
               for _ in submissions]

    def finish_reason(index: int, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and parsers[index].has_calls else reason

    # vLLM's rule: --response-role when the generation prompt is added, else the last message's.
    role = ctx.config.server.response_role if request.add_generation_prompt or not request.messages \
        else request.messages[-1].role

    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        header = {"id": base_id, "object": "chat.completion.chunk", "created": created,
                  "model": request.model if lora_name else ctx.served_model_name}

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            result = {**header, "choices": [choice]}
            if include_usage:
                result["usage"] = None
            return result

        prelude = [chunk({"index": c.index, "delta": {"role": role, "content": ""},
                          "logprobs": None, "finish_reason": None}) for c in choices]

        def chunk_for(index: int, output: RequestOutput) -> dict[str, Any] | None:
            text, logprobs = choices[index].delta(output)
            delta: dict[str, Any] = {"content": text} if text else {}
            if parsers[index].is_active:
                delta = parsers[index].feed(text)
                if output.finish_reason is not None:
                    for key, value in parsers[index].finish().items():
                        delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
                    if "tool_calls" in delta:  # one entry per call index in a chunk
                        delta["tool_calls"] = merge_tool_call_entries(delta["tool_calls"])
            if not delta and not logprobs and output.finish_reason is None:
                return None
            return chunk({"index": index, "delta": delta,
                          "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
                          "finish_reason": finish_reason(index, output.finish_reason),
                          "stop_reason": output.stop_reason})

        def final() -> dict[str, Any] | None:
            return {**header, "choices": [], "usage": _usage(choices, [prompt], report_cached)} if include_usage else None

        opened = await open_stream(ctx, submissions, raw)
        return StreamingResponse(sse_events(opened, prelude, chunk_for, final),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    await _collect(ctx, submissions, raw, lambda index, output: choices[index].delta(output))
    messages = []
    for choice, parser in zip(choices, parsers):
        if parser.is_active:
            parser.feed(choice.text)
            parser.finish()
            messages.append({**parser.message(), "role": role})
        else:
            messages.append({"role": role, "content": choice.text, "refusal": None})
    body = {"id": base_id, "object": "chat.completion", "created": created,
            "model": request.model if lora_name else ctx.served_model_name,
            "choices": [{"index": c.index,
                         "message": messages[c.index],
                         "logprobs": {"content": c.logprobs, "refusal": None}
                         if c.logprobs is not None else None,
                         "finish_reason": finish_reason(c.index, c.finish_reason),
                         "stop_reason": c.stop_reason}
                        for c in choices],
            "usage": _usage(choices, [prompt], report_cached)}
    params = transfer_params(ctx.config, raw, submissions)
    if params is not None:
        body["kv_transfer_params"] = params
    return JSONResponse(body)
