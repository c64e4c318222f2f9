"""The server's one internal request type, and the field checks both APIs share.

OpenAI and Anthropic requests are translated into a `GenerationRequest` at the edge
(`openai.py`, `anthropic.py`); everything behind that (prompt rendering, sampling defaults,
submission, parsing) sees only this type. The protocol schemas themselves are tables of `Field`s:
each API module declares which fields it accepts, and `read_object` checks a JSON object
against such a table, so a wrong type, an out-of-range value or a field we do not support is
answered with a 400 naming the field instead of being ignored (docs/api.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine import SamplingParams
from ninfer.server.errors import ApiError, bad_request

__all__ = [
    "SAMPLING_FIELDS",
    "Field",
    "GenerationRequest",
    "check_model",
    "read_object",
    "read_stop",
    "sampling_fields",
    "sampling_params",
]

_KIND_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "array": "an array",
    "object": "an object",
}

# Upper bound on stop strings, as in the OpenAI API; the matcher cost grows with their number.
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Field:
    """One accepted field: its JSON kinds, whether it must be present, and its numeric range."""

    kinds: tuple[str, ...]
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[Any, ...] | None = None


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    raise AssertionError(f"unknown JSON kind {kind}")


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def read_object(
    value: Any,
    fields: dict[str, Field],
    path: str = "",
    unsupported: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Checks `value` against `fields` and returns its present, non-null fields.

    `unsupported` maps field names we know but do not implement to the reason given to the
    client; any other field not in `fields` is refused as unknown.
    """
    if not isinstance(value, dict):
        raise bad_request(f"{path or 'the request body'} must be a JSON object", path or None)
    out: dict[str, Any] = {}
    for key, item in value.items():
        if item is None:
            continue  # null means absent, as in both APIs (and SDK-dumped messages carry nulls)
        where = _where(path, key)
        if key not in fields:
            if unsupported and key in unsupported:
                raise bad_request(f"`{where}` is not supported: {unsupported[key]}", where)
            raise bad_request(f"unknown field `{where}`", where)
        spec = fields[key]
        if not any(_is_kind(item, k) for k in spec.kinds):
            kinds = " or ".join(_KIND_NAMES[k] for k in spec.kinds)
            raise bad_request(f"`{where}` must be {kinds}, got {type(item).__name__}", where)
        if spec.choices is not None and item not in spec.choices:
            options = ", ".join(repr(c) for c in spec.choices)
            raise bad_request(f"`{where}` must be one of {options}, got {item!r}", where)
        if spec.minimum is not None and _is_kind(item, "number") and item < spec.minimum:
            raise bad_request(f"`{where}` must be >= {spec.minimum:g}, got {item}", where)
        if spec.maximum is not None and _is_kind(item, "number") and item > spec.maximum:
            raise bad_request(f"`{where}` must be <= {spec.maximum:g}, got {item}", where)
        out[key] = item
    for key, spec in fields.items():
        if spec.required and key not in out:
            raise bad_request(f"`{_where(path, key)}` is required", _where(path, key))
    return out


def check_model(model: str, served: str) -> None:
    """A request must name the served model (its id from `--model-id`)."""
    if model != served:
        raise ApiError(
            404,
            f"the model `{model}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )


def read_stop(value: Any, param: str) -> list[str]:
    """A stop field: one string or a list of non-empty strings."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"`{param}` must be a string or a list of strings", param)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"`{param}` may hold at most {MAX_STOP_STRINGS} strings", param)
    if any(s == "" for s in stops):
        raise bad_request(f"`{param}` must not contain empty strings", param)
    return stops


# The sampling fields both APIs share, with the ranges the Rust sampler accepts (a value it
# would reject is caught here so that the 400 can name the API's own field).
SAMPLING_FIELDS: dict[str, Field] = {
    "temperature": Field(("number",), minimum=0.0),
    "top_p": Field(("number",), minimum=0.0, maximum=1.0),
    "top_k": Field(("integer",), minimum=-1),
    "min_p": Field(("number",), minimum=0.0, maximum=1.0),
    "presence_penalty": Field(("number",), minimum=-2.0, maximum=2.0),
    "frequency_penalty": Field(("number",), minimum=-2.0, maximum=2.0),
    "repetition_penalty": Field(("number",), minimum=0.0),
    "seed": Field(("integer",), minimum=0, maximum=2**64 - 1),
}


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields set by an already checked request body."""
    out = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    for k in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if k in out:
            out[k] = float(out[k])
    if out.get("top_p") == 0:
        raise bad_request("`top_p` must be > 0", "top_p")
    if out.get("repetition_penalty") == 0:
        raise bad_request("`repetition_penalty` must be > 0", "repetition_penalty")
    if out.get("top_k") == -1:
        out["top_k"] = 0  # -1 is the common spelling of "no top-k"; the engine uses 0
    return out


@dataclass
class GenerationRequest:
    """One generation in the server's own terms, whichever API asked for it.

    Exactly one of `messages` (a chat, in the chat template's message form: string contents,
    `reasoning_content`, tool calls with dict arguments, `tool` turns) and `prompt` (raw text or
    token ids, rendered by no template) is set.
    """

    model: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt: str | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False


# generation_config.json keys that give a request's defaults (model-spec.md section 5.1).
_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def sampling_params(
    req: GenerationRequest,
    generation_config: dict[str, Any],
    prompt_tokens: int,
    max_context: int,
) -> SamplingParams:
    """The engine's SamplingParams: the client's values, else the model's generation defaults.

    Without `max_tokens` a generation may run to `max_context`, as in the OpenAI API (the caller
    passes the context limit, or the KV capacity when that is smaller).
    """
    values: dict[str, Any] = {}
    for key in _DEFAULT_KEYS:
        default = generation_config.get(key)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            values[key] = int(default) if key == "top_k" else float(default)
    if generation_config.get("do_sample") is False:
        values["temperature"] = 0.0  # the model's authors asked for greedy decoding
    values.update(req.sampling)
    max_tokens = req.max_tokens if req.max_tokens is not None else max(1, max_context - prompt_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        stop=list(req.stop),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        **values,
    )
