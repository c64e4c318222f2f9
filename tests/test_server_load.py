"""`ninfer serve` under load: 32 concurrent streams against the same requests run one at a time,
a client that disconnects mid-stream (its slot and KV pages must be freed), a full queue (429),
and a small KV pool (requests wait for pages; one larger than the pool is refused with 400)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ninfer.server import ServerConfig
from test_server_harness import TIMEOUT, LiveServer, demo_model, live_server  # noqa: F401  (fixture)

STREAMS = 32
LONG = {"ignore_eos": True}  # keeps a generation going for as long as a test needs it


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    yield from live_server(demo_model, max_concurrency=8)


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request number {i}: tell me about item {i * 7 % 13}."}]


async def _stream_one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        model="demo",
        messages=_messages(i),
        max_tokens=24 + i % 5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, tokens = [], None, 0
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            text.append((delta.model_extra or {}).get("reasoning_content") or "")
            text.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), finish, tokens


def test_concurrent_streams_equal_sequential_greedy_outputs(server: LiveServer) -> None:
    async def run(concurrent: bool) -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        try:
            if concurrent:
                return await asyncio.wait_for(
                    asyncio.gather(*(_stream_one(client, i) for i in range(STREAMS))), TIMEOUT
                )
            return [await _stream_one(client, i) for i in range(STREAMS)]
        finally:
            await client.close()

    start = server.metrics()
    before = start["ninfer_engine_steps_total"]
    sequential = asyncio.run(run(False))
    steps_sequential = server.metrics()["ninfer_engine_steps_total"] - before
    concurrent = asyncio.run(run(True))
    end = server.metrics()
    steps_concurrent = end["ninfer_engine_steps_total"] - before - steps_sequential
    delta = {k: end[k] - start[k] for k in end}
    assert delta["ninfer_time_to_first_token_seconds_count"] == 2 * STREAMS
    assert delta["ninfer_e2e_request_latency_seconds_count"] == 2 * STREAMS
    assert delta["ninfer_generation_tokens_total"] == 2 * sum(tokens for _, _, tokens in concurrent)
    assert all(finish in ("stop", "length") and tokens > 0 for _, finish, tokens in concurrent)
    assert concurrent == sequential
    assert len({text for text, _, _ in sequential}) > 1  # not one text for every prompt (the bundled code model answers chats tersely)
    assert steps_concurrent < steps_sequential / 3  # the requests were batched, not serialised
    server.wait_idle()


def test_disconnect_mid_stream_frees_the_slot(server: LiveServer) -> None:
    server.wait_idle()
    generated_before = server.metrics()["ninfer_generation_tokens_total"]
    max_tokens = 7000
    body = {"model": "demo", "messages": _messages(1), "max_tokens": max_tokens, "stream": True, **LONG}
    conn = server.connection()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(5):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    m = server.metrics()
    assert (m["ninfer_requests_running"], m["ninfer_slots_used"]) == (1, 1)
    assert m["ninfer_kv_pages_reserved"] > 0 and 0 < m["ninfer_kv_pages_used"] <= m["ninfer_kv_pages_reserved"]
    conn.sock.close()  # the client goes away without reading the rest
    conn.close()
    start = time.monotonic()
    m = server.wait_idle()
    assert time.monotonic() - start < 5
    assert m["ninfer_slots_used"] == 0 and m["ninfer_slots_total"] == 8
    # The pool is whole again: the request's reservation and pages went back with its slot.
    assert (m["ninfer_kv_pages_reserved"], m["ninfer_kv_pages_used"], m["ninfer_kv_usage_ratio"]) == (0, 0, 0)
    assert m["ninfer_kv_pages_total"] * m["ninfer_kv_page_size"] == server.engine.kv_capacity
    generated = m["ninfer_generation_tokens_total"] - generated_before
    # Cancelled, not run to the end. (The five lines read were the role chunk and at least one
    # token's text: how many tokens ran before the cancel was seen depends on timing.)
    assert 0 < generated < max_tokens
    status, _, data = server.request("GET", "/metrics")
    assert 'endpoint="/v1/chat/completions",status="499"' in data.decode()


def test_disconnect_of_a_non_streaming_request_frees_the_slot(server: LiveServer) -> None:
    server.wait_idle()
    body = {"model": "demo", "messages": _messages(2), "max_tokens": 7000, **LONG}
    conn = server.connection()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + TIMEOUT
    while server.metrics()["ninfer_requests_running"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    conn.sock.close()
    conn.close()
    m = server.wait_idle()
    assert (m["ninfer_slots_used"], m["ninfer_kv_pages_reserved"], m["ninfer_kv_pages_used"]) == (0, 0, 0)


@pytest.fixture(scope="module")
def narrow(demo_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    yield from live_server(demo_model, max_concurrency=1, max_pending=1)


def test_full_queue_answers_429_with_retry_after(narrow: LiveServer) -> None:
    long = {"model": "demo", "messages": _messages(3), "max_tokens": 7000, "stream": True, **LONG}
    running = narrow.connection()
    running.request("POST", "/v1/chat/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
    first = running.getresponse()
    assert first.readline().startswith(b"data: ")
    waiting = narrow.connection()
    waiting.request("POST", "/v1/chat/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + TIMEOUT
    while narrow.metrics()["ninfer_requests_waiting"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        status, headers, data = narrow.request(
            "POST", "/v1/chat/completions", {"model": "demo", "messages": _messages(4), "max_tokens": 2}
        )
        assert status == 429 and headers["retry-after"] == "1"
        assert "too many requests are waiting" in json.loads(data)["error"]["message"]
        status, headers, data = narrow.request(
            "POST", "/v1/messages", {"model": "demo", "messages": _messages(4), "max_tokens": 2}
        )
        assert status == 429 and json.loads(data)["error"]["type"] == "rate_limit_error"
    finally:
        for conn in (running, waiting):
            conn.sock.close()
            conn.close()
    narrow.wait_idle()
    ok = openai.OpenAI(base_url=narrow.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    assert ok.chat.completions.create(model="demo", messages=_messages(5), max_tokens=3).usage.completion_tokens >= 1


def test_shutdown_ends_running_streams_with_an_error(demo_model: Path) -> None:  # noqa: F811
    server = LiveServer(ServerConfig(model=str(demo_model), model_id="demo", device="cpu"))
    server.wait_ready()
    conn = server.connection()
    body = {"model": "demo", "messages": _messages(6), "max_tokens": 7000, "stream": True, **LONG}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 2  # not the 7000 tokens, not the grace period
    frames = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2].removeprefix("data: "))["error"]["message"] == "the server is shutting down"


# 1024 positions = 64 pages of 16, shared by 4 slots. A request reserves its prompt plus
# max_tokens, so the pool, not the slots, bounds how many run at once.
KV_TOKENS = 1024


@pytest.fixture(scope="module")
def small_kv(demo_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    yield from live_server(demo_model, max_concurrency=4, kv_capacity=KV_TOKENS)


def _ids(i: int, n: int) -> list[int]:
    return [20 + (i * 7 + j) % 60 for j in range(n)]


def test_a_small_kv_pool_still_completes_concurrent_requests(small_kv: LiveServer) -> None:
    # 330 + 24 positions = 23 pages each: two fit in 64 pages, a third does not.
    m = small_kv.wait_idle()
    assert (m["ninfer_kv_pages_total"], m["ninfer_kv_page_size"], m["ninfer_slots_total"]) == (64, 16, 4)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        out = await client.completions.create(model="demo", prompt=_ids(i, 330), max_tokens=24, temperature=0, extra_body=LONG)
        assert out.usage is not None
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

    async def run(concurrent: bool) -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(base_url=small_kv.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        try:
            if concurrent:
                return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(6))), TIMEOUT)
            return [await one(client, i) for i in range(6)]
        finally:
            await client.close()

    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(small_kv.metrics())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        concurrent = asyncio.run(run(True))
    finally:
        done.set()
        sampler.join(TIMEOUT)
    assert all(finish == "length" and tokens == 24 for _, finish, tokens in concurrent)
    assert concurrent == asyncio.run(run(False))
    assert max(m["ninfer_requests_running"] for m in samples) <= 2  # the pool's bound, not the slots'
    assert max(m["ninfer_requests_waiting"] for m in samples) >= 1  # the others queued meanwhile
    assert all(m["ninfer_kv_pages_used"] <= m["ninfer_kv_pages_reserved"] <= 64 for m in samples)
    m = small_kv.wait_idle()
    assert (m["ninfer_kv_pages_reserved"], m["ninfer_kv_pages_used"]) == (0, 0)


def test_the_head_of_the_queue_waits_for_kv_pages_with_slots_free(small_kv: LiveServer) -> None:
    small_kv.wait_idle()
    # 16 + 1008 positions: the whole pool.
    whole = {"model": "demo", "prompt": _ids(1, 16), "max_tokens": 1008, "stream": True, **LONG}
    conn = small_kv.connection()
    conn.request("POST", "/v1/completions", body=json.dumps(whole), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    result: list[openai.types.Completion] = []
    client = openai.OpenAI(base_url=small_kv.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    small = threading.Thread(
        target=lambda: result.append(client.completions.create(model="demo", prompt=_ids(2, 16), max_tokens=16, extra_body=LONG))
    )
    small.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while (m := small_kv.metrics())["ninfer_requests_waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert (m["ninfer_requests_running"], m["ninfer_slots_used"], m["ninfer_kv_pages_reserved"]) == (1, 1, 64)
    finally:
        conn.sock.close()  # frees the pool, so the waiting request runs
        conn.close()
    small.join(TIMEOUT)
    assert result and result[0].usage is not None and result[0].usage.completion_tokens == 16
    m = small_kv.wait_idle()
    assert (m["ninfer_kv_pages_reserved"], m["ninfer_kv_pages_used"]) == (0, 0)


def test_a_request_larger_than_the_kv_pool_is_refused_with_400(small_kv: LiveServer) -> None:
    status, body = small_kv.post("/v1/completions", {"model": "demo", "prompt": _ids(3, 16), "max_tokens": 2000})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert f"KV capacity is {KV_TOKENS} tokens" in message and "2016" in message, message
    status, body = small_kv.post(
        "/v1/messages", {"model": "demo", "messages": _messages(3), "max_tokens": 2000}
    )
    assert status == 400 and f"KV capacity is {KV_TOKENS} tokens" in body["error"]["message"]
    # Without max_tokens a chat may run to the pool's size (not the larger context limit), so
    # it is served.
    status, body = small_kv.post("/v1/chat/completions", {"model": "demo", "messages": _messages(4)})
    assert status == 200, body
    assert body["usage"]["total_tokens"] <= KV_TOKENS
    m = small_kv.wait_idle()
    assert (m["ninfer_kv_pages_reserved"], m["ninfer_kv_pages_used"]) == (0, 0)
