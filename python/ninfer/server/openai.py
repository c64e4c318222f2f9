"""The OpenAI API: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

Requests are checked against the field tables below and translated into a `GenerationRequest`
(`parse_chat`, `parse_completion`); outputs are built from generation pieces (`ChatResult`,
`ChatChunks`). Tool calls use the Qwen XML form inside the model and OpenAI's JSON form outside:
incoming `arguments` strings are parsed to objects before the template sees them, and parsed
calls go out with `arguments` as a JSON string. docs/api.md lists every field and what is refused.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ninfer.parsers import ContentDelta, ReasoningDelta, ToolCall
from ninfer.server.errors import ApiError, bad_request, openai_body
from ninfer.server.generation import Finished, Generation, Logprobs, Piece, Text, token_text
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

__all__ = ["ChatChunks", "ChatResult", "chat_messages", "parse_chat", "parse_completion", "routes", "tool_call_json"]

_COMMON_FIELDS: dict[str, Field] = {
    "model": Field(("string",), required=True),
    "stream": Field(("boolean",)),
    "stream_options": Field(("object",)),
    "max_tokens": Field(("integer",), minimum=1),
    "stop": Field(("string", "array")),
    "n": Field(("integer",), minimum=1),
    "ignore_eos": Field(("boolean",)),
    "user": Field(("string",)),
    "logit_bias": Field(("object",)),
    **SAMPLING_FIELDS,
}

CHAT_FIELDS: dict[str, Field] = {
    **_COMMON_FIELDS,
    "messages": Field(("array",), required=True),
    "max_completion_tokens": Field(("integer",), minimum=1),
    "logprobs": Field(("boolean",)),
    "top_logprobs": Field(("integer",), minimum=0, maximum=20),
    "tools": Field(("array",)),
    "tool_choice": Field(("string", "object")),
    "parallel_tool_calls": Field(("boolean",)),
    "chat_template_kwargs": Field(("object",)),
    "response_format": Field(("object",)),
    "modalities": Field(("array",)),
    "store": Field(("boolean",)),
    "metadata": Field(("object",)),
}

CHAT_UNSUPPORTED = {
    "functions": "use `tools`",
    "function_call": "use `tool_choice`",
    "audio": "audio output is not available",
    "prediction": "predicted outputs are not available",
    "web_search_options": "web search is not available",
    "reasoning_effort": "thinking is on or off: use `chat_template_kwargs.enable_thinking`",
    "service_tier": "there is one service tier",
}

COMPLETION_FIELDS: dict[str, Field] = {
    **_COMMON_FIELDS,
    "prompt": Field(("string", "array"), required=True),
    "logprobs": Field(("integer",), minimum=0, maximum=20),
    "echo": Field(("boolean",)),
    "best_of": Field(("integer",), minimum=1),
}

COMPLETION_UNSUPPORTED = {"suffix": "fill-in-the-middle suffixes are not available"}

_STREAM_OPTIONS = {"include_usage": Field(("boolean",))}
_TEMPLATE_KWARGS = {"enable_thinking": Field(("boolean",)), "preserve_thinking": Field(("boolean",))}
_FUNCTION = {
    "name": Field(("string",), required=True),
    "description": Field(("string",)),
    "parameters": Field(("object",)),
    "strict": Field(("boolean",)),
}
_ROLE_FIELDS: dict[str, dict[str, Field]] = {
    "system": {
        "role": Field(("string",)),
        "content": Field(("string", "array"), required=True),
        "name": Field(("string",)),
    },
    "user": {
        "role": Field(("string",)),
        "content": Field(("string", "array"), required=True),
        "name": Field(("string",)),
    },
    "assistant": {
        "role": Field(("string",)),
        "content": Field(("string", "array")),
        "name": Field(("string",)),
        "tool_calls": Field(("array",)),
        "reasoning_content": Field(("string",)),
        "reasoning": Field(("string",)),
        "refusal": Field(("string",)),
    },
    "tool": {
        "role": Field(("string",)),
        "content": Field(("string", "array"), required=True),
        "tool_call_id": Field(("string",), required=True),
    },
}
_ROLE_FIELDS["developer"] = _ROLE_FIELDS["system"]


def _text_content(content: Any, path: str) -> str:
    """A message content as text: a string, or a list of `{"type": "text"}` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        where = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"`{where}` must be an object", where)
        kind = part.get("type")
        if kind != "text":
            raise bad_request(f"`{where}`: {kind!r} content is not supported; this model takes text only", where)
        parts.append(
            read_object(part, {"type": Field(("string",)), "text": Field(("string",), required=True)}, where)["text"]
        )
    return "".join(parts)


