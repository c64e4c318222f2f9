"""`ninfer serve`: an aiohttp server speaking the OpenAI and Anthropic APIs (docs/api.md).

Modules: `app` (routes, middleware, loading, `serve`), `openai` and `anthropic` (each API's
schema, translation into the one internal `schemas.GenerationRequest`, and responses),
`generation` (prompt rendering, submission, output parsing), `sse`, `metrics`, `errors`, `state`.
"""

from ninfer.server.app import create_app, serve, start_site
from ninfer.server.state import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve", "start_site"]
