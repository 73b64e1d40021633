"""OpenAI's Responses API (``POST /v1/responses``): text and function calls, streamed or not.

A Responses request is translated into the chat request it means (``instructions`` become the
system message, ``input`` the messages, ``text.format`` the response_format, function ``tools``
and ``tool_choice`` the chat ones), so templates, sampling, structured output, forced and parsed
tool calls and reasoning parsing are the chat route's own code.

Function calling, in the Responses shapes: ``tools`` holds flat ``{"type": "function", "name",
"parameters"}`` entries; a parsed call comes out as a ``function_call`` output item (``call_id``,
``name``, JSON ``arguments``), streamed as ``response.output_item.added``,
``response.function_call_arguments.delta``/``.done`` and ``response.output_item.done``; the
client sends the call back as a ``function_call`` input item followed by a
``function_call_output`` item with its result (an assistant message with ``tool_calls`` and a
``tool`` message for the template).

Invariants:
- Only what we implement is accepted: non-function tools, stored conversations
  (``previous_response_id``), background mode and inputs other than text and images (``input_image``
  in user messages, as chat image parts: server/multimodal.py) are a 400 naming the field,
  never silently dropped. ``reasoning`` items of an earlier response sent back as input are
  accepted and left out of the prompt, as chat templates leave out earlier turns' reasoning.
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
from servelm.server.openai_serving import (SSE_HEADERS, ChatChoice, _chat_plan, _check_stop_strings,
                                           _collect, _submissions, open_stream, render_chat_request)
from servelm.server.protocol import (ChatCompletionRequest, _Request, check_supported,
                                     requested_max_tokens)
from servelm.server.serving import ServingContext, new_id
from servelm.server.streaming import ClientDisconnected, sse

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
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


@dataclass(frozen=True)
class _Plan:
    """What the Responses request becomes."""

    chat: ChatCompletionRequest
    text_format: dict[str, Any]


def _content_text(content: Any, where: str, allow_images: bool = False) -> str | list[dict[str, Any]]:
    """A Responses content as chat content: its text joined, or, when it holds ``input_image``
    parts (``allow_images``: user messages), a chat content-part list (each image part keeps
    where it came from, for errors)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of content parts", where)
    texts = []
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and allow_images:
            parts.append({**part, "_param": f"{where}[{index}]"})
            continue
        if kind not in ("input_text", "output_text", "text"):
            what = "text and image" if allow_images else "text"
            raise InvalidRequestError(f"{where}[{index}]: only {what} content is supported (got "
                                      f"{kind!r})", f"{where}[{index}].type")
        texts.append(str(part.get("text", "")))
        parts.append({"type": "text", "text": texts[-1]})
    if any(part["type"] == "input_image" for part in parts):
        return parts
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
        if kind == "function_call":
            _add_function_call(messages, item, index)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"input[{index}].call_id must be the call's call_id",
                                          f"input[{index}].call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _content_text(item.get("output", ""), f"input[{index}].output")})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: templates leave it out (module doc)
        elif kind != "message":
            raise InvalidRequestError(f"input[{index}]: item type {kind!r} is not supported (only "
                                      "message, function_call, function_call_output and reasoning)",
                                      f"input[{index}].type")
        else:
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise InvalidRequestError(f"input[{index}].role must be system, developer, user or "
                                          f"assistant, got {role!r}", f"input[{index}].role")
            messages.append({"role": role, "content": _content_text(
                item.get("content"), f"input[{index}].content", allow_images=role == "user")})
    if not any(message["role"] != "system" for message in messages):
        raise InvalidRequestError("input must not be empty", "input")
    return messages


