"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Requests are translated into the same `GenerationRequest` as OpenAI chat requests: the system
prompt becomes a leading system turn, `tool_use` blocks become assistant tool calls, each
`tool_result` block becomes a `tool` turn, `thinking` blocks become the turn's reasoning, and
`thinking: {type: enabled|disabled}` sets the template's `enable_thinking`. Outputs are content
blocks in the order the model wrote them: thinking, then text and tool_use blocks.
Streams follow the documented event order: message_start, ping, per block content_block_start /
content_block_delta... / content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from aiohttp import web

from ninfer.parsers import ContentDelta, ReasoningDelta, ToolCall
from ninfer.server.errors import ApiError, anthropic_body, bad_request
from ninfer.server.generation import Finished, Generation, Piece, render_prompt
from ninfer.server.schemas import (
    SAMPLING_FIELDS,
    Field,
    GenerationRequest,
    check_model,
    read_object,
    read_stop,
    sampling_fields,
)
from ninfer.server.sse import EventStream
from ninfer.server.state import STATE, read_json, start_generation

__all__ = [
    "MessageBuilder",
    "StreamEvents",
    "anthropic_messages",
    "parse_count_tokens",
    "parse_messages",
    "routes",
    "stop_reason",
]

_PROMPT_FIELDS: dict[str, Field] = {
    "model": Field(("string",), required=True),
    "messages": Field(("array",), required=True),
    "system": Field(("string", "array")),
    "tools": Field(("array",)),
    "tool_choice": Field(("object",)),
    "thinking": Field(("object",)),
    "cache_control": Field(("object",)),
}

MESSAGES_FIELDS: dict[str, Field] = {
    **_PROMPT_FIELDS,
    "max_tokens": Field(("integer",), required=True, minimum=1),
    "stop_sequences": Field(("array",)),
    "stream": Field(("boolean",)),
    "metadata": Field(("object",)),
    **SAMPLING_FIELDS,
}

UNSUPPORTED = {
    "container": "code-execution containers are not available",
    "mcp_servers": "MCP servers are not available",
    "context_management": "context management is not available",
    "service_tier": "there is one service tier",
    "speed": "there is one speed",
    "inference_geo": "the model runs where this server runs",
    "output_config": "neither effort levels nor structured output formats are available",
    "diagnostics": "there is no prompt cache to diagnose",
    "workspace_id": "there are no workspaces",
    "user_profile_id": "there are no user profiles",
}

_CACHE = {"cache_control": Field(("object",))}  # prompt-caching hints: accepted, no effect needed
_TEXT_BLOCK = {
    "type": Field(("string",)),
    "text": Field(("string",), required=True),
    "citations": Field(("array",)),
    **_CACHE,
}
_TOOL_USE = {
    "type": Field(("string",)),
    "id": Field(("string",), required=True),
    "name": Field(("string",), required=True),
    "input": Field(("object",), required=True),
    **_CACHE,
}
_TOOL_RESULT = {
    "type": Field(("string",)),
    "tool_use_id": Field(("string",), required=True),
    "content": Field(("string", "array")),
    "is_error": Field(("boolean",)),
    **_CACHE,
}
_THINKING = {"type": Field(("string",)), "thinking": Field(("string",), required=True), "signature": Field(("string",))}
_TOOL = {
    "type": Field(("string",), choices=("custom",)),
    "name": Field(("string",), required=True),
    "description": Field(("string",)),
    "input_schema": Field(("object",), required=True),
    **_CACHE,
}
_TOOL_CHOICE = {
    "type": Field(("string",), required=True, choices=("auto", "any", "tool", "none")),
    "name": Field(("string",)),
    "disable_parallel_tool_use": Field(("boolean",)),
}
_THINKING_OPTION = {
    "type": Field(("string",), required=True, choices=("enabled", "adaptive", "disabled")),
    "budget_tokens": Field(("integer",), minimum=1),
    "display": Field(("string",), choices=("summarized",)),
}


def _text_blocks(content: Any, path: str) -> str:
    """Text of a string or of a list of text blocks (system prompts, tool results)."""
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"`{path}` must be a string or a list of text blocks", path)
    texts = []
    for j, block in enumerate(content):
        where = f"{path}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise bad_request(f"`{where}`: {kind!r} blocks are not supported here; only text is", where)
        texts.append(read_object(block, _TEXT_BLOCK, where)["text"])
    return "\n".join(texts)


