"""The OpenAI API of `ninfer serve` through the real `openai` SDK against a live server on the
bundled demo model (random weights: the text is noise, so the tests check structure, counts,
determinism and what the prompt held, not wording)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from test_server_harness import TIMEOUT, LiveServer, demo_model, live_server  # noqa: F401  (fixture)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
HI = [{"role": "user", "content": "Say something."}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    yield from live_server(demo_model)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def talky(client: openai.OpenAI) -> list[dict]:
    """A conversation on which the random model, thinking off and greedy, writes 40 tokens of
    content rather than stopping at once (it does either, depending on the prompt)."""
    for question in ("What is 2+2?", "Count to ten.", "Name a colour.", "Why is the sky blue?", "List three fruits."):
        messages = [{"role": "user", "content": question}]
        out = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=40, temperature=0, extra_body=OFF
        )
        if out.usage.completion_tokens == 40 and len(out.choices[0].message.content) > 20:
            return messages
    raise AssertionError("no test prompt makes the demo model write content")


def _prompt_text(server: LiveServer, body: dict) -> str:
    status, out = server.post("/tokenize", body)
    assert status == 200, out
    status, text = server.post("/detokenize", {"tokens": out["tokens"]})
    assert status == 200
    return text["prompt"]


def test_models_lists_the_served_model(client: openai.OpenAI, server: LiveServer) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"]
    assert models[0].model_extra["max_model_len"] == server.engine.max_context


def test_chat_completion(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="demo", messages=HI, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.model == "demo"
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # Thinking is on by default: the output starts inside the think block, so it is reasoning.
    extra = choice.message.model_extra
    assert extra["reasoning_content"] and extra["reasoning"] == extra["reasoning_content"]


def test_streaming_equals_non_streaming_and_reports_usage(client: openai.OpenAI, talky: list[dict]) -> None:
    full = client.chat.completions.create(model="demo", messages=talky, max_tokens=16, temperature=0, extra_body=OFF)
    stream = client.chat.completions.create(
        model="demo",
        messages=talky,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=OFF,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_thinking_off_gives_content_and_an_empty_think_block(
    client: openai.OpenAI, server: LiveServer, talky: list[dict]
) -> None:
    out = client.chat.completions.create(model="demo", messages=talky, max_tokens=12, temperature=0, extra_body=OFF)
    msg = out.choices[0].message
    assert msg.content and msg.model_extra["reasoning_content"] is None
    on = client.chat.completions.create(model="demo", messages=talky, max_tokens=12, temperature=0)
    assert on.choices[0].message.model_extra["reasoning_content"] and not on.choices[0].message.content
    assert _prompt_text(server, {"messages": HI, **OFF}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _prompt_text(server, {"messages": HI}).endswith("<|im_start|>assistant\n<think>\n")


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(client: openai.OpenAI) -> None:
    def run(**kw: object) -> str:
        out = client.chat.completions.create(model="demo", messages=HI, max_tokens=16, **kw)
        return out.choices[0].message.model_extra["reasoning_content"] or ""

    assert run(temperature=0) == run(temperature=0)
    sampled = {run(temperature=1.0, top_p=0.9, seed=s, extra_body={"top_k": 50, "min_p": 0.01}) for s in (1, 1, 2)}
    assert len(sampled) == 2  # same seed, same text; another seed, another text
    assert run(
        temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, seed=3, extra_body={"repetition_penalty": 1.1}
    )


def test_stop_strings_end_the_output(client: openai.OpenAI, talky: list[dict]) -> None:
    full = (
        client.chat.completions.create(model="demo", messages=talky, max_tokens=40, temperature=0, extra_body=OFF)
        .choices[0]
        .message.content
    )
    stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if full[i : i + 3].strip() == full[i : i + 3])
    out = client.chat.completions.create(
        model="demo", messages=talky, max_tokens=40, temperature=0, stop=[stop], extra_body=OFF
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == full[: full.index(stop)].strip()
    assert out.usage.completion_tokens < 40


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="demo", messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens == 8
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs))  # greedy: the best one
        assert bytes(e.bytes).decode("utf-8") == e.token
    plain = client.chat.completions.create(model="demo", messages=HI, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_tools_are_rendered_and_tool_choice_none_drops_them(client: openai.OpenAI, server: LiveServer) -> None:
    with_tools = _prompt_text(server, {"messages": HI, "tools": [WEATHER]})
    assert "# Tools" in with_tools and '"name": "get_weather"' in with_tools
    assert "# Tools" not in _prompt_text(server, {"messages": HI, "tools": [WEATHER], "tool_choice": "none"})
    out = client.chat.completions.create(
        model="demo", messages=HI, tools=[WEATHER], tool_choice="auto", max_tokens=8, temperature=0
    )
    plain = client.chat.completions.create(model="demo", messages=HI, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_call_history_and_results_round_trip_into_the_prompt(server: LiveServer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny, 21 C"}]},
    ]
    text = _prompt_text(server, {"messages": messages, "tools": [WEATHER]})
    assert (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>"
        in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n" in text
    assert "\n\nBe brief.<|im_end|>" in text  # the system prompt follows the tool block
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_multi_turn_with_reasoning_history(client: openai.OpenAI, server: LiveServer) -> None:
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut", "reasoning_content": "greet back"},
        {"role": "user", "content": [{"type": "text", "text": "How are "}, {"type": "text", "text": "you?"}]},
    ]
    text = _prompt_text(server, {"messages": messages})
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    assert "<|im_start|>assistant\nSalut<|im_end|>" in text  # older reasoning is dropped (spec 5.2 item 4)
    assert "<|im_start|>user\nHow are you?<|im_end|>" in text
    out = client.chat.completions.create(model="demo", messages=messages, max_tokens=4)
    assert out.usage.prompt_tokens == server.post("/tokenize", {"messages": messages})[1]["count"]


def test_completions(client: openai.OpenAI, server: LiveServer) -> None:
    out = client.completions.create(model="demo", prompt="def main():", max_tokens=10, temperature=0, logprobs=2)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == out.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="demo", prompt="def main():", max_tokens=10, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == choice.text
    ids = server.post("/tokenize", {"prompt": "def main():"})[1]["tokens"]
    by_ids = client.completions.create(model="demo", prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == choice.text and by_ids.usage.prompt_tokens == len(ids)
    assert client.completions.create(model="demo", prompt="x", temperature=0).usage.completion_tokens <= 16


def test_unsupported_features_are_refused_not_ignored(client: openai.OpenAI) -> None:
    cases = [
        (dict(n=2), "`n` > 1 is not supported"),
        (dict(parallel_tool_calls=False, tools=[WEATHER]), "parallel_tool_calls"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
            "constrained decoding",
        ),
        (dict(tools=[WEATHER], tool_choice="required"), "tool_choice=required is not supported yet"),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
            "not supported yet",
        ),
        (dict(logit_bias={"5": 10}), "logit_bias"),
        (dict(extra_body={"frobnicate": True}), "unknown field `frobnicate`"),
        (dict(reasoning_effort="low"), "enable_thinking"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="demo", messages=HI, max_tokens=4, **kwargs)
        assert needle in info.value.message, (kwargs, info.value.message)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=image, max_tokens=4)
    assert "text only" in info.value.message and info.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=["a", "b"], max_tokens=4)
    assert "batched prompts" in info.value.message


def test_a_returned_message_can_be_sent_back(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="demo", messages=HI, max_tokens=6, temperature=0)
    follow = HI + [first.choices[0].message, {"role": "user", "content": "And then?"}]
    out = client.chat.completions.create(model="demo", messages=follow, max_tokens=4)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 5