def _call_arguments(raw: Any, path: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise bad_request(f"`{path}` is not valid JSON", path) from None
    if not isinstance(value, dict):
        raise bad_request(f"`{path}` must encode a JSON object", path)
    return value


def chat_messages(raw: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's message form (model-spec.md section 5.2)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        path = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLE_FIELDS:
            raise bad_request(f"`{path}.role` must be one of system, developer, user, assistant, tool", f"{path}.role")
        m = read_object(message, _ROLE_FIELDS[role], path)
        content = _text_content(m.get("content"), f"{path}.content")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": content})
        elif role == "user":
            out.append({"role": "user", "content": content})
        elif role == "tool":
            out.append({"role": "tool", "content": content, "tool_call_id": m["tool_call_id"]})
        else:
            # A refusal is what the assistant said in that turn.
            turn: dict[str, Any] = {"role": "assistant", "content": content or m.get("refusal", "")}
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                turn["reasoning_content"] = reasoning
            calls = []
            for j, call in enumerate(m.get("tool_calls", [])):
                where = f"{path}.tool_calls[{j}]"
                c = read_object(
                    call,
                    {
                        "id": Field(("string",)),
                        "type": Field(("string",), choices=("function",)),
                        "function": Field(("object",), required=True),
                    },
                    where,
                )
                fn = read_object(
                    c["function"],
                    {"name": Field(("string",), required=True), "arguments": Field(("string", "object"))},
                    f"{where}.function",
                )
                args = _call_arguments(fn.get("arguments"), f"{where}.function.arguments")
                calls.append(
                    {"id": c.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}
                )
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def chat_tools(tools: list[Any] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools to render and parse, after `tool_choice` (docs/api.md, "Tools")."""
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        what = tool_choice if isinstance(tool_choice, str) else "a named function"
        raise bad_request(
            f"tool_choice={what} is not supported yet: "
            'ninfer cannot force a tool call (no constrained decoding); use "auto"',
            "tool_choice",
        )
    if tool_choice == "none" or not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        t = read_object(
            tool,
            {
                "type": Field(("string",), choices=("function",), required=True),
                "function": Field(("object",), required=True),
            },
            where,
        )
        out.append({"type": "function", "function": read_object(t["function"], _FUNCTION, f"{where}.function")})
    return out


def _common(body: dict[str, Any], state_model: str) -> GenerationRequest:
    check_model(body["model"], state_model)
    refused = [
        (body.get("n", 1) != 1, "n", "`n` > 1 is not supported: one choice per request"),
        (body.get("best_of", 1) != 1, "best_of", "`best_of` > 1 is not supported: one choice per request"),
        (body.get("echo", False), "echo", "`echo` is not supported"),
        (bool(body.get("logit_bias")), "logit_bias", "`logit_bias` is not supported"),
        (body.get("store", False), "store", "`store` is not supported: completions are not stored"),
        (
            body.get("parallel_tool_calls", True) is False,
            "parallel_tool_calls",
            "`parallel_tool_calls: false` is not supported: the model may call several tools in one turn",
        ),
    ]
    for bad, param, message in refused:
        if bad:
            raise bad_request(message, param)
    options = read_object(body.get("stream_options", {}), _STREAM_OPTIONS, "stream_options")
    return GenerationRequest(
        model=body["model"],
        sampling=sampling_fields(body),
        stop=read_stop(body["stop"], "stop") if "stop" in body else [],
        max_tokens=body.get("max_tokens"),
        ignore_eos=body.get("ignore_eos", False),
        stream=body.get("stream", False),
        include_usage=options.get("include_usage", False),
    )


def parse_chat(raw: Any, model_id: str) -> GenerationRequest:
    body = read_object(raw, CHAT_FIELDS, unsupported=CHAT_UNSUPPORTED)
    req = _common(body, model_id)
    fmt = body.get("response_format", {"type": "text"})
    if fmt.get("type") != "text":
        raise bad_request(
            f"response_format {fmt.get('type')!r} is not supported: ninfer has no constrained decoding yet",
            "response_format",
        )
    if body.get("modalities", ["text"]) != ["text"]:
        raise bad_request("only the text modality is available", "modalities")
    if "max_completion_tokens" in body:
        req.max_tokens = body["max_completion_tokens"]
    if body.get("logprobs"):
        req.logprobs = body.get("top_logprobs", 0)
    elif "top_logprobs" in body:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    req.template_kwargs = read_object(body.get("chat_template_kwargs", {}), _TEMPLATE_KWARGS, "chat_template_kwargs")
    req.tools = chat_tools(body.get("tools"), body.get("tool_choice"))
    if not body["messages"]:
        raise bad_request("`messages` must not be empty", "messages")
    req.messages = chat_messages(body["messages"])
    return req


def parse_completion(raw: Any, model_id: str) -> GenerationRequest:
    body = read_object(raw, COMPLETION_FIELDS, unsupported=COMPLETION_UNSUPPORTED)
    req = _common(body, model_id)
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt = prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        if isinstance(prompt[0], list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt[0]):
            raise bad_request("`prompt` must be a string or a list of token ids", "prompt")
        req.prompt = prompt[0]
    elif isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
    else:
        raise bad_request("`prompt` must be a string or a list of token ids", "prompt")
    req.max_tokens = body.get("max_tokens", 16)  # the OpenAI default for completions
    req.logprobs = body.get("logprobs")
    return req


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
    }
    if index is not None:
        out = {"index": index, **out}
    return out


TokenText = Callable[[int], str]


def _chat_logprobs(
    text_of: TokenText, entries: list[tuple[int, float, list[tuple[int, float]]]]
) -> list[dict[str, Any]]:
    def one(tok: int, lp: float) -> dict[str, Any]:
        text = text_of(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [{**one(tok, lp), "top_logprobs": [one(t, alt) for t, alt in top]} for tok, lp, top in entries]


def _finish_reason(finished: Finished, tool_calls: int) -> str:
    return "tool_calls" if tool_calls and finished.reason == "stop" else finished.reason


def _usage(f: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


class ChatResult:
    """Accumulates pieces into one `chat.completion` (or `text_completion`) result."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.finished: Finished | None = None

    def add(self, piece: Piece) -> None:
        if isinstance(piece, ReasoningDelta):
            self.reasoning.append(piece.text)
        elif isinstance(piece, (ContentDelta, Text)):
            self.content.append(piece.text)
        elif isinstance(piece, ToolCall):
            self.calls.append(piece)
        elif isinstance(piece, Logprobs):
            self.logprobs.extend(piece.entries)
        elif isinstance(piece, Finished):
            self.finished = piece

    def response(self, rid: str, model: str, text_of: TokenText, want_logprobs: bool) -> dict[str, Any]:
        assert self.finished is not None
        content = "".join(self.content)
        reasoning = "".join(self.reasoning) or None
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self.calls and not content else content,
            "reasoning_content": reasoning,
            "reasoning": reasoning,
            "tool_calls": [tool_call_json(c) for c in self.calls] or None,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": _chat_logprobs(text_of, self.logprobs)} if want_logprobs else None,
            "finish_reason": _finish_reason(self.finished, len(self.calls)),
        }
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": _usage(self.finished),
        }


class ChatChunks:
    """Pieces -> `chat.completion.chunk` objects, in the order OpenAI streams them: a role chunk,
    deltas (reasoning, content, one chunk per tool call), a chunk with `finish_reason`, and with
    `include_usage` a last chunk with no choices and the usage (every other chunk has
    `"usage": null` then)."""

    def __init__(self, rid: str, model: str, include_usage: bool, text_of: TokenText) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.include_usage = include_usage
        self.text_of = text_of
        self.calls = 0

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        out = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return {**out, "usage": None} if self.include_usage else out

    def first(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def add(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, ReasoningDelta):
            return [self._chunk({"reasoning_content": piece.text, "reasoning": piece.text})]
        if isinstance(piece, ContentDelta):
            return [self._chunk({"content": piece.text})]
        if isinstance(piece, ToolCall):
            self.calls += 1
            return [self._chunk({"tool_calls": [tool_call_json(piece, self.calls - 1)]})]
        if isinstance(piece, Logprobs):
            return [self._chunk({}, logprobs={"content": _chat_logprobs(self.text_of, piece.entries)})]
        if isinstance(piece, Finished):
            out = [self._chunk({}, finish=_finish_reason(piece, self.calls))]
            if self.include_usage:
                usage = {
                    "id": self.rid,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                }
                out.append({**usage, "choices": [], "usage": _usage(piece)})
            return out
        return []


async def _stream_chat(request: web.Request, gen: Generation, req: GenerationRequest) -> web.StreamResponse:
    engine = request.app[STATE].engine
    chunks = ChatChunks(
        "chatcmpl-" + secrets.token_hex(12), req.model, req.include_usage, lambda t: token_text(engine, t)
    )
    sse = EventStream(request)
    await sse.send(chunks.first())
    try:
        async for piece in gen.pieces(parse=True):
            for chunk in chunks.add(piece):
                await sse.send(chunk)
    except ApiError as e:
        await sse.send(openai_body(e))
    await sse.send("[DONE]")
    return await sse.finish()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    req = parse_chat(await read_json(request), state.model_id)
    gen = await start_generation(request, req, arrival)
    try:
        if req.stream:
            return await _stream_chat(request, gen, req)
        result = ChatResult()
        async for piece in gen.pieces(parse=True):
            result.add(piece)
        engine = state.engine
        body = result.response(
            "chatcmpl-" + secrets.token_hex(12), req.model, lambda t: token_text(engine, t), req.logprobs is not None
        )
        return web.json_response(body)
    finally:
        gen.cancel()


def _completion_logprobs(
    engine: Any, entries: list[tuple[int, float, list[tuple[int, float]]]], offset: int
) -> dict[str, Any]:
    tokens, offsets = [], []
    for tok, _, _ in entries:
        offsets.append(offset)
        tokens.append(token_text(engine, tok))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{token_text(engine, t): alt for t, alt in top} for _, _, top in entries],
        "text_offset": offsets,
    }


