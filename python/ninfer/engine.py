"""The Python `Engine`: a thin layer over `ninfer._core.Engine` (the Rust scheduler and sampler).

One pump thread per engine drains the core's event channel (`poll` releases the GIL while it
waits) and hands each request's events to its consumer: a `queue.Queue` for the blocking API, an
`asyncio.Queue` (through `call_soon_threadsafe`) for the async API. So any number of streams cost
one thread, and the event loop is never blocked.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ninfer import _core

__all__ = ["Completion", "Delta", "Engine", "SamplingParams", "default_model_path"]


@dataclass
class SamplingParams:
    """How to pick tokens. Validated in Rust when a request is submitted (ValueError)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if isinstance(self.stop, str):
            d["stop"] = [self.stop]
        for key in ("max_tokens", "top_k", "seed", "logprobs"):
            v = d[key]
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{key} must be an integer, got {v!r}")
            if v is not None and v < 0:
                raise ValueError(f"{key} must be >= 0, got {v}")
        return d


@dataclass
class Delta:
    """A piece of a streamed completion."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    stop: str | None = None

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class EngineError(RuntimeError):
    """The engine failed while running a request (not a bad argument: that is ValueError)."""


def default_model_path() -> Path:
    """The small model bundled in the wheel, used when no model is given."""
    return Path(__file__).parent / "models" / "demo.ninfer"


class _Pump:
    """Routes events from the core to per-request consumers."""

    def __init__(self, core: Any):
        self._core = core
        self._consumers: dict[int, Callable[[dict], None]] = {}
        self._early: dict[int, list[dict]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ninfer-events", daemon=True)
        self._thread.start()

    def register(self, rid: int, consumer: Callable[[dict], None]) -> None:
        with self._lock:
            self._consumers[rid] = consumer
            early = self._early.pop(rid, [])
        for ev in early:
            consumer(ev)

    def _run(self) -> None:
        while not self._stop.is_set():
            for rid, ev in self._core.poll(0.05):
                with self._lock:
                    consumer = self._consumers.get(rid)
                    if consumer is None:
                        # Submitted but not registered yet: keep until it is.
                        self._early.setdefault(rid, []).append(ev)
                        continue
                    if ev["type"] != "delta":
                        del self._consumers[rid]
                consumer(ev)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def _delta(ev: dict) -> Delta:
    return Delta(ev["text"], list(ev["token_ids"]), [tuple(x) for x in ev["logprobs"]])


class Engine:
    """A loaded model. `Engine(path=None)` loads the bundled demo model.

    Options: `max_concurrency`, `max_context`, `max_pending`, `prefill_chunk`, and `kv_capacity`:
    positions of KV cache all sequences share, rounded up to whole pages (None, the default: every
    sequence can reach `max_context`). A request reserves KV for its prompt plus `max_tokens` (at
    most `max_context`) when it starts; requests wait in FIFO order until their reservation fits,
    and one that needs more than the whole pool is refused with ValueError.
    """

    def __init__(self, path: str | Path | None = None, device: str = "auto", **options: Any):
        known = {"max_concurrency", "max_context", "max_pending", "prefill_chunk", "kv_capacity"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
        path = Path(path) if path is not None else default_model_path()
        if not path.exists():
            raise FileNotFoundError(f"no such artifact: {path}")
        self.path = path
        self._core = _core.Engine(str(path), device, **options)
        self.config: dict[str, Any] = json.loads(self._core.config_json)
        gen = self._core.generation_config_json
        self.generation_config: dict[str, Any] = json.loads(gen) if gen else {}
        self._pump = _Pump(self._core)

    # -- model facts ---------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self._core.backend_name

    @property
    def max_context(self) -> int:
        return self._core.max_context

    @property
    def kv_capacity(self) -> int:
        """Positions of KV cache all sequences share (whole pages, at least what was asked)."""
        return self._core.kv_capacity

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._core.eos_token_ids)

    @property
    def chat_template(self) -> str:
        from ninfer.chat import default_template

        return self._core.chat_template or default_template()

    def encode(self, text: str) -> list[int]:
        return list(self._core.encode(text))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._core.decode(list(ids), skip_special)

    def stats(self) -> dict[str, int]:
        """Scheduler counters: running, waiting, slots_total, slots_used, prompt_tokens,
        generated_tokens, steps, and the KV pool in pages: kv_pages_total, kv_pages_reserved (by
        running requests), kv_pages_used (held now), kv_page_size (positions per page)."""
        return dict(self._core.stats())

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        from ninfer.chat import render_chat

        return render_chat(self.chat_template, messages, tools=tools, add_generation_prompt=True, **template_kwargs)

    # -- requests ------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a prompt is a string or a list of token ids")
        return ids

    def _params(self, params: SamplingParams | None) -> dict[str, Any]:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a ninfer.SamplingParams")
        return params.to_dict()

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None, consumer: Callable[[dict], None]) -> int:
        """Low level: queue a request; `consumer` gets its raw events on the pump thread."""
        ids = self._prompt_ids(prompt)
        try:
            rid = self._core.submit(ids, self._params(params))
        except RuntimeError as e:
            raise EngineError(str(e)) from None
        self._pump.register(rid, consumer)
        return rid

    def cancel(self, request_id: int) -> None:
        self._core.cancel(request_id)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        """Yields deltas; the last one carries `finish_reason`. Closing the iterator cancels."""
        q: queue.Queue[dict] = queue.Queue()
        rid = self.submit(prompt, params, q.put)
        return self._iterate(rid, q)

    def _iterate(self, rid: int, q: queue.Queue[dict]) -> Iterator[Delta]:
        done = False
        try:
            while True:
                ev = q.get()
                if ev["type"] == "delta":
                    yield _delta(ev)
                elif ev["type"] == "done":
                    done = True
                    yield Delta("", [], [], ev["finish_reason"])
                    return
                else:
                    done = True
                    raise EngineError(ev["message"])
        finally:
            if not done:
                self.cancel(rid)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Completion:
        q: queue.Queue[dict] = queue.Queue()
        self.submit(prompt, params, q.put)
        return _collect(iter(q.get, None))

    def chat(self, messages: list[dict], tools: list[dict] | None = None, params: SamplingParams | None = None, **template_kwargs: Any) -> Completion:
        return self.generate(self.render_chat(messages, tools, **template_kwargs), params)

    async def agenerate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Completion:
        events = []
        async for ev in self._aevents(prompt, params):
            events.append(ev)
        return _collect(iter(events))

    async def astream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        async for ev in self._aevents(prompt, params):
            if ev["type"] == "delta":
                yield _delta(ev)
            elif ev["type"] == "done":
                yield Delta("", [], [], ev["finish_reason"])
            else:
                raise EngineError(ev["message"])

    async def achat(self, messages: list[dict], tools: list[dict] | None = None, params: SamplingParams | None = None, **template_kwargs: Any) -> Completion:
        return await self.agenerate(self.render_chat(messages, tools, **template_kwargs), params)

    async def _aevents(self, prompt: str | Sequence[int], params: SamplingParams | None) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[dict] = asyncio.Queue()
        rid = self.submit(prompt, params, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        done = False
        try:
            while True:
                ev = await q.get()
                done = ev["type"] != "delta"
                yield ev
                if done:
                    return
        finally:
            if not done:
                self.cancel(rid)

    def close(self) -> None:
        self._core.close()
        self._pump.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collect(events: Iterator[dict]) -> Completion:
    text, ids, lps = [], [], []
    for ev in events:
        if ev["type"] == "delta":
            text.append(ev["text"])
            ids.extend(ev["token_ids"])
            lps.extend(tuple(x) for x in ev["logprobs"])
        elif ev["type"] == "done":
            return Completion("".join(text), ids, ev["finish_reason"], ev["prompt_tokens"], ev["completion_tokens"], lps, ev["stop"])
        else:
            raise EngineError(ev["message"])
    raise EngineError("the engine stopped before the request finished")
