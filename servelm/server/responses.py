"""OpenAI's Responses API (``POST /v1/responses``): text in and out, streamed or not.

A Responses request is translated into the chat request it means (``instructions`` become the
system message, ``input`` the messages, ``text.format`` the response_format), so templates,
sampling, structured output and reasoning parsing are the chat route's own code.

Invariants:
- Only what we implement is accepted: tools, stored conversations (``previous_response_id``),
  background mode and non-text inputs are a 400 naming the field, never silently dropped.
- The streamed events (OpenAI's names and shapes, with ``sequence_number``) add up to the
  non-streamed response: the final ``response.completed`` carries the same object.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from servelm.engine.outputs import RequestOutput
from servelm.errors import EngineRequestError, InvalidRequestError
from servelm.server.chat_outputs import ChatOutputParser
from servelm.server.errors import api_error_from
from servelm.server.openai_serving import (SSE_HEADERS, ChatChoice, _check_stop_strings, _collect,
                                           _submissions, open_stream, render_chat_request)
from servelm.server.protocol import ChatCompletionRequest, _Request, check_supported
from servelm.server.serving import ServingContext, new_id
from servelm.server.streaming import ClientDisconnected, sse
from servelm.server.structured import openai_structured_spec
from servelm.server.structured import validate as validate_structured

_REFUSED = {
    "previous_response_id": "stored conversations are not kept (send the whole input)",
    "conversation": "stored conversations are not kept (send the whole input)",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported",
    "include": "extra output fields (include) are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
}


class ResponsesRequest(_Request):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


@dataclass(frozen=True)
class _Plan:
    """What the Responses request becomes."""

    chat: ChatCompletionRequest
    text_format: dict[str, Any]


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of content parts", where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequestError(f"{where}[{index}]: only text content is supported (got "
                                      f"{kind!r})", f"{where}[{index}].type")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    for index, item in enumerate(request.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequestError(f"input[{index}]: item type {kind!r} is not supported (only "
                                      "messages)", f"input[{index}].type")
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise InvalidRequestError(f"input[{index}].role must be system, developer, user or "
                                      f"assistant, got {role!r}", f"input[{index}].role")
        messages.append({"role": role, "content": _content_text(item.get("content"),
                                                                 f"input[{index}].content")})
    if not messages:
        raise InvalidRequestError("input must not be empty", "input")
    return messages


def _response_format(text: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat response_format, the text.format echoed in the response)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}, fmt
    if kind == "json_schema":
        if "schema" not in fmt:
            raise InvalidRequestError("text.format.schema is required for json_schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt["schema"],
            "strict": fmt.get("strict", False)}}, fmt
    raise InvalidRequestError(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                              "text.format.type")


def _plan(request: ResponsesRequest) -> _Plan:
    for name, reason in _REFUSED.items():
        value = (request.model_extra or {}).get(name)
        if value not in (None, False, []):
            raise InvalidRequestError(f"{name}: {reason}", name)
    if request.tools:
        raise InvalidRequestError("tools are not supported on /v1/responses yet; use "
                                  "/v1/chat/completions", "tools")
    if request.reasoning and request.reasoning.get("effort") is not None:
        raise InvalidRequestError("reasoning.effort is not supported (start the server with "
                                  "--reasoning-parser to see a model's reasoning)", "reasoning.effort")
    response_format, text_format = _response_format(request.text)
    extra = request.model_extra or {}
    chat = ChatCompletionRequest(
        model=request.model, messages=_messages(request), max_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, seed=extra.get("seed"),
        response_format=response_format, priority=request.priority)
    return _Plan(chat=chat, text_format=text_format)


class _ResponseBuilder:
    """Accumulates one response's output items and produces its objects and stream events."""

    def __init__(self, ctx: ServingContext, request: ResponsesRequest, text_format: dict[str, Any],
                 num_prompt_tokens: int) -> None:
        self.ctx = ctx
        self.request = request
        self.text_format = text_format
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.items: list[dict[str, Any]] = []
        self.sequence_number = 0

    def response(self, status: str, choice: ChatChoice | None = None) -> dict[str, Any]:
        incomplete = None
        if choice is not None and choice.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        num_output = choice.num_output_tokens if choice is not None else 0
        usage = None if choice is None else {
            "input_tokens": self.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.num_prompt_tokens + num_output}
        request = self.request
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None, "incomplete_details": incomplete,
                "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "model": self.ctx.served_model_name, "output": list(self.items),
                "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": request.temperature, "top_p": request.top_p,
                "text": {"format": self.text_format}, "tool_choice": "auto", "tools": [],
                "truncation": "disabled", "usage": usage, "user": request.user,
                "metadata": request.metadata or {}}

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n" + sse(body)

    @staticmethod
    def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": content if status == "completed" else []}

    @staticmethod
    def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


