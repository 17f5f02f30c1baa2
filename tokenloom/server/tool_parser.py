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
from dataclasses import dataclass, field

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"

# The head every Hermes-style model writes: the name first, then the arguments' value starts.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


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


def partial_tag_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


MAX_HEAD_CHARS = 1024  # a block whose `{"name": ..., "arguments":` head is not whole by then is sent at its end


def _is_tail(ch: str) -> bool:
    """What may close the arguments and the call object: a brace or whitespace (the regex `[\\s}]`)."""
    return ch == "}" or ch.isspace()


@dataclass
class _OpenCall:
    index: int
    parts: list[str] = field(default_factory=list)  # the block's text as fed (joined once, at its end)
    size: int = 0
    named: bool = False  # its first delta (id, type, name) went out
    streaming: bool = False  # its arguments are being sent as written (the head was found)
    gave_up: bool = False  # no head within MAX_HEAD_CHARS: the call goes out whole at its end
    sent: list[str] = field(default_factory=list)  # argument text sent so far
    sent_size: int = 0
    held: list[str] = field(default_factory=list)  # a run from a `}` on of braces and spaces, held back

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)

    @property
    def body(self) -> str:
        return "".join(self.parts)

    @property
    def sent_args(self) -> str:
        return "".join(self.sent)


@dataclass
class StreamingToolCallParser:
    """Feed the text as it grows; each call returns one delta's fields (`final`: the output is complete,
    nothing is held back any more and an open last block is closed as it stands).

    The work per fed chunk is bounded by the chunk's length (plus MAX_HEAD_CHARS while a block's head is
    being read), never by what came before it: only the text not yet consumed is searched (at most a
    partial tag plus the new chunk), a block's text is kept as a list of parts and joined once, when it
    ends, and the held-back run of closing braces and spaces is tracked as the chunks come. `scanned`
    counts the characters examined, for the tests. Once per block, at its end, the whole block is
    parsed (`parse_block`, as the non-streamed response does), and held text goes out once."""

    pending: str = ""  # text fed and not consumed yet: a possible partial tag, then the new chunk
    in_calls: bool = False  # a `<tool_call>` was seen: no more content
    call: _OpenCall | None = None
    calls_named: int = 0
    held_content: list[str] = field(default_factory=list)  # from the first `<tool_call>` on, content if no call
    scanned: int = 0

    @property
    def called(self) -> bool:
        """At least one call went out: the choice finishes with "tool_calls"."""
        return self.calls_named > 0

    def feed(self, new_text: str, final: bool = False) -> dict:
        self.pending += new_text
        return self._advance(final)

    # -- the state machine -------------------------------------------------------------------------

    def _advance(self, final: bool) -> dict:
        content: list[str] = []
        calls: list[dict] = []
        while True:
            rest = self.pending
            self.scanned += len(rest)
            if self.call is None:
                start = rest.find(CALL_START)
                if start < 0:
                    keep = 0 if final else partial_tag_at_end(rest, CALL_START)
                    self._emit_text(rest[:len(rest) - keep], content)
                    self.pending = rest[len(rest) - keep:]
                    break
                self._emit_text(rest[:start], content)
                self.in_calls = True
                self.held_content.append(CALL_START)
                self.call = _OpenCall(self.calls_named)
                self.pending = rest[start + len(CALL_START):]
                continue
            end = rest.find(CALL_END)
            if end < 0:
                keep = 0 if final else partial_tag_at_end(rest, CALL_END)
                taken = rest[:len(rest) - keep]
                self.pending = rest[len(rest) - keep:]
                self.call.add(taken)
                self.held_content.append(taken)
                if final:
                    self._close_call(calls, content)
                else:
                    self._stream_call(taken, calls)
                break
            self.call.add(rest[:end])
            self.held_content += [rest[:end], CALL_END]
            self.pending = rest[end + len(CALL_END):]
            self._close_call(calls, content)
        if final and not self.called and self.held_content:
            content.append("".join(self.held_content))  # nothing came of the blocks: they are text
            self.held_content = []
        delta: dict = {}
        if content and "".join(content):
            delta["content"] = "".join(content)
        if calls:
            delta["tool_calls"] = _merge(calls)
        return delta

    def _emit_text(self, text: str, content: list[str]) -> None:
        if not self.in_calls:
            content.append(text)
        elif text:  # between or after blocks: dropped as the whole-output parse drops it, kept in case
            self.held_content.append(text)

    def _stream_call(self, new: str, calls: list[dict]) -> None:
        """Send what is certain of the open call (`new`: what it just grew by): its name once whole, then
        its arguments as written, all but a run from a `}` on of braces and spaces, which may close the
        arguments and the call object."""
        call = self.call
        if call.streaming:
            self._stream_args(call, new, calls)
            return
        if call.gave_up:
            return
        if call.size > MAX_HEAD_CHARS:
            call.gave_up = True  # not the usual head: sent whole when the block ends
            return
        body = call.body  # at most MAX_HEAD_CHARS
        self.scanned += len(body)
        head = _HEAD.match(body)
        if head is None:
            return  # not written yet, or not the usual head
        if not call.named:
            try:
                name = json.loads(head.group(1))
            except ValueError:
                return
            if not name:
                return
            self._name(call, name, calls)
        # The arguments start at their first character, as in `parse_block` (not at the spaces before it).
        if head.end() == len(body):
            return
        call.streaming = True
        self._stream_args(call, body[head.end():], calls)

    def _stream_args(self, call: _OpenCall, new: str, calls: list[dict]) -> None:
        j = len(new)
        while j and _is_tail(new[j - 1]):  # the new text's own run of braces and spaces, from its end
            j -= 1
        self.scanned += len(new) - j + 1
        if j:  # something that closes nothing came: what was held is arguments after all
            self._send_args(call, "".join(call.held) + new[:j], calls)
            call.held = []
        run = new[j:]
        if call.held:
            call.held.append(run)
            return
        brace = run.find("}")
        self.scanned += len(run)
        if brace < 0:  # spaces before any brace are inside the arguments
            self._send_args(call, run, calls)
        else:
            self._send_args(call, run[:brace], calls)
            call.held = [run[brace:]]

    def _close_call(self, calls: list[dict], content: list[str]) -> None:
        call, self.call = self.call, None
        body = call.body
        parsed = parse_block(body)
        if not call.named:
            if parsed is None:
                return  # held: content at the end unless another call goes out
            self._name(call, parsed.name, calls)
            self._send_args(call, parsed.arguments, calls)
            return
        sent = call.sent_args
        if parsed is not None and parsed.arguments.startswith(sent):
            self._send_args(call, parsed.arguments[len(sent):], calls)
        elif call.streaming:  # malformed after its name went out: end with what the model wrote
            written = body[_HEAD.match(body).end():].rstrip()
            self._send_args(call, written[len(sent):], calls)

    def _name(self, call: _OpenCall, name: str, calls: list[dict]) -> None:
        call.named = True
        self.calls_named += 1
        self.held_content = []  # a call went out: the blocks are calls, not content
        calls.append({"index": call.index, "id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": ""}})

    def _send_args(self, call: _OpenCall, chunk: str, calls: list[dict]) -> None:
        if chunk:
            call.sent.append(chunk)
            call.sent_size += len(chunk)
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