def _user_turns(content: Any, path: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tools, texts = [], []
    for j, block in enumerate(content):
        where = f"{path}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(read_object(block, _TEXT_BLOCK, where)["text"])
        elif kind == "tool_result":
            b = read_object(block, _TOOL_RESULT, where)
            tools.append(
                {
                    "role": "tool",
                    "tool_call_id": b["tool_use_id"],
                    "content": _text_blocks(b.get("content"), f"{where}.content"),
                }
            )
        else:
            raise bad_request(
                f"`{where}`: {kind!r} blocks are not supported in user turns; this model takes text and tool results",
                where,
            )
    # Tool results answer the previous assistant turn, so they come first (model-spec.md 5.2 item 5).
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_turn(content: Any, path: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        where = f"{path}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(read_object(block, _TEXT_BLOCK, where)["text"])
        elif kind == "thinking":
            reasoning.append(read_object(block, _THINKING, where)["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque data of another model: nothing this one can read
        elif kind == "tool_use":
            b = read_object(block, _TOOL_USE, where)
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        else:
            raise bad_request(f"`{where}`: {kind!r} blocks are not supported in assistant turns", where)
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def anthropic_messages(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    """Anthropic system + messages -> the chat template's message form."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        m = read_object(
            message,
            {
                "role": Field(("string",), required=True, choices=("user", "assistant")),
                "content": Field(("string", "array"), required=True),
            },
            path,
        )
        if m["role"] == "user":
            out.extend(_user_turns(m["content"], f"{path}.content"))
        else:
            out.append(_assistant_turn(m["content"], f"{path}.content"))
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        raise bad_request(
            "a final assistant turn (prefilled response) is not supported; end with a user turn",
            f"messages[{len(messages) - 1}]",
        )
    return out


def _tools(tools: list[Any] | None, choice: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    if choice is not None:
        c = read_object(choice, _TOOL_CHOICE, "tool_choice")
        if c["type"] in ("any", "tool"):
            raise bad_request(
                f"tool_choice {c['type']!r} is not supported yet: "
                'ninfer cannot force a tool call (no constrained decoding); use "auto"',
                "tool_choice",
            )
        if c.get("disable_parallel_tool_use"):
            raise bad_request(
                "disable_parallel_tool_use is not supported: the model may call several tools in one turn",
                "tool_choice",
            )
        if c["type"] == "none":
            return None
    out = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"`{where}`: server tools ({tool.get('type')!r}) are not available; define custom tools", where
            )
        t = read_object(tool, _TOOL, where)
        fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t["input_schema"]}
        out.append({"type": "function", "function": fn})
    return out or None


def _prompt_request(body: dict[str, Any], model_id: str) -> GenerationRequest:
    check_model(body["model"], model_id)
    if not body["messages"]:
        raise bad_request("`messages` must not be empty", "messages")
    req = GenerationRequest(model=body["model"])
    req.tools = _tools(body.get("tools"), body.get("tool_choice"))
    if "thinking" in body:
        thinking = read_object(body["thinking"], _THINKING_OPTION, "thinking")
        # Qwen decides itself how long to think, so "adaptive" is the same as "enabled".
        req.template_kwargs["enable_thinking"] = thinking["type"] != "disabled"
    req.messages = anthropic_messages(body.get("system"), body["messages"])
    return req


def parse_messages(raw: Any, model_id: str) -> GenerationRequest:
    body = read_object(raw, MESSAGES_FIELDS, unsupported=UNSUPPORTED)
    req = _prompt_request(body, model_id)
    req.max_tokens = body["max_tokens"]
    req.sampling = sampling_fields(body)
    req.stop = read_stop(body["stop_sequences"], "stop_sequences") if "stop_sequences" in body else []
    req.stream = body.get("stream", False)
    return req


def parse_count_tokens(raw: Any, model_id: str) -> GenerationRequest:
    return _prompt_request(read_object(raw, _PROMPT_FIELDS, unsupported=UNSUPPORTED), model_id)


def stop_reason(finished: Finished, tool_calls: int) -> str:
    if finished.reason == "length":
        return "max_tokens"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if tool_calls else "end_turn"


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


class MessageBuilder:
    """Content blocks in output order: consecutive pieces of one kind share a block."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.calls = 0
        self.finished: Finished | None = None

    def add(self, piece: Piece) -> None:
        last = self.blocks[-1] if self.blocks else None
        if isinstance(piece, ReasoningDelta):
            if last is not None and last["type"] == "thinking":
                last["thinking"] += piece.text
            else:
                self.blocks.append({"type": "thinking", "thinking": piece.text, "signature": ""})
        elif isinstance(piece, ContentDelta):
            if last is not None and last["type"] == "text":
                last["text"] += piece.text
            else:
                self.blocks.append({"type": "text", "text": piece.text})
        elif isinstance(piece, ToolCall):
            self.blocks.append(tool_use_block(piece))
            self.calls += 1
        elif isinstance(piece, Finished):
            self.finished = piece

    def message(self, mid: str, model: str) -> dict[str, Any]:
        f = self.finished
        assert f is not None
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": self.blocks,
            "stop_reason": stop_reason(f, self.calls),
            "stop_sequence": f.stop_sequence,
            "usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens},
        }


Event = tuple[str, dict[str, Any]]


class StreamEvents:
    """Pieces -> named stream events in the documented order: message_start, ping, then per
    content block content_block_start, content_block_delta..., content_block_stop (a block
    closes when the kind of output changes; a tool_use block carries its whole input as one
    input_json_delta), then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, mid: str, model: str, prompt_tokens: int) -> None:
        self.mid, self.model, self.prompt_tokens = mid, model, prompt_tokens
        self.index = -1
        self.open: str | None = None
        self.calls = 0

    @staticmethod
    def _event(name: str, **data: Any) -> Event:
        return name, {"type": name, **data}

    def start(self) -> list[Event]:
        message = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return [self._event("message_start", message=message), self._event("ping")]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.index)]

    def _open(self, block: dict[str, Any]) -> list[Event]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [self._event("content_block_start", index=self.index, content_block=block)]

    def add(self, piece: Piece) -> list[Event]:
        out: list[Event] = []
        if isinstance(piece, ReasoningDelta):
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out.append(
                self._event(
                    "content_block_delta", index=self.index, delta={"type": "thinking_delta", "thinking": piece.text}
                )
            )
        elif isinstance(piece, ContentDelta):
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(
                self._event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": piece.text})
            )
        elif isinstance(piece, ToolCall):
            out += self._open({"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            partial = json.dumps(piece.arguments, ensure_ascii=False)
            out.append(
                self._event(
                    "content_block_delta", index=self.index, delta={"type": "input_json_delta", "partial_json": partial}
                )
            )
            out += self._close()
            self.calls += 1
        elif isinstance(piece, Finished):
            out += self._close()
            delta = {"stop_reason": stop_reason(piece, self.calls), "stop_sequence": piece.stop_sequence}
            usage = {"input_tokens": piece.prompt_tokens, "output_tokens": piece.completion_tokens}
            out.append(self._event("message_delta", delta=delta, usage=usage))
            out.append(self._event("message_stop"))
        return out


async def _stream(request: web.Request, gen: Generation, req: GenerationRequest, mid: str) -> web.StreamResponse:
    sse = EventStream(request)
    events = StreamEvents(mid, req.model, gen.prompt_tokens)
    for name, data in events.start():
        await sse.send(data, event=name)
    try:
        async for piece in gen.pieces(parse=True):
            for name, data in events.add(piece):
                await sse.send(data, event=name)
    except ApiError as e:
        await sse.send(anthropic_body(e), event="error")
    return await sse.finish()


async def messages(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    req = parse_messages(await read_json(request), state.model_id)
    gen = await start_generation(request, req, arrival)
    mid = "msg_" + secrets.token_hex(12)
    try:
        if req.stream:
            return await _stream(request, gen, req, mid)
        builder = MessageBuilder()
        async for piece in gen.pieces(parse=True):
            builder.add(piece)
        return web.json_response(builder.message(mid, req.model))
    finally:
        gen.cancel()


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse_count_tokens(await read_json(request), state.model_id)
    engine = state.require_engine()
    ids, _ = await asyncio.get_running_loop().run_in_executor(None, render_prompt, engine, req)
    return web.json_response({"input_tokens": len(ids)})


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/messages", messages),
        web.post("/v1/messages/count_tokens", count_tokens),
    ]
