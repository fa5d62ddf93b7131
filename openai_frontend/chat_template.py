"""Chat templates: the model's Jinja2 template (Triton model parameter `chat_template`) rendered
in a sandbox, as Hugging Face's `apply_chat_template(..., add_generation_prompt=True)` does.

Compiled templates are cached per (model, template text), so a reloaded model with a new template
gets a fresh compile while the common case compiles once.
"""

from __future__ import annotations

import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import InvalidRequest


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=64)
def _compile(model: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@lru_cache(maxsize=64)
def template_reads_tools(model: str, source: str) -> bool:
    """Whether the template uses a `tools` variable (else tools go into a system prompt, tool_calls.py)."""
    env = ImmutableSandboxedEnvironment()
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.exceptions.TemplateError:
        return False


# Variables the frontend sets itself (some only for some requests): never from chat_template_kwargs.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def render_chat(
    model: ModelInfo,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text for `messages`, as Hugging Face's `apply_chat_template` renders it.

    add_generation_prompt: end with the assistant's turn header. continue_final_message: end inside the
    last message instead (cut after its content), so the model continues it. `template_kwargs` are
    more template variables (vLLM's chat_template_kwargs; none may replace ours). `tools` is passed only
    to templates that read it. Raises InvalidRequest when the model has no template or the template
    refuses the messages (e.g. roles that do not alternate).
    """
    if not model.chat_template:
        raise InvalidRequest(f"model `{model.name}` has no chat template; use /v1/completions", "messages")
    variables: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": model.bos_token,
        "eos_token": model.eos_token,
    }
    if tools is not None:
        variables["tools"] = tools
    # The request's own fields are validated where they are parsed; a template variable must not replace them.
    taken = sorted(set(template_kwargs or {}) & (set(variables) | _RESERVED_VARIABLES))
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields set it",
            f"chat_template_kwargs.{taken[0]}",
        )
    variables.update(template_kwargs or {})
    try:
        rendered = _compile(model.name, model.chat_template).render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidRequest(f"chat template error: {e}", "messages") from None
    except TypeError as e:  # a template variable of the wrong kind (chat_template_kwargs)
        raise InvalidRequest(f"chat template error: {e}", "chat_template_kwargs") from None
    if continue_final_message:
        final = str(messages[-1].get("content") or "").strip()
        if final not in rendered:
            raise InvalidRequest(
                "continue_final_message: the final message does not appear in the rendered chat",
                "continue_final_message",
            )
        rendered = rendered[: rendered.rindex(final) + len(final)]
    return rendered
