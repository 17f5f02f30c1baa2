"""Chat templates that describe tools: which do, and rendering one with a request's tools.

A template "renders tools" when it reads a `tools` variable (Qwen2.5's lists them in its system turn,
in OpenAI's `{"type": "function", "function": {...}}` shape, as vLLM and transformers pass them).
`tool_choice: "auto"` also needs to read the model's calls back, in the convention the template asks
for (`call_format`): Hermes `<tool_call>` blocks (Qwen2.5, Qwen3, Hermes; tool_parser.py) or Llama
3.x's bare `{"name": ..., "parameters": ...}` objects (tool_parser_json.py).

The tokenizer's `apply_chat_template` takes no tools, so a request with tools renders through a
shallow copy of the tokenizer wrapper (and of the chat encoder that holds it) whose compiled
template gets `tools=` added to every render: the same sandboxed template, checks and special
tokens, nothing shared is modified.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache

import jinja2
from jinja2 import meta

from .errors import APIError
from .tool_parser import CALL_START


@lru_cache(maxsize=8)
def template_renders_tools(source: str | None) -> bool:
    if not source:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return False  # a template that does not parse fails at render time, with its own 400


HERMES, LLAMA3_JSON = "hermes", "llama3_json"  # vLLM's names for the two parsers


def call_format(source: str | None) -> str | None:
    """How a model answers calls under this chat template: HERMES when it describes tools and speaks of
    `<tool_call>` blocks, LLAMA3_JSON when it describes tools and asks for a `"parameters"` object
    (Llama 3.1 / 3.2 / 3.3's), None when it does not describe tools or asks for neither."""
    if not template_renders_tools(source):
        return None
    if CALL_START in source:
        return HERMES
    return LLAMA3_JSON if '"parameters"' in source else None


class _TemplateWithTools:
    def __init__(self, template, tools: list[dict]):
        self.template, self.tools = template, tools

    def render(self, **context) -> str:
        return self.template.render(**context, tools=self.tools)


def wrapper_with_tools(wrapper, tools: list[dict]):
    """A view of the tokenizer wrapper whose chat template renders with `tools`."""
    bound = copy.copy(wrapper)
    bound._template = _TemplateWithTools(wrapper._template, tools)
    return bound


def encoder_with_tools(encoder, tools: list[dict]):
    """A view of the chat encoder rendering with `tools`. Its tokenizer clone (for content read as
    text) is built on the shared encoder first, so the views share it instead of each building one."""
    _ = encoder._text_tokenizer
    bound = copy.copy(encoder)
    bound.wrapper = wrapper_with_tools(encoder.wrapper, tools)
    return bound


def refuse_spelled_controls(control_texts: tuple[str, ...], tools: list[dict], messages: list[dict]) -> None:
    """Tool definitions and earlier calls are rendered outside any message content, so the chat
    encoder cannot keep a control token they spell as text: it would become the real token and
    could forge a turn. Refused with a 400 instead (as the encoder refuses what it cannot place)."""
    for i, tool in enumerate(tools):
        _refuse(control_texts, tool, f"tools[{i}]")
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            _refuse(control_texts, call, f"messages[{i}].tool_calls[{j}]")
        if isinstance(m.get("tool_call_id"), str):
            _refuse(control_texts, m["tool_call_id"], f"messages[{i}].tool_call_id")


def _refuse(control_texts: tuple[str, ...], value, param: str) -> None:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    spelled = next((t for t in control_texts if t in text), None)
    if spelled is not None:
        raise APIError(400, f"{param}: spells the control token {spelled!r}, which this model's chat template "
                       "cannot keep as text", param=param.split("[")[0])
