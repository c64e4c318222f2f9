"""Parsing of Qwen3.5/3.6 model output into reasoning, content and tool calls.

Rules from model-spec.md section 5.3. With thinking on, the prompt ends inside `<think>\\n`, so
the output reads `{reasoning}\\n</think>\\n\\n{answer}`: everything before the first `</think>` is
reasoning. With thinking off the output is all content, unless it opens its own `<think>` block.
Tool calls use the Qwen XML form written by the chat template (section 5.2 item 4):

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

`OutputParser` works on streamed text deltas. Text that could still turn out to be the start of a
tag is held back until it is decided, and nothing that was emitted is ever taken back. Reasoning
and content are whitespace-trimmed at both ends, as the template trims them when they come back
as history, so a parsed turn renders back to the same prompt text.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Union

__all__ = [
    "ContentDelta",
    "Event",
    "OutputParser",
    "ReasoningDelta",
    "ToolCall",
    "parse_output",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


Event = Union[ReasoningDelta, ContentDelta, ToolCall]


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _json_type_names(schema: Any) -> frozenset[str]:
    """The JSON types a parameter schema allows; empty when the schema does not say."""
    if not isinstance(schema, dict):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset((declared,))
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    names: set[str] = set()
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for option in options:
                names |= _json_type_names(option)
    enum = schema.get("enum")
    if isinstance(enum, list):
        # Only "is a string allowed" matters to _convert_value; other members just mark JSON.
        names |= {"string" if isinstance(v, str) else "value" for v in enum}
    return frozenset(names)


def _parameter_types(tools: list | None) -> dict[str, dict[str, frozenset[str]]]:
    """function name -> parameter name -> allowed JSON types, from OpenAI-style tool
    definitions (`{"type": "function", "function": {...}}`) or bare function objects."""
    table: dict[str, dict[str, frozenset[str]]] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        schema = function.get("parameters") or function.get("input_schema") or {}
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict):
            properties = {}
        table[function["name"]] = {k: _json_type_names(v) for k, v in properties.items()}
    return table


def _convert_value(raw: str, types: frozenset[str]) -> Any:
    # Strings are written raw by the template and everything else as JSON (section 5.2).
    # Without a usable schema type the value stays the raw text.
    if not types or "string" in types:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parse_parameters(text: str, types: dict[str, frozenset[str]]) -> dict[str, Any] | None:
    pieces = text.split(PARAM_OPEN)
    if pieces[0].strip():
        return None
    arguments: dict[str, Any] = {}
    for piece in pieces[1:]:
        name_end = piece.find(">")
        if name_end < 0:
            return None
        key = piece[:name_end].strip()
        if not key:
            return None
        value = piece[name_end + 1 :]
        close = value.find(PARAM_CLOSE)
        if close >= 0:
            if value[close + len(PARAM_CLOSE) :].strip():
                return None
            value = value[:close]
        arguments[key] = _convert_value(_strip_one_newline(value), types.get(key, frozenset()))
    return arguments


def _parse_call_body(
    body: str, schemas: dict[str, dict[str, frozenset[str]]]
) -> list[ToolCall] | None:
    """The calls inside one `<tool_call>` block, or None when it is not well formed."""
    pieces = body.split(FUNCTION_OPEN)
    if len(pieces) < 2 or pieces[0].strip():
        return None
    calls: list[ToolCall] = []
    for piece in pieces[1:]:
        close = piece.find(FUNCTION_CLOSE)
        if close >= 0:
            if piece[close + len(FUNCTION_CLOSE) :].strip():
                return None
            piece = piece[:close]
        name_end = piece.find(">")
        if name_end < 0:
            return None
        name = piece[:name_end].strip()
        if not name:
            return None
        arguments = _parse_parameters(piece[name_end + 1 :], schemas.get(name, {}))
        if arguments is None:
            return None
        calls.append(ToolCall(id=_new_call_id(), name=name, arguments=arguments))
    return calls


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class _TrimmedStream:
    """Emits one section (reasoning or content) with its leading and trailing whitespace
    removed: trailing whitespace is held until more text follows it."""

    def __init__(self, make: Callable[[str], Event]) -> None:
        self._make = make
        self._started = False
        self._held = ""

    def push(self, text: str, out: list[Event]) -> None:
        text = self._held + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            out.append(self._make(body))
            self._started = True

    def take_held(self) -> str:
        held, self._held = self._held, ""
        return held


_START, _REASONING, _CONTENT, _CALL = range(4)


class OutputParser:
    """Streaming splitter of model output into reasoning, content and tool calls.

    `thinking` says whether the prompt ended inside an open think block (enable_thinking).
    Tool calls are only recognised when `tools` is non-empty; each is emitted whole once its
    `</tool_call>` arrives. A block that is unterminated at `finish()` or not well formed is
    passed on as content.
    """

    def __init__(self, tools: list | None, thinking: bool) -> None:
        self._schemas = _parameter_types(tools)
        self._parse_calls = bool(tools)
        self._thinking = thinking
        self._mode = _START
        self._pending = ""
        self._call_scanned = 0
        self._space_before_call = ""
        self._reasoning = _TrimmedStream(ReasoningDelta)
        self._content = _TrimmedStream(ContentDelta)
        self._finished = False

    def feed(self, text_delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("OutputParser.feed called after finish")
        self._pending += text_delta
        out: list[Event] = []
        self._advance(out, final=False)
        return _merge(out)

    def finish(self) -> list[Event]:
        if self._finished:
            return []
        out: list[Event] = []
        self._advance(out, final=True)
        self._finished = True
        return _merge(out)

    def _advance(self, out: list[Event], final: bool) -> None:
        while True:
            if self._mode == _START:
                if not self._leave_start(final):
                    return
            elif self._mode == _REASONING:
                if not self._step_reasoning(out, final):
                    return
            elif self._mode == _CONTENT:
                if not self._step_content(out, final):
                    return
            elif not self._step_call(out, final):
                return

    def _leave_start(self, final: bool) -> bool:
        # The output may open its own think block (e.g. when thinking was off in the prompt).
        head = self._pending.lstrip()
        if head.startswith(THINK_OPEN):
            self._pending = head[len(THINK_OPEN) :]
            self._mode = _REASONING
            return True
        if not final and THINK_OPEN.startswith(head):
            return False
        self._mode = _REASONING if self._thinking else _CONTENT
        return True

    def _step_reasoning(self, out: list[Event], final: bool) -> bool:
        end = self._pending.find(THINK_CLOSE)
        if end >= 0:
            self._reasoning.push(self._pending[:end], out)
            self._reasoning.take_held()
            self._pending = self._pending[end + len(THINK_CLOSE) :]
            self._mode = _CONTENT
            return True
        keep = 0 if final else _partial_tag_length(self._pending, THINK_CLOSE)
        cut = len(self._pending) - keep
        self._reasoning.push(self._pending[:cut], out)
        self._pending = self._pending[cut:]
        return False

    def _step_content(self, out: list[Event], final: bool) -> bool:
        start = self._pending.find(CALL_OPEN) if self._parse_calls else -1
        if start >= 0:
            self._content.push(self._pending[:start], out)
            self._space_before_call = self._content.take_held()
            self._pending = self._pending[start + len(CALL_OPEN) :]
            self._call_scanned = 0
            self._mode = _CALL
            return True
        keep = 0 if final or not self._parse_calls else _partial_tag_length(self._pending, CALL_OPEN)
        cut = len(self._pending) - keep
        self._content.push(self._pending[:cut], out)
        self._pending = self._pending[cut:]
        return False

    def _step_call(self, out: list[Event], final: bool) -> bool:
        # Only the new part (plus a tag's length of overlap) needs searching on each delta.
        scan_from = max(0, self._call_scanned - len(CALL_CLOSE) + 1)
        end = self._pending.find(CALL_CLOSE, scan_from)
        if end < 0:
            self._call_scanned = len(self._pending)
            if final:
                self._content.push(self._space_before_call + CALL_OPEN + self._pending, out)
                self._pending = ""
            return False
        body = self._pending[:end]
        self._pending = self._pending[end + len(CALL_CLOSE) :]
        calls = _parse_call_body(body, self._schemas)
        if calls is None:
            self._content.push(self._space_before_call + CALL_OPEN + body + CALL_CLOSE, out)
        else:
            out.extend(calls)
        self._space_before_call = ""
        self._mode = _CONTENT
        return True


def _merge(events: list[Event]) -> list[Event]:
    """Join neighbouring text deltas of the same kind."""
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(last.text + event.text)
        elif isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        else:
            merged.append(event)
    return merged


def parse_output(
    text: str, tools: list | None = None, thinking: bool = True
) -> tuple[str, str, list[ToolCall]]:
    """Split a complete output into (reasoning, content, tool_calls); "" where absent."""
    parser = OutputParser(tools, thinking)
    events = parser.feed(text) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning, content, [e for e in events if isinstance(e, ToolCall)]
