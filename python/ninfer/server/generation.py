"""Running one `GenerationRequest` on the engine, for either API.

`prepare` renders the chat template (or takes a raw prompt), tokenizes, checks the context limit
and settles the sampling parameters; `Generation` submits the prompt and turns the engine's
events into `Piece`s: reasoning, content and tool calls from `parsers.OutputParser` (or raw text
for completions), the logprobs of each step, and a final `Finished`. The API modules only
translate pieces into their wire formats.

Cancellation: `Generation.cancel()` is called from the handlers' `finally`, so a client that
disconnects (the handler is cancelled, or a write fails) frees its scheduler slot within one step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ninfer.chat import ChatTemplateError
from ninfer.engine import Engine, EngineError, SamplingParams
from ninfer.parsers import ContentDelta, OutputParser, ReasoningDelta, ToolCall
from ninfer.server.errors import ApiError, bad_request
from ninfer.server.metrics import Metrics
from ninfer.server.schemas import GenerationRequest, sampling_params

__all__ = ["Finished", "Generation", "Logprobs", "Piece", "Prepared", "Text", "prepare", "render_prompt", "token_text"]

THINK_OPEN = "<think>"

# A full queue is transient: the client may retry after about one scheduler round-trip.
RETRY_AFTER_SECONDS = "1"


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    thinking: bool  # the prompt ends inside an open think block, so output starts as reasoning


@dataclass(frozen=True)
class Text:
    """Raw generated text (completions: no template, no parsing)."""

    text: str


@dataclass(frozen=True)
class Logprobs:
    """Per generated token: (id, logprob, [(alternative id, logprob), ...])."""

    entries: list[tuple[int, float, list[tuple[int, float]]]]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"
    stop_sequence: str | None  # the client's stop string that ended the output, if one did
    prompt_tokens: int
    completion_tokens: int


Piece = ReasoningDelta | ContentDelta | ToolCall | Text | Logprobs | Finished


def context_error(prompt_tokens: int, max_context: int, param: str) -> ApiError:
    return bad_request(
        f"the prompt has {prompt_tokens} tokens but the context limit is {max_context}",
        param,
        "context_length_exceeded",
    )


def render_prompt(engine: Engine, req: GenerationRequest) -> tuple[list[int], bool]:
    """Token ids of the request's prompt and whether it ends inside a think block."""
    if req.messages is not None:
        try:
            text = engine.render_chat(req.messages, req.tools, **req.template_kwargs)
        except ChatTemplateError as e:
            raise bad_request(f"the conversation cannot be rendered: {e}", "messages") from None
        return _encode(engine, text, "messages"), text.rstrip().endswith(THINK_OPEN)
    if isinstance(req.prompt, str):
        return _encode(engine, req.prompt, "prompt"), False
    return list(req.prompt or []), False


def _encode(engine: Engine, text: str, param: str) -> list[int]:
    try:
        return engine.encode(text)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def prepare(engine: Engine, req: GenerationRequest) -> Prepared:
    """Everything before submission; runs in a worker thread (templates and tokenizing of long
    prompts take milliseconds the event loop should not spend)."""
    ids, thinking = render_prompt(engine, req)
    param = "messages" if req.messages is not None else "prompt"
    if not ids:
        raise bad_request("the prompt is empty", param)
    vocab = int(engine.config.get("vocab_size", 0))
    if vocab and any(t < 0 or t >= vocab for t in ids):
        raise bad_request(f"token ids must be in [0, {vocab})", param)
    if len(ids) >= engine.max_context:
        raise context_error(len(ids), engine.max_context, param)
    # Without max_tokens the output may run to the context limit, or to the whole KV pool when
    # that is smaller, so that a request without max_tokens is never refused for its KV.
    limit = min(engine.max_context, engine.kv_capacity)
    params = sampling_params(req, engine.generation_config, len(ids), limit)
    return Prepared(ids, params, thinking)


class Generation:
    """One submitted request: an async source of pieces, cancellable at any point."""

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        req: GenerationRequest,
        prepared: Prepared,
        arrival: float,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._req = req
        self._prepared = prepared
        self._arrival = arrival
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._rid: int | None = None
        self._done = False
        self._abort_message = "the request was cancelled by the engine"
        self._eos = set(engine.eos_token_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self._prepared.prompt_ids)

    def start(self) -> None:
        """Submits the request; raises ApiError for a full queue or a rejected request."""
        loop = asyncio.get_running_loop()
        queue = self._queue

        def deliver(event: dict[str, Any]) -> None:
            # Runs on the engine's event thread; a loop that already shut down drops the event.
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:
                pass

        try:
            self._rid = self._engine.submit(self._prepared.prompt_ids, self._prepared.params, deliver)
        except EngineError as e:
            if "queue full" in str(e):
                raise ApiError(
                    429,
                    "too many requests are waiting for the model; retry later",
                    code="queue_full",
                    headers={"Retry-After": RETRY_AFTER_SECONDS},
                ) from None
            raise ApiError(503, f"the engine cannot take the request: {e}") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    def cancel(self) -> None:
        if self._rid is not None and not self._done:
            self._done = True
            self._engine.cancel(self._rid)

    def abort(self, message: str) -> None:
        """Ends the request early; its reader gets a 503 ApiError carrying `message`."""
        self._abort_message = message
        if self._rid is not None and not self._done:
            self._engine.cancel(self._rid)

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        first: float | None = None
        last = 0.0
        while True:
            event = await self._queue.get()
            kind = event["type"]
            if kind == "delta":
                n = len(event["token_ids"])
                if n:
                    now = time.monotonic()
                    if first is None:
                        first = now
                        self._metrics.observe(self._metrics.ttft, now - self._arrival)
                    else:
                        self._metrics.observe(self._metrics.tpot, (now - last) / n)
                    last = now
                yield event
            elif kind == "done":
                self._done = True
                if event["finish_reason"] != "abort":
                    self._metrics.observe(self._metrics.e2e, time.monotonic() - self._arrival)
                yield event
                return
            else:
                self._done = True
                raise ApiError(500, f"the engine failed: {event['message']}")

    def _logprobs(self, event: dict[str, Any]) -> list[tuple[int, float, list[tuple[int, float]]]]:
        if self._req.logprobs is None:
            return []
        entries = [tuple(x) for x in event["logprobs"]]
        if not event["text"] and entries and all(e[0] in self._eos for e in entries):
            return []  # the end-of-sequence token that stopped the output: not part of it
        return entries  # type: ignore[return-value]

    async def pieces(self, parse: bool) -> AsyncIterator[Piece]:
        """The output as pieces; `parse` splits reasoning and tool calls (chat), else raw text."""
        parser = OutputParser(self._req.tools, self._prepared.thinking) if parse else None
        async for event in self._events():
            if event["type"] == "delta":
                if event["text"]:
                    if parser is None:
                        yield Text(event["text"])
                    else:
                        for p in parser.feed(event["text"]):
                            yield p
                entries = self._logprobs(event)
                if entries:
                    yield Logprobs(entries)
                continue
            if event["finish_reason"] == "abort":
                raise ApiError(503, self._abort_message)
            if parser is not None:
                for p in parser.finish():
                    yield p
            stop = event.get("stop")
            yield Finished(
                reason=event["finish_reason"],
                stop_sequence=stop if stop in self._req.stop else None,
                prompt_tokens=event["prompt_tokens"],
                completion_tokens=event["completion_tokens"],
            )


def token_text(engine: Engine, token: int) -> str:
    return engine.decode([token])
