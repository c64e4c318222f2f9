"""What every handler shares: the server's configuration, the engine once it has loaded, the
metrics, and the steps each generation endpoint takes (read the body, check the model id,
prepare and start a `Generation`)."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ninfer.engine import Engine
from ninfer.server.errors import ApiError, bad_request
from ninfer.server.generation import Generation, prepare
from ninfer.server.metrics import Metrics
from ninfer.server.schemas import GenerationRequest

__all__ = ["STATE", "ServerConfig", "ServerState", "read_json", "start_generation"]

# Request bodies above this size are answered 413 (aiohttp's client_max_size).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerConfig:
    """Options of `ninfer serve` (docs/cli.md, docs/api.md)."""

    model: str | None = None  # artifact path; None serves the bundled demo model
    model_id: str | None = None  # the name clients use; default: the artifact's file name
    api_key: str | None = None
    device: str = "auto"
    max_concurrency: int | None = None
    max_context: int | None = None
    max_pending: int | None = None
    prefill_chunk: int | None = None
    kv_capacity: int | None = None  # positions of KV all sequences share; None: auto
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def model_path(self) -> Path:
        from ninfer.engine import default_model_path

        return Path(self.model) if self.model is not None else default_model_path()

    def served_id(self) -> str:
        if self.model_id:
            return self.model_id
        name = self.model_path().name
        return name[: -len(".ninfer")] if name.endswith(".ninfer") else name

    def engine_options(self) -> dict[str, int]:
        options = {
            "max_concurrency": self.max_concurrency,
            "max_context": self.max_context,
            "max_pending": self.max_pending,
            "prefill_chunk": self.prefill_chunk,
            "kv_capacity": self.kv_capacity,
        }
        return {k: v for k, v in options.items() if v is not None}


class ServerState:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model_id = config.served_id()
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.loaded = asyncio.Event()
        self.metrics = Metrics()
        self.created = int(time.time())
        # Generations in flight, so that a shutdown can end them (finished ones drop out).
        self.active: weakref.WeakSet[Generation] = weakref.WeakSet()

    def require_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}")
        raise ApiError(503, "the model is still loading; retry shortly", headers={"Retry-After": "2"})


STATE = web.AppKey("ninfer_state", ServerState)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request) -> Any:
    """The request body as JSON; 413 above the size limit, 400 when it is not JSON."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].config.max_body_bytes
        raise ApiError(413, f"the request body is larger than the limit of {limit} bytes") from None
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


async def start_generation(request: web.Request, req: GenerationRequest, arrival: float) -> Generation:
    """Renders, tokenizes and submits `req`; the caller must `cancel()` it in a finally.
    `arrival` is the handler's start (time.monotonic()), the origin of time to first token."""
    state = request.app[STATE]
    engine = state.require_engine()
    prepared = await asyncio.get_running_loop().run_in_executor(None, prepare, engine, req)
    gen = Generation(engine, state.metrics, req, prepared, arrival)
    gen.start()
    state.active.add(gen)
    return gen
