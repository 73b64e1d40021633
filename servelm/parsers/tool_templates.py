"""Which tool-call parser serves ``tool_choice: "auto"``: chosen once at start-up, from the flags
or else from the model's chat template (llama.cpp serves tools from the template; vLLM needs
``--enable-auto-tool-choice --tool-call-parser``).

Rules, first match wins:
1. ``--tool-call-parser NAME``: NAME.
2. The chat template declares tool support (its Jinja source reads a ``tools`` variable) and
   shows the format its model writes calls in, one servelm parses:
   ``[TOOL_CALLS]``/``[AVAILABLE_TOOLS]`` -> mistral, ``<tool_call>`` -> hermes (Qwen 2.5/3,
   Hermes), a ``[func_name(...)]`` example -> pythonic (Llama 3.2/4 pythonic templates),
   ``<|python_tag|>`` or a ``"parameters"`` JSON example after Llama 3 headers -> llama3_json.
3. ``--enable-auto-tool-choice`` alone: hermes (it also reads a bare JSON call object).
4. Otherwise none: ``tool_choice`` "auto" stays a 400 naming the flags (a template without tools
   would not show the model the tools, so guessing a parser would only hide that).

Invariant: the choice depends only on the flags and the template text, never on a request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

_PYTHONIC_EXAMPLE = re.compile(r"\[\s*func_name\w*\s*\(")


@dataclass(frozen=True, slots=True)
class ToolParserChoice:
    """The parser for tool_choice "auto", or None when "auto" is refused."""

    parser: str | None
    reason: str
    """Why, in words for the start-up log (and the 400 when ``parser`` is None)."""


def template_text(template: str | dict[str, Any] | list[Any] | None) -> str | None:
    """The template rendered for a request with tools: a tokenizer's named templates (a dict, or
    Hugging Face's list of {name, template}) use "tool_use" when present, else "default"."""
    if isinstance(template, list):
        template = {entry.get("name"): entry.get("template") for entry in template
                    if isinstance(entry, dict)}
    if isinstance(template, dict):
        chosen = template.get("tool_use") or template.get("default")
        return chosen if isinstance(chosen, str) else None
    return template


def declares_tools(template: str) -> bool:
    """Whether the template reads a ``tools`` variable (so a request's tools reach the prompt)."""
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", template) is not None
    return "tools" in names


def template_tool_format(template: str) -> str | None:
    """The parser for the call format the template shows its model; None when it shows none
    servelm parses."""
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if _PYTHONIC_EXAMPLE.search(template):
        return "pythonic"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template
                                        and '"parameters"' in template):
        return "llama3_json"
    return None


def choose_tool_parser(template: str | dict[str, Any] | list[Any] | None, tool_call_parser: str | None,
                       enable_auto_tool_choice: bool) -> ToolParserChoice:
    """The rules of the module docstring; ``template`` is the one requests are rendered with
    (--chat-template, else the tokenizer's)."""
    if tool_call_parser:
        return ToolParserChoice(tool_call_parser, "--tool-call-parser")
    text = template_text(template)
    if text is not None and declares_tools(text):
        found = template_tool_format(text)
        if found is not None:
            return ToolParserChoice(found, "the chat template declares tools and shows the "
                                           f"{found} call format")
        how = "the chat template declares tools in a call format servelm does not recognise"
    elif text is not None:
        how = "the chat template does not declare tool support"
    else:
        how = "the model has no chat template"
    if enable_auto_tool_choice:
        return ToolParserChoice("hermes", f"--enable-auto-tool-choice ({how}; hermes, which also "
                                          "reads a bare JSON call)")
    return ToolParserChoice(None, how)
