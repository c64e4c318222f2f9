"""Server-sent events: the streaming transport of both APIs.

OpenAI streams bare `data:` lines ending with `data: [DONE]`; Anthropic names every event
(`event: message_start` ...). Both are written through `EventStream`. A write to a client that
went away raises `ConnectionError`; the handlers let that end the request, which cancels the
generation (DESIGN.md section 3: a client that disconnects cancels its request).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

__all__ = ["EventStream"]


class EventStream:
    """A `text/event-stream` response, started lazily by the first event."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                # Reverse proxies must pass events on as they come, not buffer them.
                "X-Accel-Buffering": "no",
            },
        )
        self._started = False

    async def send(self, data: dict[str, Any] | str, event: str | None = None) -> None:
        if not self._started:
            await self.response.prepare(self._request)
            self._started = True
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        frame = (f"event: {event}\n" if event else "") + f"data: {text}\n\n"
        await self.response.write(frame.encode("utf-8"))

    async def finish(self) -> web.StreamResponse:
        if not self._started:
            await self.response.prepare(self._request)
            self._started = True
        await self.response.write_eof()
        return self.response
