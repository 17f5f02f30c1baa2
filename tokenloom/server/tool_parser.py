"""Tool calls in a model's own output, in the Hermes convention (Qwen2.5, Hermes 2 Pro, ...).

A model whose chat template describes tools answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with any number of such blocks. This reads them as vLLM's `hermes` tool parser does: the text
before the first `<tool_call>` is the message's `content` (None if empty); every block is one
OpenAI tool call; a last block without its `</tool_call>` still counts if its JSON is whole (the
model may end its turn right after the JSON). If any block is not a JSON object with a string
`name` and an `arguments` object, there are no calls and the whole text is content: a half-read
answer would be worse than the text itself. Text between and after blocks is dropped (whitespace
in practice).

`arguments` is the JSON text of the arguments as the model wrote it when the block starts with
`{"name": ..., "arguments":` (what these models write), so that a stream can send it while it is
being generated and the concatenated chunks equal the non-streamed string exactly; for any other
key order it is re-serialised (`json.dumps`), and then sent whole when the block ends.

`StreamingToolCallParser` turns the same text, fed as it grows, into OpenAI chat deltas: content
until `<tool_call>` starts (a possible partial tag is held back), then per call a first delta with
its index, id, type and name, then argument chunks. A stream cannot take back what it sent, so a
block that turns out malformed after its name went out ends its arguments with the text the model
wrote (OpenAI documents that arguments may not be valid JSON); one malformed before anything of it
went out is sent as content, as the non-streamed response would.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"

# The head every Hermes-style model writes: the name first, then the arguments' value starts.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
# What may still close the arguments and then the call object: held back until the block ends.
_CLOSING_TAIL = re.compile(r"[\s}]*$")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


def parse_block(body: str) -> ParsedCall | None:
    """One block's text (between the tags) as a call; None if it is not a whole, well-formed call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):  # OpenAI's arguments are always an object
        return None
    head = _HEAD.match(body)
    if head is not None:
        raw = _raw_arguments(body, head.end())
        if raw is not None and _same_json(raw, args):
            return ParsedCall(obj["name"], raw)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _raw_arguments(body: str, start: int) -> str | None:
    """The arguments' text as written: from `start` to just before the object's last `}`."""
    end = body.rstrip().rfind("}")
    return body[start:end].rstrip() if end > start else None


def _same_json(text: str, value) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:
        return False


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall]


def parse_tool_calls(text: str) -> ParsedOutput:
    """A whole model output: its content and calls (no calls: `content` is the whole text)."""
    first = text.find(CALL_START)
    if first < 0:
        return ParsedOutput(text, [])
    calls = []
    for body in _blocks(text[first:]):
        call = parse_block(body)
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
    return ParsedOutput(text[:first] or None, calls)


def _blocks(text: str) -> list[str]:
    """The bodies of the blocks in `text`, which starts with a `<tool_call>`; the last may be open."""
    bodies = []
    pos = 0
    while (start := text.find(CALL_START, pos)) >= 0:
        start += len(CALL_START)
        end = text.find(CALL_END, start)
        if end < 0:
            bodies.append(text[start:])
            break
        bodies.append(text[start:end])
        pos = end + len(CALL_END)
    return bodies


def _partial_tag_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class _OpenCall:
    index: int
    body: str = ""
    named: bool = False  # its first delta (id, type, name) went out
    args_start: int = -1  # where its arguments begin in `body`, when streamed as written
    sent_args: str = ""  # argument text sent so far


