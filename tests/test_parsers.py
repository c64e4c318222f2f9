"""Output parsing (model-spec.md section 5.3): reasoning split, Qwen XML tool calls with schema
typing, and streaming behaviour (held-back tags, chunking independence, malformed input)."""

from __future__ import annotations

import random
import re

import pytest

from ninfer.chat import default_template, render_chat
from ninfer.parsers import (
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCall,
    parse_output,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "options": {"type": "object"},
                    "hours": {"type": "array"},
                    "limit": {"type": ["integer", "null"]},
                    "unit": {"enum": ["c", "f"]},
                    "level": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
            },
        },
    },
    {"name": "lookup", "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}},
]


def call_block(name: str, params: list[tuple[str, str]]) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


def stream(text: str, tools: list | None, thinking: bool, sizes: list[int]) -> list:
    parser = OutputParser(tools, thinking)
    events, pos, i = [], 0, 0
    while pos < len(text):
        step = sizes[i % len(sizes)]
        events += parser.feed(text[pos : pos + step])
        pos += step
        i += 1
    return events + parser.finish()


def summary(events: list) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]
    return reasoning, content, calls


def test_reasoning_then_content() -> None:
    assert parse_output("Think hard.\n</think>\n\nThe answer is 4.") == ("Think hard.", "The answer is 4.", [])


def test_truncated_thinking_is_all_reasoning() -> None:
    assert parse_output("still thinking </thi", thinking=True) == ("still thinking </thi", "", [])


def test_thinking_off_is_all_content() -> None:
    assert parse_output("plain </think> text", thinking=False) == ("", "plain </think> text", [])


@pytest.mark.parametrize("thinking", [True, False])
def test_output_opening_its_own_think_block(thinking: bool) -> None:
    text = "<think>\nreason\n</think>\n\nanswer"
    assert parse_output(text, thinking=thinking) == ("reason", "answer", [])
    assert parse_output("<think>\n\n</think>\n\nanswer", thinking=thinking) == ("", "answer", [])


def test_only_first_close_ends_reasoning() -> None:
    assert parse_output("r</think>a</think>b") == ("r", "a</think>b", [])


def test_schema_typing() -> None:
    text = "Checking.\n</think>\n\nOn it.\n\n" + call_block(
        "get_weather",
        [
            ("city", "42"),
            ("days", "3"),
            ("ratio", "0.5"),
            ("metric", "true"),
            ("options", '{"a": [1, 2]}'),
            ("hours", "[1, 2]"),
            ("limit", "null"),
            ("unit", "c"),
            ("level", "7"),
            ("extra", "[1]"),
        ],
    )
    reasoning, content, calls = parse_output(text, TOOLS)
    assert (reasoning, content) == ("Checking.", "On it.")
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].arguments == {
        "city": "42",
        "days": 3,
        "ratio": 0.5,
        "metric": True,
        "options": {"a": [1, 2]},
        "hours": [1, 2],
        "limit": None,
        "unit": "c",
        "level": 7,
        "extra": "[1]",
    }
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_bad_json_falls_back_to_raw_string() -> None:
    _, _, calls = parse_output(call_block("get_weather", [("days", "three"), ("metric", "True")]), TOOLS, False)
    assert calls[0].arguments == {"days": "three", "metric": "True"}


def test_unknown_tool_keeps_raw_strings_and_bare_tool_schema_is_used() -> None:
    _, _, calls = parse_output(call_block("other", [("n", "5")]) + call_block("lookup", [("id", "5")]), TOOLS, False)
    assert [(c.name, c.arguments) for c in calls] == [("other", {"n": "5"}), ("lookup", {"id": 5})]


def test_string_values_lose_only_one_newline_each_side() -> None:
    _, _, calls = parse_output(call_block("get_weather", [("city", "\n  two\nlines\n")]), TOOLS, False)
    assert calls[0].arguments == {"city": "\n  two\nlines\n"}


def test_multiple_calls_have_distinct_ids() -> None:
    text = "\n".join(call_block("lookup", [("id", str(i))]) for i in range(3))
    reasoning, content, calls = parse_output(text, TOOLS, thinking=False)
    assert (reasoning, content) == ("", "")
    assert [c.arguments["id"] for c in calls] == [0, 1, 2]
    assert len({c.id for c in calls}) == 3


def test_no_tools_means_tool_text_is_content() -> None:
    text = call_block("lookup", [("id", "1")])
    assert parse_output(text, None, thinking=False) == ("", text, [])


