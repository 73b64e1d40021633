"""Tools out of the box (issue 35): `servelm serve` with no flags serves the default model
(Qwen2.5-Coder-0.5B, whose GGUF chat template declares tools in the hermes format), and the
openai client gets a tool call with the default tool_choice ("auto")."""

from __future__ import annotations

import json

import openai
import pytest

from .server_process import ServerProcess

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.slow
def test_default_server_answers_tools_with_no_flags() -> None:
    with ServerProcess([], startup_timeout_s=1200) as server:  # no model, no tool flags: the defaults
        assert "tool_choice auto parsed as hermes (the chat template declares tools" in server.log(None)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        chat = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages,
                                              tools=[WEATHER_TOOL], temperature=0, max_tokens=64)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert "paris" in json.loads(call.function.arguments)["city"].lower()
        # Streamed, the same call arrives as deltas.
        stream = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages,
                                                tools=[WEATHER_TOOL], temperature=0, max_tokens=64,
                                                stream=True)
        name, arguments, finish = "", "", None
        for chunk in stream:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                name += delta_call.function.name or ""
                arguments += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (name, json.loads(arguments), finish) == (
            "get_weather", json.loads(call.function.arguments), "tool_calls")