@dataclass
class StreamingToolCallParser:
    """Feed the text as it grows; each call returns one delta's fields (`final`: the output is complete,
    nothing is held back any more and an open last block is closed as it stands)."""

    text: str = ""  # everything fed so far
    pos: int = 0  # how much of `text` has been consumed
    in_calls: bool = False  # a `<tool_call>` was seen: no more content
    call: _OpenCall | None = None
    calls_named: int = 0
    held_content: str = ""  # text from the first `<tool_call>` on, sent as content if no call comes of it

    @property
    def called(self) -> bool:
        """At least one call went out: the choice finishes with "tool_calls"."""
        return self.calls_named > 0

    def feed(self, new_text: str, final: bool = False) -> dict:
        self.text += new_text
        return self._advance(final)

    # -- the state machine -------------------------------------------------------------------------

    def _advance(self, final: bool) -> dict:
        content: list[str] = []
        calls: list[dict] = []
        while True:
            rest = self.text[self.pos:]
            if self.call is None:
                start = rest.find(CALL_START)
                if start < 0:
                    keep = 0 if final else _partial_tag_at_end(rest, CALL_START)
                    self._emit_text(rest[:len(rest) - keep], content)
                    self.pos += len(rest) - keep
                    break
                self._emit_text(rest[:start], content)
                self.in_calls = True
                self.held_content += CALL_START
                self.call = _OpenCall(self.calls_named)
                self.pos += start + len(CALL_START)
                continue
            end = rest.find(CALL_END)
            if end < 0:
                keep = 0 if final else _partial_tag_at_end(rest, CALL_END)
                self.call.body += rest[:len(rest) - keep]
                self.held_content += rest[:len(rest) - keep]
                self.pos += len(rest) - keep
                if final:
                    self._close_call(calls, content)
                else:
                    self._stream_call(calls)
                break
            self.call.body += rest[:end]
            self.held_content += rest[:end] + CALL_END
            self.pos += end + len(CALL_END)
            self._close_call(calls, content)
        if final and not self.called and self.held_content:
            content.append(self.held_content)  # nothing came of the blocks: they are text
            self.held_content = ""
        delta: dict = {}
        if content and "".join(content):
            delta["content"] = "".join(content)
        if calls:
            delta["tool_calls"] = _merge(calls)
        return delta

    def _emit_text(self, text: str, content: list[str]) -> None:
        if not self.in_calls:
            content.append(text)
        else:  # between or after blocks: dropped as the whole-output parse drops it, kept in case
            self.held_content += text

    def _stream_call(self, calls: list[dict]) -> None:
        """Send what is certain of the open call: its name once whole, then its arguments as written
        up to the closing braces and spaces, which may belong to the call object."""
        call = self.call
        if not call.named:
            head = _HEAD.match(call.body)
            if head is None:
                return  # not written yet, or not the usual head: sent whole when the block ends
            try:
                name = json.loads(head.group(1))
            except ValueError:
                return
            if not name:
                return
            self._name(call, name, calls)
        if call.args_start < 0:
            # The arguments start at their first character, as in `parse_block` (not at the spaces before it).
            head = _HEAD.match(call.body)
            if head is None or head.end() == len(call.body):
                return
            call.args_start = head.end()
        written = call.body[call.args_start:]
        certain = written[:_CLOSING_TAIL.search(written).start()]
        self._send_args(call, certain[len(call.sent_args):], calls)

    def _close_call(self, calls: list[dict], content: list[str]) -> None:
        call, self.call = self.call, None
        parsed = parse_block(call.body)
        if not call.named:
            if parsed is None:
                return  # held: content at the end unless another call goes out
            self._name(call, parsed.name, calls)
            self._send_args(call, parsed.arguments, calls)
            return
        if parsed is not None and parsed.arguments.startswith(call.sent_args):
            self._send_args(call, parsed.arguments[len(call.sent_args):], calls)
        elif call.args_start >= 0:  # malformed after its name went out: end with what the model wrote
            written = call.body[call.args_start:].rstrip()
            self._send_args(call, written[len(call.sent_args):], calls)

    def _name(self, call: _OpenCall, name: str, calls: list[dict]) -> None:
        call.named = True
        self.calls_named += 1
        self.held_content = ""  # a call went out: the blocks are calls, not content
        calls.append({"index": call.index, "id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": ""}})

    def _send_args(self, call: _OpenCall, chunk: str, calls: list[dict]) -> None:
        if chunk:
            call.sent_args += chunk
            calls.append({"index": call.index, "function": {"arguments": chunk}})


def _merge(calls: list[dict]) -> list[dict]:
    """Consecutive entries for one call in one delta become one entry (its arguments joined)."""
    out: list[dict] = []
    for entry in calls:
        if out and out[-1]["index"] == entry["index"]:
            out[-1]["function"]["arguments"] += entry["function"]["arguments"]
        else:
            out.append({**entry, "function": dict(entry["function"])})
    return out