def _add_function_call(messages: list[dict[str, Any]], item: dict[str, Any], index: int) -> None:
    """A ``function_call`` input item: a tool call of the assistant message before it (the text
    the model wrote before its calls), or of a new assistant message."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidRequestError(f"input[{index}].{key} must be a string", f"input[{index}].{key}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _chat_tools(request: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """(chat tools, chat tool_choice) of the Responses ``tools`` and ``tool_choice``."""
    tools = None
    if request.tools:
        tools = []
        for index, tool in enumerate(request.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise InvalidRequestError(f"tools[{index}]: only function tools are supported (got "
                                          f"{kind!r})", f"tools[{index}].type")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise InvalidRequestError(f"tools[{index}].name must be a non-empty string",
                                          f"tools[{index}].name")
            function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
    choice = request.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError("tool_choice must be none, auto, required or "
                                      '{"type": "function", "name": ...}', "tool_choice")
        return tools, {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


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
    if request.reasoning and request.reasoning.get("effort") is not None:
        raise InvalidRequestError("reasoning.effort is not supported (start the server with "
                                  "--reasoning-parser to see a model's reasoning)", "reasoning.effort")
    response_format, text_format = _response_format(request.text)
    tools, tool_choice = _chat_tools(request)
    extra = request.model_extra or {}
    chat = ChatCompletionRequest(
        model=request.model, messages=_messages(request), max_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, seed=extra.get("seed"),
        response_format=response_format, priority=request.priority, tools=tools,
        tool_choice=tool_choice, parallel_tool_calls=request.parallel_tool_calls)
    return _Plan(chat=chat, text_format=text_format)


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as a response lists it (OpenAI's FunctionTool fields)."""
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict", False)}


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
                "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": request.temperature, "top_p": request.top_p,
                "text": {"format": self.text_format}, "tool_choice": request.tool_choice or "auto",
                "tools": [_tool_echo(tool) for tool in request.tools or []],
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
    def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                           status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

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
    structured, tools, tool_parser = await _chat_plan(ctx, chat)
    prompt_text, images = await render_chat_request(ctx, chat, tools)
    max_tokens, is_default = requested_max_tokens(chat)
    prompt = await ctx.prompt_from_text(prompt_text, max_tokens, add_special_tokens=False,
                                        param="input", is_default_max_tokens=is_default,
                                        images=images)
    builder = _ResponseBuilder(ctx, request, plan.text_format, len(prompt.token_ids))
    submissions = _submissions(chat, [prompt], builder.id, structured,
                               ctx.request_priority(chat.priority))
    choice = ChatChoice(ctx, 0, prompt, None)
    parser = ChatOutputParser(ctx.config.server.reasoning_parser, tool_parser, prompt_text)

    if not request.stream:
        await _collect(ctx, submissions, raw, lambda index, output: choice.delta(output))
        content, reasoning = choice.text, ""
        if parser.is_active:
            parser.feed(choice.text)
            parser.finish()
            content, reasoning = parser.content, parser.reasoning_content
        if reasoning:
            builder.items.append(builder.reasoning_item(new_id("rs"), reasoning, "completed"))
        if content or not parser.calls:
            builder.items.append(builder.message_item(new_id("msg"), content, "completed"))
        for call in parser.calls:
            builder.items.append(builder.function_call_item(new_id("fc"), call.id, call.name,
                                                            call.arguments, "completed"))
        return JSONResponse(builder.response("completed", choice))

    opened = await open_stream(ctx, submissions, raw)
    return StreamingResponse(_events(builder, opened, choice, parser),
                             media_type="text/event-stream", headers=SSE_HEADERS)


class _OpenItem:
    """The output item being streamed (a reasoning item, the message or a function call)."""

    def __init__(self, kind: str, index: int, call_id: str = "", name: str = "",
                 call_index: int = -1) -> None:
        self.kind = kind
        self.index = index
        self.id = new_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.text = ""
        """The text, or a function call's arguments so far."""
        self.call_id = call_id
        self.name = name
        self.call_index = call_index
        """The tool-call parser's index of this call."""


async def _events(builder: _ResponseBuilder, opened: AsyncIterator[tuple[int, RequestOutput]],
                  choice: ChatChoice, parser: ChatOutputParser) -> AsyncIterator[str]:
    current: _OpenItem | None = None

    def open_item(kind: str, call: dict[str, Any] | None = None) -> list[str]:
        nonlocal current
        events = close_item()
        if call is not None:
            current = _OpenItem(kind, len(builder.items), call["id"], call["function"]["name"],
                                call["index"])
            item = builder.function_call_item(current.id, current.call_id, current.name, "",
                                              "in_progress")
        else:
            current = _OpenItem(kind, len(builder.items))
            make = builder.reasoning_item if kind == "reasoning" else builder.message_item
            item = make(current.id, "", "in_progress")
        events.append(builder.event("response.output_item.added", output_index=current.index,
                                    item=item))
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
        if item.kind == "function_call":
            done = builder.function_call_item(item.id, item.call_id, item.name, item.text, "completed")
            events = [builder.event("response.function_call_arguments.done", item_id=item.id,
                                    output_index=item.index, arguments=item.text)]
        elif item.kind == "reasoning":
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

    def feed_calls(entries: list[dict[str, Any]]) -> list[str]:
        """Chat ``delta.tool_calls`` entries: an entry with an id starts a call's item, the
        others carry more of the arguments of the call with their index."""
        events: list[str] = []
        for entry in entries:
            if entry.get("id") is not None:
                events += open_item("function_call", entry)
            assert current is not None and current.kind == "function_call" \
                and current.call_index == entry["index"], "arguments of a call that is not open"
            arguments = entry["function"].get("arguments") or ""
            if arguments:
                current.text += arguments
                events.append(builder.event("response.function_call_arguments.delta",
                                            item_id=current.id, output_index=current.index,
                                            delta=arguments))
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
        return events + feed_calls(delta.get("tool_calls") or [])

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
                        delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
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
