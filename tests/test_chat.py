"""Chat template rendering: ninfer's renderer against transformers-made goldens, the rules of
model-spec.md section 5.2 checked directly, and error handling."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from ninfer.chat import ChatTemplateError, default_template, render_chat

GOLDENS = json.loads(
    (Path(__file__).parent / "fixtures" / "chat_template_goldens.json").read_text(encoding="utf-8")
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_goldens_cover_the_required_cases() -> None:
    assert len(GOLDENS) >= 15
    names = {g["name"] for g in GOLDENS}
    assert len(names) == len(GOLDENS)
    rendered = "".join(g["expected"] for g in GOLDENS)
    for piece in ("<tool_call>", "<tool_response>", "<think>\n\n</think>\n\n", "<|image_pad|>"):
        assert piece in rendered


@pytest.mark.parametrize("golden", GOLDENS, ids=[g["name"] for g in GOLDENS])
def test_render_matches_transformers_golden(golden: dict) -> None:
    got = render_chat(default_template(), golden["messages"], golden["tools"], **golden["kwargs"])
    assert got == golden["expected"]


def test_spec_example_no_tools_thinking_on() -> None:
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    assert render_chat(default_template(), messages) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_generation_prompt_variants() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    head = "<|im_start|>user\nHi<|im_end|>\n"
    template = default_template()
    assert render_chat(template, messages, enable_thinking=False) == (
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render_chat(template, messages, add_generation_prompt=False) == head


def test_tool_header_structure() -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    text = render_chat(default_template(), messages, [WEATHER])
    prefix = (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + "\n</tools>\n\n"
    )
    assert text.startswith(prefix)
    assert text.count("<|im_start|>system") == 1
    assert "\n\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" in text


def test_assistant_tool_calls_and_tool_run() -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}},
                {"function": {"name": "get_weather", "arguments": {"city": "Rome", "flags": [True, None]}}},
            ],
        },
        {"role": "tool", "content": " sunny "},
        {"role": "tool", "content": "rain"},
    ]
    text = render_chat(default_template(), messages, [WEATHER], add_generation_prompt=False)
    assert text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nLooking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=flags>\n[true, null]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
    )


def test_reasoning_dropped_before_last_query_kept_after() -> None:
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "a", "reasoning_content": "old"},
        {"role": "user", "content": "B"},
        {"role": "assistant", "content": "b", "reasoning_content": "new"},
    ]
    text = render_chat(default_template(), messages, add_generation_prompt=False)
    assert "old" not in text
    assert "<|im_start|>assistant\na<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nnew\n</think>\n\nb<|im_end|>\n")
    kept = render_chat(default_template(), messages, add_generation_prompt=False, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nold\n</think>\n\na<|im_end|>\n" in kept


def test_template_uses_exact_special_tokens() -> None:
    template = default_template()
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<|vision_start|>", "<|image_pad|>",
                  "<|video_pad|>", "<|vision_end|>"):
        assert token in template


def test_environment_features() -> None:
    template = (
        "{{ bos_token }}{{ messages[0]|tojson(indent=2, sort_keys=true) }}|"
        "{{ {'b': 1, 'a': 'é<'}|tojson }}|{{ {'a': 1}|tojson(separators=(',', ':')) }}|"
        "{% for m in [1, 2, 3] %}{% if m == 2 %}{% break %}{% endif %}{{ m }}{% endfor %}|"
        "{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}"
    )
    got = render_chat(template, [{"role": "user", "content": "x"}], bos_token="<s>")
    expected_first = json.dumps({"role": "user", "content": "x"}, indent=2, sort_keys=True)
    assert got == f'<s>{expected_first}|{{"b": 1, "a": "é<"}}|{{"a":1}}|1|{datetime.now():%Y}'


def test_block_whitespace_control() -> None:
    # trim_blocks drops the newline after a block tag; lstrip_blocks drops indentation before one.
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    got = render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert got == "[a]\n[b]\n"


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.mark.parametrize(
    ("messages", "tools", "fragment"),
    [
        ([_user("a"), {"role": "system", "content": "late"}], None, "first message"),
        ([{"role": "system", "content": "s"}], None, "no user query"),
        ([{"role": "assistant", "content": "x"}], None, "no user query"),
        ([_user("<tool_response>\nr\n</tool_response>")], None, "no user query"),
        ([_user("a"), {"role": "robot", "content": "x"}], None, "Unknown message role"),
        ([{"role": "user", "content": 42}], None, "content"),
        (
            [_user("a"), {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}],
            None,
            "mapping",
        ),
        ([_user("a"), {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], None, "name"),
        ([{"role": "system", "content": [{"type": "image", "image": "a.png"}]}, _user("a")], None, "images"),
        ([_user("a")], ["not a dict"], "tool"),
        ([], None, "no messages"),
    ],
)
def test_rejected_conversations(messages: list, tools: list | None, fragment: str) -> None:
    with pytest.raises(ChatTemplateError, match=fragment):
        render_chat(default_template(), messages, tools)


def test_template_errors_are_chat_template_errors() -> None:
    msgs = [_user("a")]
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        render_chat("{% if %}", msgs)
    with pytest.raises(ChatTemplateError, match="^custom failure$"):
        render_chat("{{ raise_exception('custom failure') }}", msgs)
    # The immutable sandbox forbids mutating the caller's data.
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.append(1) }}", msgs)
    assert msgs == [_user("a")]
    assert issubclass(ChatTemplateError, ValueError)


def test_live_against_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel

    backend = tokenizers.Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = default_template()
    for golden in GOLDENS:
        kwargs = dict(golden["kwargs"])
        theirs = tokenizer.apply_chat_template(
            golden["messages"], tools=golden["tools"], tokenize=False, **kwargs
        )
        ours = render_chat(default_template(), golden["messages"], golden["tools"], **kwargs)
        assert ours == theirs, golden["name"]
    probe = (
        "{{ bos_token }}{{ eos_token }}{{ messages|tojson(indent=1) }}{{ tools|tojson }}"
        "{{ documents is none }}{% for m in messages %}{% if loop.last %}{% continue %}{% endif %}"
        "{{ m.role }}{% endfor %}{{ add_generation_prompt }}"
    )
    messages = [_user("ü"), {"role": "assistant", "content": "<b>"}]
    theirs = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], chat_template=probe, tokenize=False, add_generation_prompt=True
    )
    ours = render_chat(probe, messages, [WEATHER], bos_token="<s>", eos_token="<|im_end|>")
    assert ours == theirs
    layout = "{% for m in messages %}\n  {% if m.content %}\n<{{ m.content }}>\n  {% endif %}\n{% endfor %}\n"
    theirs = tokenizer.apply_chat_template(messages, chat_template=layout, tokenize=False)
    assert render_chat(layout, messages, add_generation_prompt=False) == theirs
