"""The aiohttp application behind `ninfer serve` (docs/api.md).

`create_app` wires the routes of both APIs and the server's own endpoints (`/health`,
`/metrics`, `/tokenize`, `/detokenize`) behind one middleware that checks the API key, turns
every `ApiError` or HTTP error into the calling API's error shape, and counts responses by
endpoint and status. The engine is loaded in a worker thread once the app has started, so the
port answers at once: `/health` says 503 until the model is ready. `serve` runs the app until
SIGINT/SIGTERM, with handler cancellation on: a client that disconnects cancels its handler,
whose `finally` cancels the generation and frees its slot. At shutdown the generations still
running end with a "shutting down" error (an error event in a stream, else a 503).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ninfer.engine import Engine
from ninfer.server import anthropic, openai
from ninfer.server.errors import ApiError, bad_request, error_response
from ninfer.server.generation import render_prompt
from ninfer.server.schemas import Field, GenerationRequest, check_model, read_object
from ninfer.server.state import STATE, ServerConfig, ServerState, read_json

__all__ = ["create_app", "serve", "start_site"]

log = logging.getLogger("ninfer.server")

# Endpoints open without an API key: probes and scrapers carry no credentials.
_OPEN_PATHS = frozenset({"/health", "/metrics"})

# On SIGINT/SIGTERM running generations are ended at once (on_shutdown); a handler still busy
# after this long (e.g. writing to a stalled client) is cancelled.
SHUTDOWN_GRACE_SECONDS = 3.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _speaks_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def _check_api_key(request: web.Request, key: str) -> None:
    given = request.headers.get("x-api-key")
    auth = request.headers.get("Authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if not given:
        raise ApiError(
            401, "missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`", code="invalid_api_key"
        )
    if not hmac.compare_digest(given.encode("utf-8"), key.encode("utf-8")):
        raise ApiError(401, "invalid API key", code="invalid_api_key")


def _endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    status = 500
    try:
        key = state.config.api_key
        if key is not None and request.path not in _OPEN_PATHS:
            _check_api_key(request, key)
        response = await handler(request)
        status = response.status
        return response
    except ApiError as e:
        status = e.status
        return error_response(e, _speaks_anthropic(request))
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        message = e.reason if e.status != 404 else f"no such endpoint: {request.method} {request.path}"
        return error_response(ApiError(e.status, message), _speaks_anthropic(request))
    except (asyncio.CancelledError, ConnectionError):
        status = 499  # the client went away (the nginx convention)
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error"), _speaks_anthropic(request))
    finally:
        state.metrics.count_request(_endpoint(request), status)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None:
        return web.json_response({"status": "ok"})
    if state.load_error is not None:
        return web.json_response({"status": "error", "message": state.load_error}, status=503)
    return web.json_response({"status": "loading"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = state.engine.stats() if state.engine is not None else None
    text = state.metrics.render(stats)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})


_TOKENIZE_FIELDS = {
    "model": Field(("string",)),
    "prompt": Field(("string",)),
    "messages": Field(("array",)),
    "tools": Field(("array",)),
    "tool_choice": Field(("string", "object")),
    "chat_template_kwargs": Field(("object",)),
}


async def tokenize(request: web.Request) -> web.Response:
    """Token ids of a raw prompt, or of a chat rendered exactly as /v1/chat/completions would."""
    state = request.app[STATE]
    body = read_object(await read_json(request), _TOKENIZE_FIELDS)
    if "model" in body:
        check_model(body["model"], state.model_id)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("send exactly one of `prompt` and `messages`")
    req = GenerationRequest(model=state.model_id)
    if "prompt" in body:
        extra = set(body) - {"model", "prompt"}
        if extra:
            raise bad_request(f"`{sorted(extra)[0]}` goes with `messages`, not `prompt`", sorted(extra)[0])
        req.prompt = body["prompt"]
    else:
        chat = {"model": state.model_id, **{k: v for k, v in body.items() if k != "model"}}
        req = openai.parse_chat(chat, state.model_id)
    engine = state.require_engine()
    ids, _ = await asyncio.get_running_loop().run_in_executor(None, render_prompt, engine, req)
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.max_context})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = read_object(
        await read_json(request), {"model": Field(("string",)), "tokens": Field(("array",), required=True)}
    )
    if "model" in body:
        check_model(body["model"], state.model_id)
    engine = state.require_engine()
    vocab = int(engine.config.get("vocab_size", 0))
    tokens = body["tokens"]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise bad_request(f"`tokens` must be token ids in [0, {vocab})", "tokens")
    try:
        text = engine.decode(tokens)
    except ValueError as e:
        raise bad_request(str(e), "tokens") from None
    return web.json_response({"prompt": text})


def _default_loader(config: ServerConfig) -> Callable[[], Engine]:
    return lambda: Engine(config.model_path(), device=config.device, **config.engine_options())


async def _load(app: web.Application, loader: Callable[[], Engine]) -> None:
    state = app[STATE]
    try:
        state.engine = await asyncio.get_running_loop().run_in_executor(None, loader)
    except Exception as e:  # any failure to load is reported by /health and by `serve`
        state.load_error = str(e) or type(e).__name__
        log.error("the model failed to load: %s", state.load_error)
    finally:
        state.loaded.set()


def create_app(config: ServerConfig, loader: Callable[[], Engine] | None = None) -> web.Application:
    """The app; `loader` builds the engine (default: from `config`), in a worker thread."""
    app = web.Application(middlewares=[_middleware], client_max_size=config.max_body_bytes)
    app[STATE] = ServerState(config)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.add_routes(openai.routes())
    app.add_routes(anthropic.routes())
    load = loader or _default_loader(config)
    tasks: list[asyncio.Task[None]] = []

    async def on_startup(app: web.Application) -> None:
        tasks.append(asyncio.create_task(_load(app, load)))

    async def on_shutdown(app: web.Application) -> None:
        for gen in list(app[STATE].active):
            gen.abort("the server is shutting down")

    async def on_cleanup(app: web.Application) -> None:
        state = app[STATE]
        await state.loaded.wait()
        if state.engine is not None:
            engine, state.engine = state.engine, None
            await asyncio.get_running_loop().run_in_executor(None, engine.close)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Starts listening; returns the runner (call `cleanup()` to stop) and the bound port."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_GRACE_SECONDS,
        access_log=log if log.isEnabledFor(logging.INFO) else None,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound


async def serve(config: ServerConfig, host: str, port: int, out: Any = sys.stderr) -> int:
    """Runs the server until SIGINT/SIGTERM; returns the exit status (1 when the model fails)."""
    app = create_app(config)
    runner, bound = await start_site(app, host, port)
    state = app[STATE]
    print(f"ninfer: listening on http://{host}:{bound}, loading {config.model_path()}", file=out, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        loaded = asyncio.ensure_future(state.loaded.wait())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait((loaded, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not loaded.done():
            loaded.cancel()
            return 0
        stopped.cancel()
        if state.load_error is not None:
            print(f"error: the model failed to load: {state.load_error}", file=out, flush=True)
            return 1
        assert state.engine is not None
        print(
            f"ninfer: serving `{state.model_id}` on {state.engine.device}, context {state.engine.max_context}, "
            f"KV {state.engine.kv_capacity} tokens",
            file=out,
            flush=True,
        )
        await stop.wait()
        return 0
    finally:
        await runner.cleanup()
