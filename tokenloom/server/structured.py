"""Structured output and tool calls over the API: the request's fields -> one grammar, and back.

Any one of these constrains a request's output: OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `structured_outputs` (json / regex / choice / grammar / json_object) or its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and (chat) `tools` with a
`tool_choice` that forces a call. A forced call goes through the grammar, as vLLM does for any
model: `"required"` makes the model write a JSON array of `{"name", "parameters"}` objects, one of
the tools each; a named function makes it write that function's arguments. `"none"` ignores the
tools. `"auto"` (OpenAI's default when tools are given) needs a chat template that describes tools
and tells the model how to answer a call: `<tool_call>` blocks (Qwen2.5's, read back by tool_parser.py
as vLLM's `hermes` parser does) or Llama 3.x's `{"name", "parameters"}` objects (tool_parser_json.py,
vLLM's `llama3_json`); the model then decides, without a grammar. On any other template it is
refused with a 400 rather than silently answered as text. Where the template
describes tools, a forced call is rendered with them too (as vLLM renders it), the grammar unchanged;
elsewhere the tools are described in a system message (`ToolChoice.system_prompt`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..sampling_params import StructuredOutputsParams
from ..structured_output.limits import DEFAULT_LIMITS, json_depth
from .errors import APIError
from .protocol import ChatCompletionRequest, _SamplingFields
from .tool_template import call_format, template_renders_tools

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The one grammar the request asks for (None: unconstrained); a 400 naming the field otherwise."""
    asked: list[tuple[str, dict]] = []
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", req.structured_outputs))
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema: required for type json_schema",
                           param="response_format")
        asked.append(("response_format", {"json": fmt.json_schema.schema_}))
    for name, kind in _GUIDED.items():
        if getattr(req, name) is not None:
            asked.append((name, {kind: getattr(req, name)}))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(400, f"{asked[1][0]}: only one of {names} may constrain the output", param=asked[1][0])
    if not asked:
        return None
    name, fields = asked[0]
    try:
        return StructuredOutputsParams.from_dict(fields)
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None


@dataclass
class ToolChoice:
    """The request's tools and how a call comes: forced (`name` None = "required": any of the tools,
    one or more calls; else that function) through a grammar, or `auto` (the model decides; no grammar)."""

    tools: dict[str, dict]  # name -> JSON schema of its parameters
    name: str | None
    parallel: bool = True  # "required" may make several calls (OpenAI's parallel_tool_calls)
    auto: bool = False
    # The tools in OpenAI's shape for a chat template that renders them (None: it does not; they go
    # into a system message instead).
    template_tools: list[dict] | None = None
    call_format: str | None = None  # `auto`: how the model writes its calls (tool_template.call_format)

    def grammar(self) -> StructuredOutputsParams:
        if self.name is not None:
            return StructuredOutputsParams(json=self.tools[self.name])
        defs: dict[str, dict] = {}
        call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _hoist(name, params, defs)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, params in self.tools.items()]
        most = {"maxItems": 1} if not self.parallel else {}
        root = {"type": "array", "minItems": 1, **most, "items": {"anyOf": call}}
        return StructuredOutputsParams(json={**root, "$defs": defs} if defs else root)

    def calls(self, text: str) -> list[dict]:
        """OpenAI `tool_calls` from the constrained output (ValueError if it is not complete JSON)."""
        if self.name is not None:
            json.loads(text)
            pairs = [(self.name, text)]
        else:
            pairs = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": arguments}} for name, arguments in pairs]

    def system_prompt(self) -> str:
        """What the model is told, since its chat template has no place for tools."""
        specs = json.dumps([{"name": n, "parameters": p} for n, p in self.tools.items()], ensure_ascii=False)
        return f"You can call these functions; answer with a call as JSON.\nFunctions: {specs}"


def _hoist(tool: str, schema, defs: dict[str, dict]):
    """A tool schema nested under the call array: its `$defs` move to the root under the tool's name,
    and its `#/$defs/...` references follow them (they resolve against the root document)."""
    if isinstance(schema, list):
        return [_hoist(tool, item, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$defs" and isinstance(value, dict):
            defs.update({f"{tool}.{name}": _hoist(tool, sub, defs) for name, sub in value.items()})
        elif key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
            out[key] = f"#/$defs/{tool}.{value[len('#/$defs/'):]}"
        else:
            out[key] = _hoist(tool, value, defs)
    return out


def tool_choice(req: ChatCompletionRequest, chat_template: str | None) -> ToolChoice | None:
    """The request's tools against the model's chat template (None: no tools, or "none")."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        return None
    tools = {}
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise APIError(400, f"tools[{i}].type: only function tools are supported, got {tool.type!r}", param="tools")
        if tool.function is None:
            raise APIError(400, f"tools[{i}].function: a function tool needs its name and parameters", param="tools")
        params = tool.function.parameters or {"type": "object", "properties": {}}
        # Measured without recursion before anything walks it (`_hoist`, json.dumps): nested deeper than
        # the grammar limit it would otherwise be a RecursionError, a 500.
        if (depth := json_depth(params)) > DEFAULT_LIMITS.max_grammar_depth:
            raise APIError(400, f"tools[{i}].function.parameters: a nesting depth of {depth} exceeds "
                           f"max_grammar_depth ({DEFAULT_LIMITS.max_grammar_depth})", param="tools")
        tools[tool.function.name] = params
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice == "none":
        return None
    # As vLLM passes them to the template: OpenAI's objects, unset fields left out.
    template_tools = ([t.model_dump(exclude_none=True) for t in req.tools]
                      if template_renders_tools(chat_template) else None)
    if choice == "auto":
        if (fmt := call_format(chat_template)) is not None:
            return ToolChoice(tools, None, req.parallel_tool_calls is not False, True, template_tools, fmt)
        if template_tools is not None:
            raise APIError(400, "tool_choice: 'auto' is not supported for this model: its chat template describes "
                           "tools but neither as <tool_call> blocks nor as Llama 3's {\"name\", \"parameters\"} "
                           "objects, the calls this server reads; use 'required' or name a function",
                           param="tool_choice")
        raise APIError(400, "tool_choice: 'auto' needs a chat template that knows tools and this model's does "
                       "not; use 'required' or name a function", param="tool_choice")
    if choice == "required":
        return ToolChoice(tools, None, req.parallel_tool_calls is not False, template_tools=template_tools)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in tools:
            raise APIError(400, f"tool_choice: no tool named {name!r}", param="tool_choice")
        return ToolChoice(tools, name, template_tools=template_tools)
    raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or a named function", param="tool_choice")
