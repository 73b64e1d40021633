"""Choosing the tool_choice "auto" parser at start-up from the flags or the chat template: the
packaged Qwen template (the default model's GGUF) gives hermes, a template without tools gives
none, an explicit flag wins."""

from __future__ import annotations

import pytest

from servelm.model.gguf.gguf_file import GGUFFile
from servelm.model.packaged import PackagedModelError, packaged_model_path
from servelm.parsers.tool_calls import parse_tool_calls
from servelm.parsers.tool_templates import (choose_tool_parser, declares_tools, template_text,
                                            template_tool_format)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
           "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}")
PYTHONIC = ("{% if tools %}<|start_header_id|>system<|end_header_id|>Call functions as "
            "[func_name1(params_name1=params_value1), func_name2(params)]{{ tools | tojson }}"
            "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
LLAMA31 = ("{%- if tools is not none %}<|start_header_id|>user<|end_header_id|>Respond in the format "
           '{"name": function name, "parameters": dictionary}.{{ tools | tojson }}{%- endif %}'
           "{%- for m in messages %}{{ m.content }}{% if m.role == 'ipython' %}<|python_tag|>"
           "{% endif %}{%- endfor %}")
# Mentions <tool_call> in a comment-like string but never reads ``tools``: no tool support.
HERMES_TEXT_ONLY = "{% for m in messages %}{{ m.content }}{% endfor %}{{ '<tool_call>' }}"


def packaged_template(name: str) -> str:
    try:
        path = packaged_model_path(name)
    except PackagedModelError as error:
        pytest.skip(str(error))
    template = GGUFFile.open(path).chat_template
    assert template is not None
    return template


def test_default_models_packaged_qwen_template_gives_hermes() -> None:
    template = packaged_template("qwen2.5-coder-0.5b")
    assert declares_tools(template)
    choice = choose_tool_parser(template, None, False)
    assert choice.parser == "hermes" and "declares tools" in choice.reason
    # The call format the template shows its model is the one the chosen parser reads.
    content, calls = parse_tool_calls(
        choice.parser, 'OK\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content.strip() == "OK" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


def test_packaged_smollm2_template_has_no_tools() -> None:
    choice = choose_tool_parser(packaged_template("smollm2-135m"), None, False)
    assert choice.parser is None and choice.reason == "the chat template does not declare tool support"


@pytest.mark.parametrize("template, parser", [
    (CHATML, None), (HERMES_TEXT_ONLY, None), (MISTRAL, "mistral"), (PYTHONIC, "pythonic"),
    (LLAMA31, "llama3_json"), ("{{ tools | tojson }}", None)])
def test_format_detection(template: str, parser: str | None) -> None:
    assert choose_tool_parser(template, None, False).parser == parser
    if parser is not None:
        assert declares_tools(template) and template_tool_format(template) == parser


def test_explicit_flags_win_and_absent_templates() -> None:
    assert choose_tool_parser(MISTRAL, "pythonic", False).parser == "pythonic"
    assert choose_tool_parser(CHATML, "llama3", False).reason == "--tool-call-parser"
    auto = choose_tool_parser(CHATML, None, True)
    assert auto.parser == "hermes" and auto.reason.startswith("--enable-auto-tool-choice")
    assert choose_tool_parser(MISTRAL, None, True).parser == "mistral"  # the template says more
    assert choose_tool_parser(None, None, False).reason == "the model has no chat template"
    unknown = choose_tool_parser("{{ tools | tojson }}", None, False)
    assert unknown.parser is None and "does not recognise" in unknown.reason


def test_named_templates_use_tool_use() -> None:
    assert template_text({"default": CHATML, "tool_use": MISTRAL}) == MISTRAL
    assert template_text([{"name": "default", "template": CHATML}]) == CHATML
    assert choose_tool_parser({"default": CHATML, "tool_use": MISTRAL}, None, False).parser == "mistral"
    broken = "{% if tools %}<tool_call>{% endif"  # unparseable Jinja: a plain-text look
    assert declares_tools(broken)
