"""The Python Engine over the bundled demo model: generate, stream, chat, asyncio, determinism,
argument errors, cancellation, a bounded KV pool."""

from __future__ import annotations

import asyncio
import threading

import pytest

import ninfer
from ninfer import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine():
    e = Engine(device="cpu", max_concurrency=4)
    yield e
    e.close()


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_generate_returns_text_ids_reason_usage(engine):
    c = engine.generate("def fibonacci(n):", greedy(10))
    assert len(c.token_ids) == 10 and c.finish_reason == "length"
    assert c.usage == {"prompt_tokens": len(engine.encode("def fibonacci(n):")), "completion_tokens": 10, "total_tokens": c.prompt_tokens + 10}
    assert c.text == engine.decode(c.token_ids)


def test_stream_concatenates_to_generate(engine):
    deltas = list(engine.stream("import os", greedy(15)))
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == engine.generate("import os", greedy(15)).text
    assert [t for d in deltas for t in d.token_ids] == engine.generate("import os", greedy(15)).token_ids


def test_token_ids_prompt_equals_text_prompt(engine):
    ids = engine.encode("class A:")
    assert engine.generate(ids, greedy(6)).token_ids == engine.generate("class A:", greedy(6)).token_ids


def test_same_seed_same_output_different_seed_differs(engine):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234)
    a = engine.generate("x = ", p).token_ids
    assert engine.generate("x = ", p).token_ids == a
    p.seed = 4321
    assert engine.generate("x = ", p).token_ids != a


def test_concurrent_threads_match_sequential(engine):
    prompts = [f"value_{i} = " for i in range(6)]
    alone = [engine.generate(p, greedy(8)).token_ids for p in prompts]
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(prompts[i], greedy(8)).token_ids)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(6)] == alone


def test_async_variants_run_together_without_blocking(engine):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        comps = await asyncio.gather(*[engine.agenerate("for i in", greedy(20)) for _ in range(4)])
        streamed = [d async for d in engine.astream("for i in", greedy(20))]
        t.cancel()
        return comps, streamed, ticks

    comps, streamed, ticks = asyncio.run(main())
    want = engine.generate("for i in", greedy(20))
    assert all(c.token_ids == want.token_ids for c in comps)
    assert "".join(d.text for d in streamed) == want.text
    assert ticks > 5, "the event loop was blocked while the engine worked"


def test_chat_renders_the_template_and_stops_on_limits(engine):
    c = engine.chat([{"role": "user", "content": "Hi"}], params=greedy(5))
    assert c.prompt_tokens == len(engine.encode(engine.render_chat([{"role": "user", "content": "Hi"}])))
    assert engine.render_chat([{"role": "user", "content": "Hi"}], enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_stop_strings_and_ids(engine):
    free = engine.generate("def f(x):", greedy(20))
    stop_id = free.token_ids[3]
    c = engine.generate("def f(x):", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop_id and len(c.token_ids) == free.token_ids.index(stop_id) + 1
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    if stop.strip():
        c = engine.generate("def f(x):", SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
        assert c.finish_reason == "stop" and stop not in c.text and free.text.startswith(c.text)


def test_logprobs(engine):
    c = engine.generate("a", SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    assert len(c.logprobs) == 3
    for tok, lp, top in c.logprobs:
        assert lp <= 0 and len(top) == 2 and top[0][0] == tok and top[0][1] >= top[1][1]


@pytest.mark.parametrize(
    "params, word",
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=2.5), "max_tokens"),
        (SamplingParams(logprobs=100), "logprobs"),
        (SamplingParams(min_p=3), "min_p"),
    ],
)
def test_bad_arguments_raise_value_error(engine, params, word):
    with pytest.raises(ValueError, match=word):
        engine.generate("x", params)


def test_bad_prompts_and_options(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], greedy())
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([10**7], greedy())
    with pytest.raises(ValueError, match="context limit"):
        engine.generate([1] * (engine.max_context + 5), greedy())
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(device="cpu", max_conccurency=2)
    with pytest.raises(ValueError, match="unknown device"):
        Engine(device="tpu")
    with pytest.raises(FileNotFoundError):
        Engine("/nonexistent/model.ninfer")


def test_closing_a_stream_cancels_and_frees_the_slot(engine):
    it = engine.stream("while True:", SamplingParams(temperature=0, max_tokens=100000))
    next(it)
    it.close()
    for _ in range(200):
        if engine.stats()["running"] == 0:
            break
        threading.Event().wait(0.01)
    st = engine.stats()
    assert st["running"] == 0
    # Its KV reservation and pages went back with the slot (published together).
    assert (st["kv_pages_reserved"], st["kv_pages_used"]) == (0, 0) and st["kv_pages_total"] > 0
    assert ninfer.__version__


def test_kv_capacity_queues_requests_and_refuses_one_larger_than_the_pool():
    # 96 positions = 6 pages of 16; a prompt of 8 ids plus 40 tokens reserves 3 pages, so two
    # requests run at once although four slots are free; the others wait their turn.
    e = Engine(device="cpu", max_concurrency=4, kv_capacity=96)
    try:
        assert e.kv_capacity == 96
        st = e.stats()
        assert (st["kv_pages_total"], st["kv_page_size"], st["kv_pages_reserved"]) == (6, 16, 0)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        prompts = [[10 + i] * 8 for i in range(4)]
        streams = [e.stream(p, params) for p in prompts]
        heads = [next(streams[0]), next(streams[1])]
        st = e.stats()
        assert (st["running"], st["waiting"], st["kv_pages_reserved"]) == (2, 2, 6)
        together = [heads[i].token_ids if i < 2 else [] for i in range(4)]
        for i, s in enumerate(streams):
            together[i] += [t for d in s for t in d.token_ids]
        assert together == [e.generate(p, params).token_ids for p in prompts]
        with pytest.raises(ValueError, match="KV capacity is 96 tokens"):
            e.generate([5] * 8, SamplingParams(max_tokens=100))
        st = e.stats()
        assert (st["running"], st["waiting"], st["kv_pages_reserved"], st["kv_pages_used"]) == (0, 0, 0, 0)
    finally:
        e.close()
    with pytest.raises(ValueError, match="kv_capacity"):
        Engine(device="cpu", kv_capacity=0)
