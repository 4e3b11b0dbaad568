"""Tool-call readers: a whole answer and the same answer fed piece by piece read the same calls and text."""

from __future__ import annotations

import json
import random

import pytest

from megatron_serve.server.tool_calls import (
    Arguments,
    CallStart,
    Content,
    HermesReader,
    Llama3JsonReader,
    MistralReader,
    NamedReader,
    Qwen3XmlReader,
    RequiredReader,
    parser_for_template,
)

WEATHER = {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}


def read(reader, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    events = [event for piece in pieces for event in reader.feed(piece)] + reader.finish()
    text = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[list] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(calls) and event.id.startswith("call_")
            calls.append([event.name, ""])
        elif isinstance(event, Arguments):
            calls[event.index][1] += event.text
    return text, [(name, json.loads(arguments)) for name, arguments in calls]


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


CASES = [
    (HermesReader, 'Let me check.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
                   '<tool_call>{"name": "g", "arguments": {}}</tool_call> done',
     ("Let me check. done", [("f", {"x": 1}), ("g", {})])),
    (HermesReader, "no calls here, just <tool text", ("no calls here, just <tool text", [])),
    (HermesReader, '<tool_call>{"name": oops}</tool_call>', ('<tool_call>{"name": oops}</tool_call>', [])),
    (HermesReader, '<tool_call>{"name": "f", "arguments": {"a": "b"}}', ("", [("f", {"a": "b"})])),
    (Llama3JsonReader, '<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}',
     ("", [("f", {"x": 2}), ("g", {})])),
    (Llama3JsonReader, ' {"name": "f", "arguments": {"y": [1]}}', ("", [("f", {"y": [1]})])),
    (Llama3JsonReader, "It is sunny {not a call}", ("It is sunny {not a call}", [])),
    (Llama3JsonReader, '{"name": "f", "parameters": {"x"', ('{"name": "f", "parameters": {"x"', [])),
    (RequiredReader, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": [2, 3]}}]',
     ("", [("f", {"a": 1}), ("g", {"b": [2, 3]})])),
    (MistralReader, 'Checking. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     ("Checking. ", [("f", {"x": 1}), ("g", {})])),
    (MistralReader, '[TOOL_CALLS]f[ARGS]{"x": [1, 2]}[TOOL_CALLS]g[ARGS]{}', ("", [("f", {"x": [1, 2]}), ("g", {})])),
    (MistralReader, "no calls, only [TOOL text", ("no calls, only [TOOL text", [])),
    (MistralReader, "[TOOL_CALLS] not json", ("[TOOL_CALLS] not json", [])),
    (lambda: Qwen3XmlReader(schemas={"weather": WEATHER}),
     "Let me look.\n<tool_call>\n<function=weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n"
     "3\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n</tool_call>",
     ("Let me look.\n", [("weather", {"city": "New York", "days": 3, "zip": "10001"})])),
    (Qwen3XmlReader, "<tool_call><function=f><parameter=a>{\"b\": 1}</parameter></function></tool_call>",
     ("", [("f", {"a": {"b": 1}})])),
    (Qwen3XmlReader, "<tool_call>{\"name\": \"f\"}</tool_call>", ("<tool_call>{\"name\": \"f\"}</tool_call>", [])),
]


@pytest.mark.parametrize(("reader", "text", "expected"), CASES)
def test_whole_and_piecewise_reads_agree(reader, text, expected):
    assert read(reader(), [text]) == expected
    for seed in range(5):
        assert read(reader(), splits(text, seed)) == expected


def test_required_calls_stream_as_each_completes():
    reader = RequiredReader()
    assert reader.feed('[{"name": "f", "parameters": {"a": 1}') == []
    events = reader.feed('}, {"name": "g"')
    assert [type(e) for e in events] == [CallStart, Arguments] and events[0].name == "f"
    assert read(RequiredReader(), ['[{"name": "f", "param']) == ('[{"name": "f", "param', [])  # cut short


def test_named_reader_streams_arguments_as_they_come():
    reader = NamedReader("f")
    first = reader.feed('{"a"')
    assert isinstance(first[0], CallStart) and first[0].name == "f" and first[1].text == '{"a"'
    assert reader.feed(": 1}") == [Arguments(0, ": 1}")]
    assert reader.finish() == []


def test_parser_is_chosen_from_the_chat_template():
    assert parser_for_template("... <tool_call> ...") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<tool_call>\n<function=example_function_name>") == "qwen3_coder"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
