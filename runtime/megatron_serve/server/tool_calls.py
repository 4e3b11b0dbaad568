"""Tool calling in chat: which output constraint ``tool_choice`` needs, and reading calls out of the output.

* ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects,
  one alternative per tool with that tool's parameter schema (vLLM's format), so even a random
  model writes valid calls.
* a named function: the output is constrained to that function's parameter schema; the whole
  output is its arguments.
* ``auto``: the model decides; its output is read by the parser of its family's format (vLLM's
  ``--tool-call-parser`` names): ``hermes`` / Qwen 2.5-3 (``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>``), ``llama3_json`` (``{"name": ..., "parameters": ...}``, several joined by
  ``;``, optionally after ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS]`` then a JSON list of
  calls, or ``name[ARGS]{...}`` per call), ``qwen3_coder`` / ``qwen3_xml`` (``<tool_call><function=
  name><parameter=key>value</parameter></function></tool_call>``, values typed by the tool's
  schema). The parser is ``--tool-call-parser``'s, else chosen from the chat template's markers.

Every reader has one incremental interface, ``feed(text)`` then ``finish()``, each returning
events (content text, the start of a call, a piece of its arguments). A whole answer and a stream
go through the same code, so both read the same calls; text that turns out not to be a call is
given back as content, never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..http_options import TOOL_CALL_PARSERS
from ..wire.sampling_params import StructuredOutputsParams
from .errors import bad_request
from .models import ChatCompletionRequest, ToolDefinition

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
QWEN3_CODER = "qwen3_coder"


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallReader(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


def _call_events(index: int, name: str, arguments: Any) -> list[Event]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return [CallStart(index, new_call_id(), name), Arguments(index, text)]


def _as_call(obj: Any, argument_keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """``(name, arguments)`` of a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            return (obj["name"], obj[key]) if isinstance(obj[key], (dict, str)) else None
    return obj["name"], {}


@dataclass
class HermesReader:
    """``<tool_call>{json}</tool_call>`` blocks between ordinary text (Hermes, Qwen 2.5/3)."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _buffer: str = ""
    _calls: int = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            start = self._buffer.find(self.OPEN)
            if start < 0:
                # keep back what could still become the opening tag
                keep = next((n for n in range(min(len(self.OPEN) - 1, len(self._buffer)), 0, -1)
                             if self.OPEN.startswith(self._buffer[-n:])), 0)
                cut = len(self._buffer) - keep
                if cut:
                    events.append(Content(self._buffer[:cut]))
                    self._buffer = self._buffer[cut:]
                return events
            if start:
                events.append(Content(self._buffer[:start]))
                self._buffer = self._buffer[start:]
            end = self._buffer.find(self.CLOSE)
            if end < 0:
                return events
            body = self._buffer[len(self.OPEN):end]
            self._buffer = self._buffer[end + len(self.CLOSE):]
            events.extend(self._call(body))

    def parse(self, body: str) -> tuple[str, Any] | None:
        """``(name, arguments)`` of one block's body, or None when it is not a call."""
        try:
            return _as_call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            return None

    def _call(self, body: str) -> list[Event]:
        call = self.parse(body)
        if call is None:
            return [Content(self.OPEN + body + self.CLOSE)]
        self._calls += 1
        return _call_events(self._calls - 1, *call)

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if rest.startswith(self.OPEN):  # an unclosed block: a call if its body is complete
            call = self.parse(rest[len(self.OPEN):])
            if call is not None:
                self._calls += 1
                return _call_events(self._calls - 1, *call)
        return [Content(rest)] if rest else []


_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