def _completion(rid: str, model: str, created: int, text: str, finish: str | None, logprobs: Any) -> dict[str, Any]:
    choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    req = parse_completion(await read_json(request), state.model_id)
    gen = await start_generation(request, req, arrival)
    rid, created, engine = "cmpl-" + secrets.token_hex(12), int(time.time()), state.engine
    want = req.logprobs is not None
    try:
        if not req.stream:
            result = ChatResult()
            async for piece in gen.pieces(parse=False):
                result.add(piece)
            assert result.finished is not None
            lps = _completion_logprobs(engine, result.logprobs, 0) if want else None
            body = _completion(rid, req.model, created, "".join(result.content), result.finished.reason, lps)
            return web.json_response({**body, "usage": _usage(result.finished)})
        sse = EventStream(request)
        extra = {"usage": None} if req.include_usage else {}
        offset = 0
        try:
            async for piece in gen.pieces(parse=False):
                if isinstance(piece, Text):
                    await sse.send({**_completion(rid, req.model, created, piece.text, None, None), **extra})
                    offset += len(piece.text)
                elif isinstance(piece, Logprobs):
                    lps = _completion_logprobs(engine, piece.entries, offset)
                    await sse.send({**_completion(rid, req.model, created, "", None, lps), **extra})
                elif isinstance(piece, Finished):
                    await sse.send({**_completion(rid, req.model, created, "", piece.reason, None), **extra})
                    if req.include_usage:
                        await sse.send(
                            {
                                "id": rid,
                                "object": "text_completion",
                                "created": created,
                                "model": req.model,
                                "choices": [],
                                "usage": _usage(piece),
                            }
                        )
        except ApiError as e:
            await sse.send(openai_body(e))
        await sse.send("[DONE]")
        return await sse.finish()
    finally:
        gen.cancel()


async def list_models(request: web.Request) -> web.Response:
    """Both SDKs call `GET /v1/models`; the `anthropic-version` header picks Anthropic's shape."""
    state = request.app[STATE]
    if "anthropic-version" in request.headers:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.created))
        entry = {"type": "model", "id": state.model_id, "display_name": state.model_id, "created_at": created}
        return web.json_response(
            {"data": [entry], "has_more": False, "first_id": state.model_id, "last_id": state.model_id}
        )
    entry = {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "ninfer"}
    if state.engine is not None:
        entry["max_model_len"] = state.engine.max_context
    return web.json_response({"object": "list", "data": [entry]})


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.get("/v1/models", list_models),
    ]
