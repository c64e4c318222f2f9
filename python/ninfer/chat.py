"""Chat template rendering.

Templates are rendered in a Jinja environment configured the way Hugging Face transformers
configures it for `apply_chat_template` (model-spec.md section 5.2), so a checkpoint's own
`chat_template.jinja` renders to the same prompt here as it does there: sandboxed and immutable,
`trim_blocks` and `lstrip_blocks` on, the loop-controls extension, a `tojson` filter that does not
escape HTML or non-ASCII characters, and the `raise_exception` / `strftime_now` globals.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "default_template", "render_chat"]


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rejected the conversation."""


class _TemplateRaised(jinja2.TemplateError):
    """Raised by the template itself through `raise_exception(message)`."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes and sorts keys; templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by training templates to mark
    assistant tokens) and renders its body unchanged, as transformers does for plain rendering."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def default_template() -> str:
    """ninfer's own Qwen3.6-style template, used when an artifact carries none."""
    return resources.files("ninfer").joinpath("templates").joinpath("qwen3_6.jinja").read_text("utf-8")


def render_chat(
    template: str,
    messages: list[dict],
    tools: list | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render `messages` (OpenAI-style dicts) with `template`.

    `tools` is a list of JSON tool definitions. Extra keyword arguments become template
    variables, e.g. `enable_thinking`, `preserve_thinking`, `bos_token`, `eos_token`.
    Raises ChatTemplateError when the template does not compile or rejects the input.
    """
    if not messages:
        raise ChatTemplateError("the conversation has no messages")
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ChatTemplateError("each tool must be a JSON object (a dict)")
    # transformers always passes `documents`; keep it defined the same way for templates that test it.
    kwargs.setdefault("documents", None)
    try:
        compiled = _compile(template)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"invalid chat template: {err}") from err
    try:
        return compiled.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except _TemplateRaised as err:
        raise ChatTemplateError(err.message or "the chat template rejected the conversation") from err
    except (jinja2.TemplateError, TypeError) as err:
        raise ChatTemplateError(f"chat template failed: {err}") from err
