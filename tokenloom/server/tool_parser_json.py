"""Tool calls in a model's own output, in Llama 3.x's JSON convention (vLLM's `llama3_json` parser).

Llama 3.1 / 3.2 / 3.3's chat templates ask the model to answer a call as a bare JSON object,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after the `<|python_tag|>` token's text, several calls separated by `;`. An output is calls
when, past leading whitespace (and that tag), it starts with `{` and is nothing but such objects: each
with a string `name` and a `parameters` (or `arguments`) object. Anything else, including an object
that is not a whole call, is content as written: a half-read answer would be worse than the text.

Streaming cannot know an output is calls before it ends (a JSON answer to a question looks the same),
so `StreamingJSONCallParser` sends content live until the first character that could open a call, and
from there holds the text, as parts joined once, until the output ends; then it sends each call whole
(a first delta with its id and name, then its arguments) or the held text as content — the same
message the non-streamed response gives. The work per token is the token's length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .tool_parser import ParsedCall, ParsedOutput, new_call_id, partial_tag_at_end

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse_json_calls(text: str) -> ParsedOutput:
    """A whole model output: its calls (content None), or no calls and the whole text as content."""
    body = text.lstrip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return ParsedOutput(text, [])
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            return ParsedOutput(text, [])
        call = _call(obj)
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
        pos = _skip_separator(body, end)
    return ParsedOutput(None, calls)


def _call(obj) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if not isinstance(args, dict):  # OpenAI's arguments are always an object
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _skip_separator(body: str, pos: int) -> int:
    """Past the whitespace and at most one `;` between two calls (the end of `body` at its end)."""
    while pos < len(body) and body[pos].isspace():
        pos += 1
    if pos < len(body) and body[pos] == ";":
        pos += 1
    while pos < len(body) and body[pos].isspace():
        pos += 1
    return pos


@dataclass
class StreamingJSONCallParser:
    """Feed the text as it grows; each call returns one delta's fields (`final`: the output is complete).
    Same interface as tool_parser.StreamingToolCallParser. `scanned` counts the characters examined."""

    started: bool = False  # past the leading whitespace: it is content or a possible call
    holding: bool = False  # the output opened like a call: held until it ends
    lead: str = ""  # leading whitespace, or a partial `<|python_tag|>`, not yet known to be either
    held: list[str] = field(default_factory=list)
    calls_named: int = 0
    scanned: int = 0

    @property
    def called(self) -> bool:
        return self.calls_named > 0

    def feed(self, new_text: str, final: bool = False) -> dict:
        self.scanned += len(new_text)
        if self.holding:
            self.held.append(new_text)
            return self._finish() if final else {}
        if self.started:
            return {"content": new_text} if new_text else {}
        text = self.lead + new_text
        rest = text.lstrip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
        elif not final and rest and len(rest) < len(PYTHON_TAG) and partial_tag_at_end(rest, PYTHON_TAG) == len(rest):
            self.lead = text  # may still become the tag
            return {}
        if not rest and not final:
            self.lead = text  # whitespace (or the tag) alone so far: either way
            return {}
        self.lead, self.started = "", True
        if rest.startswith("{"):
            self.holding = True
            self.held.append(text)
            return self._finish() if final else {}
        return {"content": text} if text else {}

    def _finish(self) -> dict:
        text = "".join(self.held)
        self.held = []
        parsed = parse_json_calls(text)
        if not parsed.calls:
            return {"content": text}
        deltas = []
        for call in parsed.calls:
            deltas.append({"index": self.calls_named, "id": new_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
            self.calls_named += 1
        return {"tool_calls": deltas}
