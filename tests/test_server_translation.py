"""The server's translation layer without a server: requests of both APIs into the one internal
`GenerationRequest`, and canned model output (Qwen XML tool calls, think blocks) into each API's
responses and stream events, checked with the SDKs' own types and stream accumulators."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import TypeAdapter

from ninfer.chat import default_template, render_chat
from ninfer.parsers import OutputParser
from ninfer.server.anthropic import MessageBuilder, StreamEvents, parse_count_tokens, parse_messages, stop_reason
from ninfer.server.errors import ApiError
from ninfer.server.generation import Finished, Logprobs, Piece
from ninfer.server.metrics import Metrics
from ninfer.server.openai import ChatChunks, ChatResult, parse_chat
from ninfer.server.schemas import Field, GenerationRequest, read_object, sampling_params

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}
CANNED = (
    "The user wants weather.\n</think>\n\nLet me check.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n</function>\n</tool_call>"
)
DONE = Finished(reason="stop", stop_sequence=None, prompt_tokens=30, completion_tokens=50)


def canned_pieces(text: str = CANNED, step: int = 3, tools: list | None = None) -> list[Piece]:
    """What `Generation.pieces` yields for `text` arriving in `step`-character deltas."""
    parser = OutputParser([WEATHER] if tools is None else tools, thinking=True)
    out: list[Piece] = []
    for i in range(0, len(text), step):
        out.extend(parser.feed(text[i : i + step]))
    return out + parser.finish() + [DONE]


def test_openai_response_from_canned_tool_calls() -> None:
    result = ChatResult()
    for piece in canned_pieces():
        result.add(piece)
    body = result.response("chatcmpl-1", "demo", lambda t: f"<{t}>", want_logprobs=False)
    out = openai.types.chat.ChatCompletion.model_validate(body)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1].function.arguments) == {"city": "San José"}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_openai_stream_of_canned_tool_calls_accumulates_to_the_same_message() -> None:
    chunks = ChatChunks("chatcmpl-1", "demo", include_usage=True, text_of=str)
    state = ChatCompletionStreamState()
    raw = [chunks.first()] + [c for p in canned_pieces(step=1) for c in chunks.add(p)]
    for chunk in raw:
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"city": "Paris", "days": 3},
        {"city": "San José"},
    ]
    assert [
        c["choices"][0]["delta"]["tool_calls"][0]["index"]
        for c in raw
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ] == [0, 1]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in raw if c["choices"])
    assert reasoning == "The user wants weather."
    assert raw[-1]["choices"] == [] and raw[-1]["usage"]["total_tokens"] == 80


def test_without_tools_the_xml_stays_content() -> None:
    result = ChatResult()
    for piece in canned_pieces(tools=[]):
        result.add(piece)
    body = result.response("x", "demo", str, want_logprobs=False)
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["tool_calls"] is None
    assert "<tool_call>" in body["choices"][0]["message"]["content"]


def test_logprobs_are_reported_per_token() -> None:
    result = ChatResult()
    for piece in [Logprobs([(7, -0.5, [(7, -0.5), (9, -1.5)])]), Logprobs([(8, -0.25, [(8, -0.25), (7, -2.0)])]), DONE]:
        result.add(piece)
    body = result.response("x", "demo", lambda t: "tok" + str(t), want_logprobs=True)
    content = body["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("tok7", -0.5), ("tok8", -0.25)]
    assert content[0]["top_logprobs"][1] == {"token": "tok9", "logprob": -1.5, "bytes": list(b"tok9")}


def test_anthropic_message_from_canned_tool_calls() -> None:
    builder = MessageBuilder()
    for piece in canned_pieces():
        builder.add(piece)
    out = anthropic.types.Message.model_validate(builder.message("msg_1", "demo"))
    assert [b.type for b in out.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert out.content[0].thinking == "The user wants weather." and out.content[1].text == "Let me check."
    assert out.content[2].input == {"city": "Paris", "days": 3} and out.content[3].input == {"city": "San José"}
    assert out.stop_reason == "tool_use" and out.usage.input_tokens == 30


def test_anthropic_stream_of_canned_tool_calls() -> None:
    events = StreamEvents("msg_1", "demo", prompt_tokens=30)
    stream = events.start() + [e for p in canned_pieces(step=2) for e in events.add(p)]
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for name, data in stream:
        if name != "ping":  # not part of the SDK's event union; it skips pings
            assert adapter.validate_python(data).type == name
    names = [name for name, _ in stream]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in stream if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    stops = [d["index"] for n, d in stream if n == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    blocks: dict[int, str] = {}
    for name, data in stream:
        if name == "content_block_delta":
            delta = data["delta"]
            blocks[data["index"]] = blocks.get(data["index"], "") + delta.get(
                "thinking", delta.get("text", delta.get("partial_json", ""))
            )
    assert blocks == {
        0: "The user wants weather.",
        1: "Let me check.",
        2: '{"city": "Paris", "days": 3}',
        3: '{"city": "San José"}',
    }
    assert stream[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_stop_reasons() -> None:
    assert stop_reason(Finished("length", None, 1, 1), 0) == "max_tokens"
    assert stop_reason(Finished("stop", "END", 1, 1), 0) == "stop_sequence"
    assert stop_reason(Finished("stop", None, 1, 1), 2) == "tool_use"
    assert stop_reason(Finished("stop", None, 1, 1), 0) == "end_turn"


def test_openai_request_translation() -> None:
    req = parse_chat(
        {
            "model": "demo",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [WEATHER],
            "max_completion_tokens": 9,
            "stop": "END",
            "top_k": -1,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False},
        },
        "demo",
    )
    assert req.messages is not None and req.messages[0] == {"role": "system", "content": "Be brief."}
    assert req.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert req.messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert (req.max_tokens, req.stop, req.logprobs, req.stream, req.include_usage) == (9, ["END"], 2, True, True)
    assert req.sampling == {"top_k": 0} and req.template_kwargs == {"enable_thinking": False}
    assert (
        parse_chat(
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [WEATHER],
                "tool_choice": "none",
            },
            "demo",
        ).tools
        is None
    )


def test_anthropic_and_openai_conversations_render_identically() -> None:
    anthropic_req = parse_messages(
        {
            "model": "demo",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            "thinking": {"type": "disabled"},
            "stop_sequences": ["END"],
            "top_k": 5,
        },
        "demo",
    )
    openai_req = parse_chat(
        {
            "model": "demo",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "t1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
                {"role": "user", "content": "And tomorrow?"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "",
                        "parameters": WEATHER["function"]["parameters"],
                    },
                }
            ],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        "demo",
    )

    def render(req: GenerationRequest) -> str:
        assert req.messages is not None
        return render_chat(default_template(), req.messages, req.tools, **req.template_kwargs)

    assert render(anthropic_req) == render(openai_req)
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>user\nAnd tomorrow?" in render(
        anthropic_req
    )
    assert (anthropic_req.stop, anthropic_req.sampling, anthropic_req.max_tokens) == (["END"], {"top_k": 5}, 5)
    counted = parse_count_tokens(
        {"model": "demo", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "adaptive"}}, "demo"
    )
    assert counted.template_kwargs == {"enable_thinking": True}


def test_sampling_defaults_come_from_the_generation_config() -> None:
    gen = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    req = GenerationRequest(model="m", sampling={"top_p": 0.5}, max_tokens=None)
    params = sampling_params(req, gen, prompt_tokens=100, max_context=1000)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.5, 20, 900)
    greedy = sampling_params(
        GenerationRequest(model="m", max_tokens=7), {"do_sample": False, "temperature": 0.7}, 1, 10
    )
    assert (greedy.temperature, greedy.max_tokens) == (0.0, 7)


def test_read_object_names_the_field() -> None:
    fields = {"a": Field(("integer",), required=True, minimum=1), "b": Field(("string",), choices=("x", "y"))}
    assert read_object({"a": 2, "b": None}, fields, "p") == {"a": 2}
    for value, message in [
        ({"a": True}, "`p.a` must be an integer, got bool"),
        ({"a": 0}, "`p.a` must be >= 1, got 0"),
        ({"a": 1, "b": "z"}, "`p.b` must be one of 'x', 'y', got 'z'"),
        ({}, "`p.a` is required"),
        ({"a": 1, "c": 1}, "unknown field `p.c`"),
        ({"a": 1, "old": 1}, "`p.old` is not supported: gone"),
    ]:
        with pytest.raises(ApiError) as info:
            read_object(value, fields, "p", unsupported={"old": "gone"})
        assert info.value.status == 400 and info.value.message == message


def test_metrics_exposition() -> None:
    m = Metrics()
    m.count_request("/v1/messages", 200)
    m.count_request("/v1/messages", 200)
    for v in (0.003, 0.2, 100.0):
        m.observe(m.ttft, v)
    text = m.render(
        {
            "running": 2,
            "waiting": 1,
            "slots_total": 8,
            "slots_used": 2,
            "prompt_tokens": 10,
            "generated_tokens": 5,
            "steps": 4,
        }
    )
    lines = set(text.splitlines())
    assert 'ninfer_requests_total{endpoint="/v1/messages",status="200"} 2' in lines
    assert 'ninfer_time_to_first_token_seconds_bucket{le="0.005"} 1' in lines
    assert 'ninfer_time_to_first_token_seconds_bucket{le="0.25"} 2' in lines
    assert 'ninfer_time_to_first_token_seconds_bucket{le="+Inf"} 3' in lines
    assert {
        "ninfer_requests_running 2",
        "ninfer_slots_total 8",
        "ninfer_generation_tokens_total 5",
        "ninfer_model_ready 1",
    } <= lines
    assert "ninfer_model_ready 0" in Metrics().render(None).splitlines()
