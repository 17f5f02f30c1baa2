"""`--reasoning-parser qwen3` (vLLM's flag): a thinking model's `<think>…</think>` block becomes the
message's `reasoning_content`, what follows it the `content` (DeepSeek's and vLLM's field name).

One rule for whole responses and streams alike, so both give the same split: an answer that begins
with `<think>` (after whitespace; for `deepseek_r1`, whose template opens the block in the prompt, every
answer) is reasoning up to `</think>`, or up to its end if the answer was cut
before the block closed (a stream cannot take back what it sent as reasoning); any other answer is all
content. With `enable_thinking: false` Qwen3's template writes an empty block into the prompt and the
answer is plain content.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_parser import partial_tag_at_end

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # both mark their thoughts the same way


@dataclass
class Split:
    reasoning: str | None
    content: str | None


def split_reasoning(text: str, parser: str = "qwen3") -> Split:
    """`qwen3`: reasoning only in an answer that opens with `<think>`. `deepseek_r1`: its template puts
    `<think>` in the prompt, so every answer opens in reasoning (a `<think>` it writes anyway is dropped)."""
    body = text.lstrip()
    if parser == "deepseek_r1" and not body.startswith(THINK_START):
        body = THINK_START + body
    if not body.startswith(THINK_START):
        return Split(None, text)
    thought, closed, rest = body[len(THINK_START):].partition(THINK_END)
    return Split(thought, rest or None) if closed else Split(thought, None)


class StreamingReasoningSplitter:
    """The same split as `split_reasoning`, fed one delta at a time. Work per delta is bounded by the
    delta and a tag's length: only the held-back tail is scanned again."""

    def __init__(self, parser: str = "qwen3"):
        self._parser = parser
        self._mode = "start"  # "start" (before the first text), "reasoning", "content"
        self._pending = ""  # text not sent yet: what could still be part of a tag

    def feed(self, text: str, final: bool = False) -> Split:
        pending, self._pending = self._pending + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        if self._mode == "start":
            body = pending.lstrip()
            if body.startswith(THINK_START):
                self._mode, pending = "reasoning", body[len(THINK_START):]
            elif THINK_START.startswith(body) and not final:
                self._pending = pending  # whitespace or a partial "<think" so far
                return Split(None, None)
            elif self._parser == "deepseek_r1":
                self._mode, pending = "reasoning", body
            else:
                self._mode = "content"
        if self._mode == "reasoning":
            thought, closed, rest = pending.partition(THINK_END)
            if closed:
                reasoning.append(thought)
                self._mode, pending = "content", rest
            else:
                keep = 0 if final else partial_tag_at_end(thought, THINK_END)
                reasoning.append(thought[: len(thought) - keep])
                self._pending, pending = thought[len(thought) - keep:], ""
        if self._mode == "content" and pending:
            content.append(pending)
        return Split("".join(reasoning) or None, "".join(content) or None)