async def create_response(ctx: ServingContext, request: ResponsesRequest, raw: Request) -> Response:
    plan = _plan(request)
    chat = plan.chat
    ctx.check_model(chat.model)
    check_supported(chat)
    _check_stop_strings(ctx, chat)
    structured, structured_param = openai_structured_spec(chat)
    await validate_structured(ctx.config, structured, structured_param)
    prompt_text = await render_chat_request(ctx, chat)
    prompt = await ctx.prompt_from_text(prompt_text, chat.max_tokens, add_special_tokens=False,
                                        param="input")
    builder = _ResponseBuilder(ctx, request, plan.text_format, len(prompt.token_ids))
    submissions = _submissions(chat, [prompt], builder.id, structured,
                               ctx.request_priority(chat.priority))
    choice = ChatChoice(ctx, 0, prompt, None)
    parser = ChatOutputParser(ctx.config.server.reasoning_parser, None, prompt_text)

    if not request.stream:
        await _collect(ctx, submissions, raw, lambda index, output: choice.delta(output))
        content, reasoning = choice.text, ""
        if parser.is_active:
            parser.feed(choice.text)
            parser.finish()
            content, reasoning = parser.content, parser.reasoning_content
        if reasoning:
            builder.items.append(builder.reasoning_item(new_id("rs"), reasoning, "completed"))
        builder.items.append(builder.message_item(new_id("msg"), content, "completed"))
        return JSONResponse(builder.response("completed", choice))

    opened = await open_stream(ctx, submissions, raw)
    return StreamingResponse(_events(builder, opened, choice, parser),
                             media_type="text/event-stream", headers=SSE_HEADERS)


class _OpenItem:
    """The output item being streamed (a reasoning item or the message)."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index
        self.id = new_id("rs" if kind == "reasoning" else "msg")
        self.text = ""


async def _events(builder: _ResponseBuilder, opened: AsyncIterator[tuple[int, RequestOutput]],
                  choice: ChatChoice, parser: ChatOutputParser) -> AsyncIterator[str]:
    current: _OpenItem | None = None

    def open_item(kind: str) -> list[str]:
        nonlocal current
        events = close_item()
        current = _OpenItem(kind, len(builder.items))
        make = builder.reasoning_item if kind == "reasoning" else builder.message_item
        events.append(builder.event("response.output_item.added", output_index=current.index,
                                    item=make(current.id, "", "in_progress")))
        if kind == "message":
            events.append(builder.event("response.content_part.added", item_id=current.id,
                                        output_index=current.index, content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def close_item() -> list[str]:
        nonlocal current
        if current is None:
            return []
        item, current = current, None
        if item.kind == "reasoning":
            done = builder.reasoning_item(item.id, item.text, "completed")
            events = [builder.event("response.reasoning_text.done", item_id=item.id,
                                    output_index=item.index, content_index=0, text=item.text)]
        else:
            done = builder.message_item(item.id, item.text, "completed")
            events = [builder.event("response.output_text.done", item_id=item.id,
                                    output_index=item.index, content_index=0, text=item.text,
                                    logprobs=[]),
                      builder.event("response.content_part.done", item_id=item.id,
                                    output_index=item.index, content_index=0,
                                    part=done["content"][0])]
        builder.items.append(done)
        events.append(builder.event("response.output_item.done", output_index=item.index, item=done))
        return events

    def feed(delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            text = delta.get(key)
            if not text:
                continue
            if current is None or current.kind != kind:
                events += open_item(kind)
            assert current is not None
            current.text += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(builder.event(name, item_id=current.id, output_index=current.index,
                                        content_index=0, delta=text, **extra))
        return events

    yield builder.event("response.created", response=builder.response("in_progress"))
    yield builder.event("response.in_progress", response=builder.response("in_progress"))
    try:
        async with aclosing(opened) as outputs:  # type: ignore[type-var]
            async for _, output in outputs:
                if output.finish_reason == "error":
                    raise EngineRequestError.from_output(output)
                text, _ = choice.delta(output)
                delta = parser.feed(text) if parser.is_active else ({"content": text} if text else {})
                if output.finish_reason is not None and parser.is_active:
                    for key, value in parser.finish().items():
                        delta[key] = delta.get(key, "") + value
                for event in feed(delta):
                    yield event
        if not builder.items and current is None:
            for event in open_item("message"):
                yield event
        for event in close_item():
            yield event
        final = builder.response("completed", choice)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield builder.event(kind, response=final)
    except ClientDisconnected:
        return
    except Exception as error:  # the stream has started: report in-band, as OpenAI does
        api_error = api_error_from(error)
        yield builder.event("error", code=api_error.code, message=api_error.message,
                            param=api_error.param)
