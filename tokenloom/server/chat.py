"""POST /v1/chat/completions: messages through the model's chat template, then one engine request.

Streaming sends, per choice, a first delta carrying the role together with the first text, then
content deltas, then a delta with the finish_reason. The role goes out only once the first token
exists: benchmark clients (vllm bench serve) take TTFT from the first message with choices, so a
role-only message sent at once would report a TTFT that never happened.
"""

from __future__ import annotations

from . import convert
from .chat_text import check_template_kwargs
from .errors import APIError
from .generation import GenerationView
from .protocol import ChatCompletionRequest
from .reasoning import Split, StreamingReasoningSplitter, split_reasoning
from .state import INLINE_CHARS, ServerState
from .streams import ChoiceDelta
from .structured import ToolChoice, tool_choice
from .tool_parser import StreamingToolCallParser, new_call_id, parse_tool_calls
from .tool_parser_json import StreamingJSONCallParser, parse_json_calls
from .tool_template import LLAMA3_JSON, encoder_with_tools, refuse_spelled_controls, wrapper_with_tools


def render_prompt(state: ServerState, req: ChatCompletionRequest, tools: ToolChoice | None = None
                  ) -> tuple[str, list[int] | None]:
    """The rendered prompt and, unless the operator trusts chat messages, its ids with message content
    tokenized as text (chat_text.py; no BOS yet)."""
    messages = convert.chat_messages(req, tools)
    encoder, wrapper = state.chat_encoder, state.tokenizer
    template_tools = tools.template_tools if tools is not None else None
    if template_tools is not None:
        encoder, wrapper = encoder_with_tools(encoder, template_tools), wrapper_with_tools(wrapper, template_tools)
    template_kwargs = check_template_kwargs(req.chat_template_kwargs)
    try:
        if state.trust_chat_messages:
            return wrapper.apply_chat_template(messages, req.add_generation_prompt, template_kwargs), None
        refuse_spelled_controls(encoder.control_texts, template_tools or [], messages)
        encoder.check_messages(messages)
        text, spans = encoder.render(messages, req.add_generation_prompt, template_kwargs)
    except (ValueError, APIError):
        raise
    except Exception as exc:  # jinja errors: the messages do not fit the template
        raise APIError(400, f"messages: the chat template failed: {exc}", param="messages") from exc
    state.check_text_length(len(text), "messages")
    return text, encoder.encode(text, spans, messages)


async def render_prompt_ids(state: ServerState, req: ChatCompletionRequest, tools: ToolChoice | None = None,
                            add_special_tokens: bool = True) -> tuple[str, list[int]]:
    """The rendered prompt and its ids; long conversations are rendered off the event loop, and
    one whose text alone cannot fit the context is refused before rendering."""
    chars = sum(len(m.content) if isinstance(m.content, str) else
                sum(len(p.text or "") for p in m.content or ()) for m in req.messages)
    state.check_text_length(chars, "messages")
    if chars < INLINE_CHARS:
        text, ids = render_prompt(state, req, tools)
    else:
        text, ids = await state.run_off_loop(render_prompt, state, req, tools)
    if ids is None:
        return text, await state.encode(text, "messages", add_special_tokens)
    return text, state.with_bos(ids) if add_special_tokens else ids