SAMPLES = [
    ("plain reasoning\n</think>\n\nplain answer", None, True),
    ("<think>\nr</think>\n\n<tool_call>", None, False),
    ("a </thing> b\n</think>\n\nc  d\n", None, True),
    ("why\n</think>\n\nDoing it.\n\n" + call_block("get_weather", [("city", "Oslo"), ("days", "2")])
     + "\n" + call_block("lookup", [("id", "9")]), TOOLS, True),
    ("x <tool_cal y <tool_call>\n<function=lookup>\n<parameter=id>\n1\n</parameter>\n</function>\n</tool_call> z",
     TOOLS, False),
    ("</think>" + call_block("lookup", [("id", "1")]) + "\n<tool_call>\n<function=lookup>\n<param", TOOLS, True),
    ("<thinking> is not a tag", None, False),
    ("   \n", TOOLS, True),
    ("", TOOLS, False),
]


@pytest.mark.parametrize(("text", "tools", "thinking"), SAMPLES)
def test_streaming_matches_whole_text(text: str, tools: list | None, thinking: bool) -> None:
    whole = summary(stream(text, tools, thinking, [max(len(text), 1)]))
    assert whole == summary(stream(text, tools, thinking, [1]))
    rng = random.Random(len(text))
    for _ in range(5):
        sizes = [rng.randint(1, 7) for _ in range(11)]
        assert summary(stream(text, tools, thinking, sizes)) == whole
    reasoning, content, calls = parse_output(text, tools, thinking)
    assert (reasoning, content, [(c.name, c.arguments) for c in calls]) == whole


def test_partial_close_tag_is_held_back() -> None:
    parser = OutputParser(None, thinking=True)
    assert parser.feed("abc</thi") == [ReasoningDelta("abc")]
    assert parser.feed("nk>\n\nxy") == [ContentDelta("xy")]
    assert parser.finish() == []


def test_partial_tag_that_is_not_a_tag_is_released() -> None:
    parser = OutputParser(None, thinking=True)
    assert parser.feed("a </thi") == [ReasoningDelta("a")]
    assert parser.feed("s") == [ReasoningDelta(" </this")]


def test_partial_call_tag_is_held_back_and_call_emitted_whole() -> None:
    parser = OutputParser(TOOLS, thinking=False)
    assert parser.feed("Sure <tool_ca") == [ContentDelta("Sure")]
    assert parser.feed("ll>\n<function=lookup>\n<parameter=id>\n4") == []
    events = parser.feed("\n</parameter>\n</function>\n</tool_call>")
    assert len(events) == 1 and isinstance(events[0], ToolCall)
    assert (events[0].name, events[0].arguments) == ("lookup", {"id": 4})
    assert parser.finish() == []


def test_start_of_think_tag_is_held_when_thinking_off() -> None:
    parser = OutputParser(None, thinking=False)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nhmm\n</think>\n\nok") == [ReasoningDelta("hmm"), ContentDelta("ok")]


def test_unterminated_call_becomes_content() -> None:
    text = "Let me check.\n\n<tool_call>\n<function=lookup>\n<parameter=id>\n1"
    assert parse_output(text, TOOLS, thinking=False) == ("", text, [])


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\nno function here\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=lookup\n</tool_call>",
        "<tool_call>\n<function=lookup>\n<parameter=id\n</function>\n</tool_call>",
        "<tool_call>\n<function=lookup>\n</function>\ntrailing junk\n</tool_call>",
    ],
)
def test_malformed_call_becomes_content(block: str) -> None:
    assert parse_output("Before " + block + " after", TOOLS, thinking=False) == ("", "Before " + block + " after", [])


def test_feed_after_finish_is_an_error() -> None:
    parser = OutputParser(None, thinking=False)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_round_trip_through_the_template() -> None:
    arguments = {"city": "Paris\nFrance", "days": 3, "options": {"u": "metric", "n": [1, None]}, "metric": False}
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking now.",
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": arguments}},
                {"function": {"name": "lookup", "arguments": {"id": 12}}},
            ],
        },
    ]
    prompt = render_chat(default_template(), messages, TOOLS, add_generation_prompt=False)
    generated = prompt.split("<|im_start|>assistant\n<think>\n", 1)[1].removesuffix("<|im_end|>\n")
    reasoning, content, calls = parse_output(generated, TOOLS, thinking=True)
    assert (reasoning, content) == ("Need the tool.", "Checking now.")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", arguments), ("lookup", {"id": 12})]
