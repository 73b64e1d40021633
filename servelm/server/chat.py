"""Chat templates: turning OpenAI ``messages`` into the prompt text the model was trained on.

Invariants:
- The template comes from ``--chat-template`` (a file path or an inline Jinja string) when given,
  which overrides the tokenizer's own; with neither, chat requests get a 400 that says how to fix it.
- Rendering happens here once; the text is then tokenized without adding special tokens (the
  template writes BOS and friends itself).
- Trusted templates (the tokenizer's, --chat-template) render off the event loop; a template sent
  in a request is refused unless --trust-request-chat-template, and then renders in
  ``template_sandbox`` (a worker process with a time and memory budget).
- Content parts reach the template per --chat-template-content-format: as lists of
  ``{"type": "text"}`` / ``{"type": "image"}`` parts (openai; the model's template places each
  image), or joined into one string with the image marker text where an image was (string). The
  images themselves are collected here in message order (``ImageRef``s, not read yet): the i-th
  image part is the i-th image the template writes.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jinja2

from servelm.errors import InvalidRequestError
from servelm.multimodal.front_door import IMAGE_PART_TYPES, OTHER_MEDIA_PART_TYPES, ImageRef
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


_ITERATES_CONTENT = re.compile(
    r"content['\"]?\]?\s+is\s+(?:not\s+)?(?:string|iterable|sequence|mapping)"
    r"|for\s+\w+\s+in\s+[\w.\[\]'\"]*content\b"
    r"|\[['\"]type['\"]\]|\.type\b")
"""What a template that walks content-part lists contains (``message['content'] is string``,
``for item in message['content']``, ``item['type']``): HF vision-language templates all do."""


def template_iterates_content(template: str | None) -> bool:
    """Whether a chat template renders content given as a list of parts (vLLM's "auto" check,
    by pattern rather than by walking the Jinja AST)."""
    return bool(template) and _ITERATES_CONTENT.search(str(template)) is not None


def _text_content(parts: list[dict[str, Any]], image_marker: str | None, where: str) -> str:
    """Content parts as one string (text joined by newlines), an image as the model's marker."""
    texts = []
    for part in parts:
        if part["type"] == "image":
            if image_marker is None:
                raise InvalidRequestError(
                    f"{where}: this model's chat template does not take content lists and its "
                    "image marker is unknown; start the server with "
                    "--chat-template-content-format openai and a template that places images",
                    where)
            texts.append(image_marker)
        else:
            texts.append(part["text"])
    return "\n".join(texts)


def message_dicts(messages: list[ChatMessage], *, content_format: str = "string",
                  image_marker: str | None = None
                  ) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Messages as plain dicts for Jinja, and the images their content parts carry (in order).

    ``content_format`` (resolved: string or openai): string joins text parts into one string, an
    image becoming ``image_marker``; openai gives every content as a list of ``{"type": "text",
    "text"}`` and ``{"type": "image"}`` parts (HF templates place an image where they meet one).
    A message with only text parts is a string unless the format is openai, as before images.
    """
    result: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for position, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        data["role"] = "system" if message.role == "developer" else message.role
        content = message.content
        where = f"messages[{position}].content"
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for index, part in enumerate(content):
                kind = part.get("type")
                part_where = str(part.get("_param") or f"{where}[{index}]")
                if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in IMAGE_PART_TYPES:
                    if message.role != "user":
                        raise InvalidRequestError(f"{part_where}: images are accepted in user "
                                                  "messages only", part_where)
                    images.append(ImageRef(part, part_where))
                    parts.append({"type": "image"})
                elif kind in OTHER_MEDIA_PART_TYPES:
                    raise InvalidRequestError(f"{part_where}: {kind} parts are not supported: "
                                              "this server takes text and images", part_where)
                else:
                    raise InvalidRequestError(
                        f"{part_where}: unsupported content part {kind!r} (text and image_url "
                        "parts are supported)", part_where)
            if content_format == "openai":
                data["content"] = parts
            else:
                data["content"] = _text_content(parts, image_marker, where)
        elif content is None:
            data["content"] = ""
        elif content_format == "openai":
            data["content"] = [{"type": "text", "text": content}]
        result.append(data)
    return result, images


def resolve_content_format(setting: str, template: str | None, has_images: bool) -> str:
    """string or openai for one request: --chat-template-content-format, where auto means openai
    only for a request with images and a template that iterates content."""
    if setting != "auto":
        return setting
    return "openai" if has_images and template_iterates_content(template) else "string"


def first_image_part(messages: list[ChatMessage]) -> str | None:
    """Where the first image part of ``messages`` is (``messages[0].content[1]``), or None."""
    for position, message in enumerate(messages):
        if isinstance(message.content, list):
            for index, part in enumerate(message.content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    return str(part.get("_param") or f"messages[{position}].content[{index}]")
    return None


def chat_job(tokenizer: Any, messages: list[ChatMessage], *, template: str | None,
             add_generation_prompt: bool, continue_final_message: bool,
             template_kwargs: dict[str, Any] | None,
             tools: list[dict[str, Any]] | None = None, content_format: str = "auto",
             image_marker: str | None = None) -> dict[str, Any]:
    """Check a chat request and return what rendering needs (plain, picklable data), and under
    ``images`` the ImageRefs of its image parts (taken out before rendering).

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
    effective_template = template if template is not None else getattr(tokenizer, "chat_template", None)
    content_format = resolve_content_format(content_format, effective_template,
                                            first_image_part(messages) is not None)
    dicts, images = message_dicts(messages, content_format=content_format,
                                  image_marker=image_marker)
    return {"messages": dicts, "images": images, "template": template, "tools": tools or None,
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
    job = chat_job(tokenizer, messages, template=template, add_generation_prompt=add_generation_prompt,
                   continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                   tools=tools)
    job.pop("images")
    return render_job(tokenizer, job)