@dataclass
class Qwen3XmlReader(HermesReader):
    """Qwen3-Coder's calls: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``.

    Values are raw text (one newline around each is layout); a parameter the tool's schema types as
    anything but a string is read as JSON when it parses (``5`` -> 5, ``true`` -> true), else kept as text.
    """

    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool name -> its parameters' JSON schema

    def parse(self, body: str) -> tuple[str, Any] | None:
        match = _FUNCTION.match(body)
        if match is None:
            return None
        name = match.group(1).strip()
        properties = self.schemas.get(name, {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        for key, raw in _PARAMETER.findall(match.group(2)):
            key = key.strip()
            value = raw.removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed(value, (properties.get(key) or {}).get("type"))
        return name, arguments


def _typed(value: str, kind: Any) -> Any:
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


@dataclass
class MistralReader:
    """Mistral's calls: text, then ``[TOOL_CALLS]`` and either a JSON list of ``{"name", "arguments"}``
    (tokenizers before v11) or ``name[ARGS]{json}`` per call, each after its own ``[TOOL_CALLS]`` (v11 on).

    Text before the marker streams as content; what follows is held and read at the end (text that is
    no call is given back as content).
    """

    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    _buffer: str = ""
    _calls_started: bool = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self._calls_started:
            return []
        start = self._buffer.find(self.TAG)
        if start >= 0:
            self._calls_started = True
            content, self._buffer = self._buffer[:start], self._buffer[start:]
            return [Content(content)] if content else []
        keep = next((n for n in range(min(len(self.TAG) - 1, len(self._buffer)), 0, -1)
                     if self.TAG.startswith(self._buffer[-n:])), 0)
        cut = len(self._buffer) - keep
        content, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return [Content(content)] if content else []

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if not self._calls_started:
            return [Content(rest)] if rest else []
        calls = self._parse(rest)
        if calls is None:
            return [Content(rest)]
        return [event for index, call in enumerate(calls) for event in _call_events(index, *call)]

    def _parse(self, text: str) -> list[tuple[str, Any]] | None:
        parts = [part.strip() for part in text.split(self.TAG) if part.strip()]
        calls: list[tuple[str, Any]] = []
        try:
            for part in parts:
                if self.ARGS in part:  # v11: name[ARGS]{json}
                    name, arguments = part.split(self.ARGS, 1)
                    call = _as_call({"name": name.strip(), "arguments": json.loads(arguments)}, ("arguments",))
                    found = [call] if call is not None else []
                else:  # a JSON list of calls (or one call object)
                    decoded = json.loads(part)
                    objects = decoded if isinstance(decoded, list) else [decoded]
                    found = [c for obj in objects if (c := _as_call(obj, ("arguments", "parameters"))) is not None]
                    if len(found) != len(objects):
                        return None
                if not found:
                    return None
                calls.extend(found)
        except ValueError:
            return None
        return calls or None


@dataclass
class Llama3JsonReader:
    """Llama 3.x JSON calls: the whole output is ``{"name", "parameters"}`` objects joined by ``;``.

    The decision is made at the first visible character: an output that starts with ``{`` or
    ``<|python_tag|>`` is held and parsed at the end; any other output streams as content.
    """

    TAG = "<|python_tag|>"
    _buffer: str = ""
    _mode: str = "undecided"  # "content" or "calls" once decided

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return [Content(text)] if text else []
        self._buffer += text
        head = self._buffer.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return []
        if head.startswith("{") or head.startswith(self.TAG):
            self._mode = "calls"
            return []
        self._mode = "content"
        rest, self._buffer = self._buffer, ""
        return [Content(rest)]

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return [Content(rest)] if rest else []
        body = rest.strip().removeprefix(self.TAG).strip()
        decoder = json.JSONDecoder()
        calls: list[tuple[str, Any]] = []
        position = 0
        try:
            while position < len(body):
                obj, position = decoder.raw_decode(body, position)
                call = _as_call(obj, ("parameters", "arguments"))
                if call is None:
                    raise ValueError("not a call")
                calls.append(call)
                while position < len(body) and body[position] in "; \n\t":
                    position += 1
        except ValueError:
            return [Content(rest)]
        return [event for index, call in enumerate(calls) for event in _call_events(index, *call)]


@dataclass
class RequiredReader:
    """The constrained ``required`` output: a JSON array of ``{"name", "parameters"}``, each call sent once complete."""

    _buffer: str = ""
    _position: int = 0  # where the next array item starts (after '[' or ',')
    _calls: int = 0
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            rest = self._buffer[self._position:]
            stripped = rest.lstrip(" \n\t\r[,")
            if not stripped.startswith("{"):
                return events
            start = self._position + len(rest) - len(stripped)
            try:
                obj, end = self._decoder.raw_decode(self._buffer, start)
            except ValueError:
                return events  # the item is not complete yet
            self._position = end
            call = _as_call(obj, ("parameters", "arguments"))
            if call is not None:
                events.extend(_call_events(self._calls, *call))
                self._calls += 1

    def finish(self) -> list[Event]:
        if self._calls == 0 and self._buffer:  # cut short before the first call was complete
            return [Content(self._buffer)]
        return []


@dataclass
class NamedReader:
    """The constrained named-function output: all of it is the arguments of that one call, streamed as they come."""

    name: str
    _started: bool = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._started:
            self._started = True
            events.append(CallStart(0, new_call_id(), self.name))
        if text:
            events.append(Arguments(0, text))
        return events

    def finish(self) -> list[Event]:
        return self.feed("") if not self._started else []


@dataclass
class ToolPlan:
    """How one chat request uses its tools: the template's tool list, the output constraint, the reader."""

    template_tools: list[dict[str, Any]] | None
    constraint: tuple[str, StructuredOutputsParams] | None
    reader_kind: str | None  # None: no calls are read from the output
    named: str | None = None

    def reader(self) -> CallReader | None:
        if self.named is not None:
            return NamedReader(self.named)
        if self.reader_kind == "required":
            return RequiredReader()
        if self.reader_kind == HERMES:
            return HermesReader()
        if self.reader_kind == LLAMA3_JSON:
            return Llama3JsonReader()
        if self.reader_kind == MISTRAL:
            return MistralReader()
        if self.reader_kind in (QWEN3_CODER, "qwen3_xml"):
            schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {}
                       for tool in self.template_tools or []}
            return Qwen3XmlReader(schemas=schemas)
        return None


def parser_for_template(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, from its markers; None when it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return QWEN3_CODER if "<function=" in chat_template else HERMES
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return LLAMA3_JSON
    return None


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools: list[ToolDefinition], parallel: bool = True) -> dict[str, Any]:
    """A non-empty JSON array of calls (one only unless ``parallel``), each a ``{"name", "parameters"}`` of a tool."""
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": tool.function.name}, "parameters": _parameters(tool)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for tool in tools]}}


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """What ``tools`` and ``tool_choice`` ask of this request; a 400 naming the parameter when they cannot be met."""
    choice = req.tool_choice
    tools = req.tools or []
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, None, None)
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools have the same function name", param="tools")
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    if choice == "required":
        schema = required_schema(tools, parallel=req.parallel_tool_calls is not False)
        return ToolPlan(template_tools, ("tool_choice", StructuredOutputsParams(json=schema)), "required")
    if choice is None or choice == "auto":
        if parser is None:
            raise bad_request("tool_choice 'auto' needs a tool-call parser, and this model's chat template shows no "
                              f"known tool-call format (known: {', '.join(TOOL_CALL_PARSERS)}); use 'required' or "
                              "name a function", param="tool_choice")
        return ToolPlan(template_tools, None, parser)
    named = next((tool for tool in tools if tool.function.name == choice.function.name), None)
    if named is None:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not among the tools",
                          param="tool_choice")
    return ToolPlan(template_tools, ("tool_choice", StructuredOutputsParams(json=_parameters(named))), None,
                    named=named.function.name)
