"""The Anthropic Messages API of `ninfer serve` through the real `anthropic` SDK against a live
server on the bundled demo model (random weights: structure and counts are checked, not text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from test_server_harness import TIMEOUT, LiveServer, demo_model, live_server  # noqa: F401  (fixture)

GREEDY = {"temperature": 0}  # the current SDK has no sampling arguments; they go in the body
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    yield from live_server(demo_model)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def talky(client: anthropic.Anthropic) -> list[dict]:
    """A conversation on which the random model, thinking off and greedy, writes 30 tokens."""
    for question in ("What is 2+2?", "Count to ten.", "Name a colour.", "Why is the sky blue?", "List three fruits."):
        messages = [{"role": "user", "content": question}]
        out = client.messages.create(
            model="demo", max_tokens=30, messages=messages, thinking={"type": "disabled"}, extra_body=GREEDY
        )
        if out.usage.output_tokens == 30 and out.content and len(out.content[0].text) > 20:
            return messages
    raise AssertionError("no test prompt makes the demo model write text")


def test_message_with_thinking(client: anthropic.Anthropic) -> None:
    out = client.messages.create(
        model="demo",
        max_tokens=10,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body=GREEDY,
    )
    assert out.type == "message" and out.role == "assistant" and out.model == "demo"
    assert out.content[0].type == "thinking" and out.content[0].thinking
    assert out.stop_reason in ("end_turn", "max_tokens") and out.stop_sequence is None
    assert out.usage.output_tokens <= 10 and out.usage.input_tokens > 5


def test_thinking_disabled_gives_a_text_block(client: anthropic.Anthropic, talky: list[dict]) -> None:
    out = client.messages.create(
        model="demo", max_tokens=8, messages=talky, thinking={"type": "disabled"}, extra_body=GREEDY
    )
    assert [b.type for b in out.content] == ["text"] and out.content[0].text
    assert out.stop_reason == "max_tokens"


def test_streaming_events_and_final_message_match_non_streaming(client: anthropic.Anthropic, talky: list[dict]) -> None:
    args = dict(model="demo", max_tokens=20, messages=talky, thinking={"type": "disabled"}, extra_body=GREEDY)
    full = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (full.stop_reason, full.usage.output_tokens)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop" and kinds[-2] == "message_delta"


def test_raw_stream_has_the_documented_event_order(server: LiveServer) -> None:
    body = {
        "model": "demo",
        "max_tokens": 12,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
    }
    status, headers, data = server.request("POST", "/v1/messages", body, {"anthropic-version": "2023-06-01"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in data.decode().strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        name = name_line.removeprefix("event: ")
        payload = json.loads(data_line.removeprefix("data: "))
        assert payload["type"] == name
        events.append(payload)
    names = [e["type"] for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[0]["message"]["usage"]["output_tokens"] == 0
    assert events[2]["content_block"]["type"] == "thinking"
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 12


def test_stop_sequences(client: anthropic.Anthropic, talky: list[dict]) -> None:
    args = dict(model="demo", max_tokens=30, messages=talky, thinking={"type": "disabled"}, extra_body=GREEDY)
    text = client.messages.create(**args).content[0].text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip() == text[i : i + 3])
    out = client.messages.create(**args, stop_sequences=[stop, "never-seen"])
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert out.content[0].text == text[: text.index(stop)].strip()


def test_tool_use_and_results_round_trip_like_openai(client: anthropic.Anthropic, server: LiveServer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}
            ],
        },
    ]
    counted = client.messages.count_tokens(
        model="demo", system=[{"type": "text", "text": "Be brief."}], messages=messages, tools=[WEATHER]
    )
    openai_form = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Use the tool.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": WEATHER["description"],
                    "parameters": WEATHER["input_schema"],
                },
            }
        ],
    }
    status, tokens = server.post("/tokenize", openai_form)
    assert status == 200 and counted.input_tokens == tokens["count"]
    text = server.post("/detokenize", {"tokens": tokens["tokens"]})[1]["prompt"]
    assert "<think>\nUse the tool.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    out = client.messages.create(
        model="demo",
        max_tokens=6,
        system="Be brief.",
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "auto"},
        extra_body=GREEDY,
    )
    assert out.usage.input_tokens == counted.input_tokens
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_tool_choice_none_leaves_the_tools_out(client: anthropic.Anthropic) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    with_tools = client.messages.count_tokens(model="demo", messages=hi, tools=[WEATHER]).input_tokens
    without = client.messages.count_tokens(
        model="demo", messages=hi, tools=[WEATHER], tool_choice={"type": "none"}
    ).input_tokens
    assert without == client.messages.count_tokens(model="demo", messages=hi).input_tokens < with_tools


def test_models_list_in_anthropic_shape(client: anthropic.Anthropic) -> None:
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_unsupported_requests_are_refused(client: anthropic.Anthropic) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    cases = [
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                        ],
                    }
                ]
            ),
            "'image' blocks are not supported",
        ),
        (dict(messages=hi, tools=[WEATHER], tool_choice={"type": "any"}), "not supported yet"),
        (dict(messages=hi + [{"role": "assistant", "content": "The answer is"}]), "prefilled response"),
        (
            dict(messages=hi, output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}),
            "output_config",
        ),
        (dict(messages=hi, tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tools"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="demo", max_tokens=4, **kwargs)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
        assert needle in info.value.body["error"]["message"], (kwargs, info.value.body)
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-x", max_tokens=4, messages=hi)
    assert info.value.body["error"] == {
        "type": "not_found_error",
        "message": "the model `claude-x` does not exist; this server serves `demo`",
    }
