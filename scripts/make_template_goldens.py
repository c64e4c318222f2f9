"""Render ninfer's fallback chat template with Hugging Face transformers and store the results.

The prompts written to tests/fixtures/chat_template_goldens.json are what
`apply_chat_template(..., tokenize=False)` produces for python/ninfer/templates/qwen3_6.jinja;
tests/test_chat.py checks that ninfer's own renderer (python/ninfer/chat.py) gives the same
strings without transformers installed. Needs transformers and tokenizers.

Usage: python scripts/make_template_goldens.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "python" / "ninfer" / "templates" / "qwen3_6.jinja"
OUTPUT = ROOT / "tests" / "fixtures" / "chat_template_goldens.json"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer"},
                "options": {"type": "object"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Sök på webben — returns top hits.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "safe": {"type": "boolean"},
                "threshold": {"type": ["number", "null"]},
            },
            "required": ["query"],
        },
    },
}


def call(name: str, arguments: dict, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}

CASES: list[dict] = [
    {"name": "system_and_user", "messages": [SYSTEM, {"role": "user", "content": "Hi"}]},
    {"name": "user_only", "messages": [{"role": "user", "content": "Hello there"}]},
    {
        "name": "thinking_off",
        "messages": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "thinking_explicitly_on",
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "multi_turn_history",
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one."},
            {"role": "assistant", "content": "Green."},
            {"role": "user", "content": "And one more?"},
        ],
    },
    {
        "name": "no_generation_prompt",
        "messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "Hi!"},
        ],
        "kwargs": {"add_generation_prompt": False},
    },
    {
        "name": "tools_without_system",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
    },
    {
        "name": "tools_with_system",
        "messages": [SYSTEM, {"role": "user", "content": "Find recent news about Jinja."}],
        "tools": [WEATHER, SEARCH],
    },
    {
        "name": "tool_call_string_int_object",
        "messages": [
            {"role": "user", "content": "Weather in Paris for 3 days, metric please."},
            {
                "role": "assistant",
                "content": "I will look it up.",
                "tool_calls": [
                    call("get_weather", {"city": "Paris", "days": 3, "options": {"units": "metric", "hourly": False}})
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
        ],
        "tools": [WEATHER],
    },
    {
        "name": "consecutive_tool_results",
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Compare the weather in Oslo and Rome."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call("get_weather", {"city": "Oslo"}, "call_a"),
                    call("get_weather", {"city": "Rome", "days": 2}, "call_b"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "Oslo: 4 C, rain"},
            {"role": "tool", "tool_call_id": "call_b", "content": "Rome: 19 C, sun"},
            {"role": "assistant", "content": "Rome is warmer."},
            {"role": "user", "content": "Thanks! And Madrid?"},
        ],
        "tools": [WEATHER],
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "bare_tool_calls_null_content",
        "messages": [
            {"role": "user", "content": "Search for cats and dogs."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"name": "search", "arguments": {"query": "cats", "limit": 5, "tags": ["pets", "animals"]}},
                    {"name": "search", "arguments": {"query": "dogs", "safe": True, "threshold": None}},
                    {"name": "search", "arguments": {"query": "birds", "threshold": 0.25}},
                ],
            },
            {"role": "tool", "content": "cats: 10 hits"},
            {"role": "tool", "content": "dogs: 7 hits"},
            {"role": "tool", "content": "birds: 3 hits"},
        ],
        "tools": [SEARCH],
    },
    {
        "name": "reasoning_content_before_and_after_last_query",
        "messages": [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer", "reasoning_content": "Old reasoning, dropped."},
            {"role": "user", "content": "What is the weather in Lima?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "\nI should call the tool.\n",
                "tool_calls": [call("get_weather", {"city": "Lima"})],
            },
            {"role": "tool", "content": "Lima: 18 C"},
            {"role": "assistant", "content": "It is 18 C in Lima.", "reasoning_content": "The tool said 18 C."},
        ],
        "tools": [WEATHER],
        "kwargs": {"add_generation_prompt": False},
    },
    {
        "name": "think_in_content",
        "messages": [
            {"role": "user", "content": "One"},
            {"role": "assistant", "content": "<think>\nhidden old thoughts\n</think>\n\nAnswer one"},
            {"role": "user", "content": "Two"},
            {"role": "assistant", "content": "<think>\nfresh thoughts\n</think>\n\nAnswer two"},
        ],
        "kwargs": {"add_generation_prompt": False},
    },
    {
        "name": "think_in_content_nested_and_repeated",
        "messages": [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": "pre <think>a<think>\nb\n</think>\n\nmid</think>\n\n\nfinal"},
        ],
        "kwargs": {"add_generation_prompt": False},
    },
    {
        "name": "reasoning_content_wins_over_think_tags",
        "messages": [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": "<think>x</think>shown", "reasoning_content": "given"},
        ],
    },
    {
        "name": "preserve_thinking",
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "<think>R2</think>A2"},
            {"role": "user", "content": "Q3"},
            {"role": "assistant", "content": "A3"},
            {"role": "user", "content": "Q4"},
        ],
        "kwargs": {"preserve_thinking": True},
    },
    {
        "name": "preserve_thinking_off_same_history",
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
        ],
        "kwargs": {"preserve_thinking": False},
    },
    {
        "name": "list_contents",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}]},
            {"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
            {"role": "user", "content": [{"type": "text", "text": "Again"}]},
        ],
    },
    {
        "name": "images_and_video",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "a.png"},
                    {"type": "image_url", "image_url": {"url": "b.png"}},
                    {"type": "video", "video": "c.mp4"},
                    {"type": "text", "text": "Describe these."},
                ],
            }
        ],
    },
    {
        "name": "images_with_vision_ids",
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "And"}]},
            {"role": "assistant", "content": "A cat."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "b.png"},
                    {"type": "video", "video": "c.mp4"},
                    {"type": "text", "text": "these?"},
                ],
            },
        ],
        "kwargs": {"add_vision_id": True},
    },
    {
        "name": "whitespace_trimming",
        "messages": [
            {"role": "system", "content": "  \n sys \n"},
            {"role": "user", "content": "\n\n  hello  \n"},
            {"role": "assistant", "content": "\n  reply \n\n"},
            {"role": "user", "content": " again "},
        ],
    },
    {
        "name": "tool_response_user_is_not_last_query",
        "messages": [
            {"role": "user", "content": "Real question"},
            {"role": "assistant", "content": "Partial", "reasoning_content": "kept because after the query"},
            {"role": "user", "content": "<tool_response>\nmanual result\n</tool_response>"},
            {"role": "assistant", "content": "Final", "reasoning_content": "also kept"},
        ],
        "kwargs": {"add_generation_prompt": False},
    },
    {
        "name": "unicode",
        "messages": [
            {"role": "system", "content": "Réponds en français. 日本語もOK."},
            {"role": "user", "content": "Ça va? 🙂"},
        ],
        "tools": [SEARCH],
    },
]


def main() -> int:
    backend = Tokenizer(WordLevel({"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = TEMPLATE.read_text(encoding="utf-8")
    goldens = []
    for case in CASES:
        kwargs = dict(case.get("kwargs", {}))
        kwargs.setdefault("add_generation_prompt", True)
        expected = tokenizer.apply_chat_template(
            case["messages"], tools=case.get("tools"), tokenize=False, **kwargs
        )
        goldens.append(
            {
                "name": case["name"],
                "messages": case["messages"],
                "tools": case.get("tools"),
                "kwargs": kwargs,
                "expected": expected,
            }
        )
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(goldens, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(goldens)} conversations to {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
