"""Chat templates: turning OpenAI ``messages`` into the prompt text the model was trained on.

Invariants:
- The template comes from ``--chat-template`` (a file path or an inline Jinja string) when given,
  which overrides the tokenizer's own; with neither, chat requests get a 400 that says how to fix it.
- Rendering happens here once; the text is then tokenized without adding special tokens (the
  template writes BOS and friends itself).
- Trusted templates (the tokenizer's, --chat-template) render off the event loop; a template sent
  in a request is refused unless --trust-request-chat-template, and then renders in
  ``template_sandbox`` (a worker process with a time and memory budget).
"""

from __future__ import annotations

import os
from typing import Any

import jinja2

from servelm.errors import InvalidRequestError
from servelm.server.protocol import ChatMessage

_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tokenize", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "add_generation_prompt", "continue_final_message",
    "tools", "documents", "tokenizer_kwargs",
})


def load_chat_template(value: str | None) -> str | None:
    """The template text named by ``--chat-template``: a file's contents or the inline string.

    ServerConfig has already refused a value that is neither (``is_chat_template_value``).
    """
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    return value


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts for Jinja; content parts joined into one string (text parts only)."""
    result: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        data["role"] = "system" if message.role == "developer" else message.role
        content = message.content
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                kind = part.get("type")
                if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"messages[{position}].content: only text parts are supported, got {kind!r}",
                        f"messages[{position}].content")
                texts.append(part["text"])
            data["content"] = "\n".join(texts)
        elif content is None:
            data["content"] = ""
        result.append(data)
    return result


def chat_job(tokenizer: Any, messages: list[ChatMessage], *, template: str | None,
             add_generation_prompt: bool, continue_final_message: bool,
             template_kwargs: dict[str, Any] | None,
             tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Check a chat request and return what rendering needs (plain, picklable data).

    ``template`` None means the tokenizer's own. Invalid input is a 400.
    """
    if tokenizer is None:
        raise InvalidRequestError("chat requests need a tokenizer, but the server runs with "
                                  "--skip-tokenizer-init; send token ids to /v1/completions", "messages")
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; start the server "
                                  "with --chat-template FILE_OR_JINJA to use chat completions",
                                  "messages", code="chat_template_missing")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    if continue_final_message and messages[-1].role != "assistant":
        raise InvalidRequestError("continue_final_message needs the last message to be from the "
                                  "assistant", "continue_final_message")
    return {"messages": message_dicts(messages), "template": template, "tools": tools or None,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
            "continue_final_message": continue_final_message, "kwargs": kwargs}


def render_job(tokenizer: Any, job: dict[str, Any]) -> str:
    """Render a ``chat_job`` with a trusted template (the tokenizer's or --chat-template).

    Blocking Jinja work: call it off the event loop. A failing template is a 400.
    """
    try:
        text = tokenizer.apply_chat_template(
            job["messages"], chat_template=job["template"], tokenize=False,
            add_generation_prompt=job["add_generation_prompt"],
            continue_final_message=job["continue_final_message"],
            **({"tools": job["tools"]} if job["tools"] else {}), **job["kwargs"])
    except InvalidRequestError:
        raise
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as error:
        raise InvalidRequestError(f"chat template failed: {error}", "messages") from None
    if not isinstance(text, str):
        raise InvalidRequestError("chat template did not produce text", "messages")
    return text


def sandbox_job(tokenizer: Any, job: dict[str, Any]) -> dict[str, Any]:
    """A ``chat_job`` for the template sandbox: the special tokens the template may use
    (bos_token, eos_token, ...) join the template kwargs, as transformers does."""
    kwargs = {**dict(getattr(tokenizer, "special_tokens_map", {}) or {}), **job["kwargs"]}
    return {**job, "kwargs": kwargs}


def render_chat(tokenizer: Any, messages: list[ChatMessage], *, template: str | None,
                add_generation_prompt: bool, continue_final_message: bool,
                template_kwargs: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for ``messages`` with a trusted template; invalid input is a 400."""
    return render_job(tokenizer, chat_job(
        tokenizer, messages, template=template, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, template_kwargs=template_kwargs, tools=tools))
