"""Errors of `ninfer serve`: each bad request gets its status and a message that names the
problem, in the error shape of the API it was sent to, and never a 500 or a hang."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from test_server_harness import TIMEOUT, LiveServer, demo_model, live_server  # noqa: F401  (fixture)

MAX_CONTEXT = 256
MAX_BODY = 64 * 1024
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    yield from live_server(demo_model, max_context=MAX_CONTEXT, max_body_bytes=MAX_BODY)


@pytest.fixture(scope="module")
def keyed(demo_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    yield from live_server(demo_model, api_key="k3y")


def openai_error(
    server: LiveServer, path: str, body: object = None, raw: bytes | None = None, method: str = "POST"
) -> tuple[int, dict]:
    status, headers, data = server.request(method, path, body, raw=raw)
    assert headers["content-type"].startswith("application/json")
    err = json.loads(data)
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    return status, err["error"]


def anthropic_error(server: LiveServer, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, dict]:
    status, _, data = server.request("POST", path, body, raw=raw)
    err = json.loads(data)
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    return status, err["error"]


def chat(**fields: object) -> dict:
    return {"model": "demo", "messages": HI, "max_tokens": 4, **fields}


def message(**fields: object) -> dict:
    return {"model": "demo", "messages": HI, "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    ("body", "status", "param", "needle"),
    [
        (chat(temperature="hot"), 400, "temperature", "`temperature` must be a number, got str"),
        (chat(temperature=-1), 400, "temperature", "`temperature` must be >= 0"),
        (chat(max_tokens=0), 400, "max_tokens", "`max_tokens` must be >= 1"),
        (chat(top_p=0), 400, "top_p", "`top_p` must be > 0"),
        (chat(seed=-3), 400, "seed", "`seed` must be >= 0"),
        (chat(stream="yes"), 400, "stream", "`stream` must be a boolean"),
        (chat(stop=["", "x"]), 400, "stop", "must not contain empty strings"),
        (chat(top_logprobs=3), 400, "top_logprobs", "needs `logprobs: true`"),
        (chat(messages="hi"), 400, "messages", "`messages` must be an array"),
        (chat(messages=[]), 400, "messages", "must not be empty"),
        (chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", "must be one of"),
        (chat(messages=[{"role": "user"}]), 400, "messages[0].content", "is required"),
        (
            chat(messages=HI + [{"role": "system", "content": "late"}]),
            400,
            "messages",
            "only allowed as the first message",
        ),
        (chat(messages=[{"role": "assistant", "content": "x"}]), 400, "messages", "no user query"),
        (
            chat(
                messages=HI
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                    }
                ]
            ),
            400,
            "messages[1].tool_calls[0].function.arguments",
            "is not valid JSON",
        ),
        (chat(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage", "must be a boolean"),
        (chat(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs.messages", "unknown field"),
        (chat(model="gpt-4o"), 404, "model", "the model `gpt-4o` does not exist; this server serves `demo`"),
        (
            chat(messages=[{"role": "user", "content": "word " * 400}]),
            400,
            "messages",
            f"tokens but the context limit is {MAX_CONTEXT}",
        ),
        ({"model": "demo", "prompt": [1, 2, 10**9], "max_tokens": 2}, 400, "prompt", "token ids must be in [0, 4096)"),
    ],
)
def test_openai_bad_requests(server: LiveServer, body: dict, status: int, param: str, needle: str) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    got, err = openai_error(server, path, body)
    assert (got, err["param"]) == (status, param)
    assert needle in err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_too_long_prompt_is_named_in_both_apis(server: LiveServer) -> None:
    long = [{"role": "user", "content": "word " * 400}]
    status, err = openai_error(server, "/v1/chat/completions", chat(messages=long))
    assert err["code"] == "context_length_exceeded"
    status, err = anthropic_error(server, "/v1/messages", message(messages=long))
    assert status == 400 and f"the context limit is {MAX_CONTEXT}" in err["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "demo", "messages": HI}, "`max_tokens` is required"),
        (message(max_tokens="4"), "`max_tokens` must be an integer"),
        (message(system=[{"type": "image"}]), "'image' blocks are not supported here"),
        (message(thinking={"type": "between_tools"}), "`thinking.type` must be one of"),
        (message(stop_sequences="END"), "`stop_sequences` must be an array"),
        (
            message(messages=[{"role": "system", "content": "x"}]),
            "`messages[0].role` must be one of 'user', 'assistant'",
        ),
        (
            message(tool_choice={"type": "auto", "disable_parallel_tool_use": True}),
            "disable_parallel_tool_use is not supported",
        ),
    ],
)
def test_anthropic_bad_requests(server: LiveServer, body: dict, needle: str) -> None:
    status, err = anthropic_error(server, "/v1/messages", body)
    assert (status, err["type"]) == (400, "invalid_request_error")
    assert needle in err["message"]


def test_malformed_json(server: LiveServer) -> None:
    for raw, needle in (
        (b"{not json", "not valid JSON"),
        (b"", "body is empty"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"temperature": NaN}', "NaN is not valid JSON"),
    ):
        status, err = openai_error(server, "/v1/chat/completions", raw=raw)
        assert status == 400 and needle in err["message"], raw
        status, err = anthropic_error(server, "/v1/messages", raw=raw)
        assert status == 400 and needle in err["message"], raw


def test_payload_too_large(server: LiveServer) -> None:
    huge = chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}])
    status, err = openai_error(server, "/v1/chat/completions", huge)
    assert status == 413 and f"limit of {MAX_BODY} bytes" in err["message"]
    status, err = anthropic_error(server, "/v1/messages", message(messages=huge["messages"]))
    assert (status, err["type"]) == (413, "request_too_large")


def test_unknown_endpoint_and_method(server: LiveServer) -> None:
    status, err = openai_error(server, "/v1/embeddings", {"model": "demo", "input": "x"})
    assert status == 404 and "no such endpoint: POST /v1/embeddings" in err["message"]
    status, err = openai_error(server, "/v1/chat/completions", method="GET")
    assert status == 405


def test_tokenize_and_detokenize_errors(server: LiveServer) -> None:
    status, err = openai_error(server, "/tokenize", {"prompt": "x", "messages": HI})
    assert status == 400 and "exactly one of `prompt` and `messages`" in err["message"]
    status, err = openai_error(server, "/tokenize", {"prompt": "x", "tools": []})
    assert status == 400 and "goes with `messages`" in err["message"]
    status, err = openai_error(server, "/detokenize", {"tokens": [1, -2]})
    assert status == 400 and err["param"] == "tokens"
    status, out = server.post("/tokenize", {"prompt": "hello world"})
    assert status == 200 and out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_CONTEXT
    assert server.post("/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": "hello world"})


def test_no_bad_input_ever_gave_a_500(server: LiveServer) -> None:
    status, _, data = server.request("GET", "/metrics")
    text = data.decode()
    assert 'status="400"' in text and 'status="413"' in text
    assert 'status="500"' not in text


def test_api_key_is_enforced(keyed: LiveServer) -> None:
    body = chat()
    assert keyed.request("POST", "/v1/chat/completions", body)[0] == 401
    status, _, data = keyed.request("POST", "/v1/chat/completions", body, {"Authorization": "Bearer nope"})
    assert status == 401 and json.loads(data)["error"]["message"] == "invalid API key"
    status, _, data = keyed.request("POST", "/v1/messages", message(), {"x-api-key": "nope"})
    assert status == 401 and json.loads(data) == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    assert keyed.request("POST", "/v1/chat/completions", body, {"Authorization": "Bearer k3y"})[0] == 200
    assert keyed.request("POST", "/tokenize", {"prompt": "x"})[0] == 401
    assert keyed.request("GET", "/health")[0] == 200 and keyed.request("GET", "/metrics")[0] == 200
    good = anthropic.Anthropic(base_url=keyed.url, api_key="k3y", max_retries=0, timeout=TIMEOUT)
    assert good.messages.create(model="demo", max_tokens=2, messages=HI).usage.output_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="bad", max_retries=0, timeout=TIMEOUT).models.list()