class _ChatView(GenerationView):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    tools: ToolChoice | None = None
    _parsers: dict[int, StreamingToolCallParser | StreamingJSONCallParser]  # "auto", streaming: one per choice
    _thinking: dict[int, StreamingReasoningSplitter]  # --reasoning-parser, streaming: one per choice

    async def engine_inputs(self):
        self.tools = tool_choice(self.req, self.tok.chat_template)
        params = convert.chat_params(self.req, self.tools)
        _, ids = await render_prompt_ids(self.state, self.req, self.tools)
        self._parsers, self._thinking = {}, {}
        return params, [ids]

    def _split(self, d: ChoiceDelta, streaming: bool) -> Split:
        """The delta's text as reasoning and content (all content without --reasoning-parser)."""
        if self.state.reasoning_parser is None:
            return Split(None, d.text)
        if not streaming:
            return split_reasoning(d.text, self.state.reasoning_parser)
        splitter = self._thinking.setdefault(d.index, StreamingReasoningSplitter(self.state.reasoning_parser))
        return splitter.feed(d.text, final=d.choice.finish_reason is not None)

    def render(self, d: ChoiceDelta, streaming: bool) -> dict:
        if self.tools is not None and self.tools.auto:
            return self._render_auto_stream(d) if streaming else self._render_auto_whole(d)
        if self.tools is not None:
            return self._render_tool_calls(d, streaming)
        split = self._split(d, streaming)
        if d.first or not streaming:
            message = {"role": "assistant", "content": split.content}
        else:
            message = {"content": split.content} if split.content else {}
        if self.state.reasoning_parser and (split.reasoning or not streaming):
            message["reasoning_content"] = split.reasoning
        return {"delta" if streaming else "message": message, "logprobs": self._logprobs(d)}

    def _logprobs(self, d: ChoiceDelta) -> dict | None:
        if d.logprobs is None:
            return None
        return convert.chat_logprobs(self.tok, d.token_ids, d.logprobs, self.req.top_logprobs or 0)

    def _render_auto_whole(self, d: ChoiceDelta) -> dict:
        """"auto": the model's `<tool_call>` blocks become `tool_calls`, the text before them `content`."""
        split = self._split(d, streaming=False)
        parse = parse_json_calls if self.tools.call_format == LLAMA3_JSON else parse_tool_calls
        parsed = parse(split.content or "")
        message: dict = {"role": "assistant", "content": parsed.content}
        if self.state.reasoning_parser:
            message["reasoning_content"] = split.reasoning
        out = {"message": message, "logprobs": self._logprobs(d)}
        if parsed.calls:
            message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
            out["finish_reason"] = "tool_calls"
        return out

    def _render_auto_stream(self, d: ChoiceDelta) -> dict:
        """"auto", streamed: content deltas until a `<tool_call>` starts, then tool-call deltas."""
        if d.index not in self._parsers:
            json_calls = self.tools.call_format == LLAMA3_JSON
            self._parsers[d.index] = StreamingJSONCallParser() if json_calls else StreamingToolCallParser()
        parser = self._parsers[d.index]
        split = self._split(d, streaming=True)
        delta = parser.feed(split.content or "", final=d.choice.finish_reason is not None)
        if split.reasoning:
            delta["reasoning_content"] = split.reasoning
        if d.first:
            delta = {"role": "assistant", "content": delta.pop("content", None), **delta}
        out = {"delta": delta, "logprobs": self._logprobs(d)}
        if d.choice.finish_reason is not None and parser.called:
            out["finish_reason"] = "tool_calls"
        return out

    def _render_tool_calls(self, d: ChoiceDelta, streaming: bool) -> dict:
        """A forced call: the grammar-constrained text becomes `tool_calls` once the choice is complete
        (streamed as one delta per call, OpenAI's shape); a truncated one stays text."""
        key = "delta" if streaming else "message"
        head = {"role": "assistant", "content": None} if d.first else {}
        c = d.choice
        if c.finish_reason is None:
            return {key: head}
        try:  # a call exists only if the grammar completed (not cut by max_tokens or a stop condition)
            calls = self.tools.calls(c.text) if c.finish_reason == "stop" and c.stop_reason is None else None
        except ValueError:
            calls = None
        if calls is None:
            return {key: {**head, "content": c.text}}  # the whole text, also when streaming
        if streaming:
            calls = [{"index": i, **call} for i, call in enumerate(calls)]
        return {key: {**head, "tool_calls": calls}, "finish_reason": "tool_calls"}


ChatView = _ChatView
create_chat_completion = _ChatView.create
