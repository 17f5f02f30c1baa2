"""The Hermes tool-call parser (tokenloom/server/tool_parser.py) on strings: the whole-output parse
as vLLM's `hermes` parser reads it, and the streaming parser, whose deltas accumulated the way the
`openai` SDK accumulates them must give the same content and calls for every way the text is split."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from tokenloom.server.tool_parser import MAX_HEAD_CHARS, StreamingToolCallParser, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# -- the whole output ------------------------------------------------------------------------------


def test_plain_text_is_content():
    out = parse_tool_calls("Paris is sunny today.")
    assert out.content == "Paris is sunny today." and out.calls == []


def test_one_call_no_content():
    out = parse_tool_calls(CALL)
    assert out.content is None
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city": "Paris"}')]


def test_text_before_the_first_call_is_content_and_text_after_is_dropped():
    out = parse_tool_calls(f"Let me look.\n{CALL}\nDone.")
    assert out.content == "Let me look.\n"
    assert [c.name for c in out.calls] == ["get_weather"]


def test_several_calls_in_order():
    text = call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", '{"tz": "Europe/Oslo"}')
    out = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Oslo"})]


def test_arguments_keep_the_models_text_nested_braces_strings_and_unicode():
    args = '{"q": "a } b { \\"c\\"", "nested": {"deep": [1, {"x": "}"}]}, "city": "Zürich"}'
    out = parse_tool_calls(call("search", args))
    assert out.calls[0].arguments == args
    assert json.loads(out.calls[0].arguments)["city"] == "Zürich"


def test_compact_arguments_stay_compact():
    out = parse_tool_calls('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>')
    assert out.calls[0].arguments == '{"a":1}'


def test_other_key_order_is_reserialised():
    out = parse_tool_calls('<tool_call>\n{"arguments": {"city":"Oslo"}, "name": "get_weather"}\n</tool_call>')
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city": "Oslo"}')]


def test_missing_arguments_are_an_empty_object():
    out = parse_tool_calls('<tool_call>\n{"name": "ping"}\n</tool_call>')
    assert [(c.name, c.arguments) for c in out.calls] == [("ping", "{}")]


def test_an_open_last_block_with_whole_json_is_a_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    out = parse_tool_calls(text)
    assert [c.name for c in out.calls] == ["get_weather"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut by max_tokens
    '<tool_call>\n["get_weather"]\n</tool_call>',  # not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',  # empty name
    '<tool_call>\n{"name": "f", "arguments": "city=Paris"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # name not a string
])
def test_a_malformed_block_leaves_the_whole_text_as_content(text):
    out = parse_tool_calls(text)
    assert out.content == text and out.calls == []


def test_one_malformed_block_among_good_ones_means_no_calls():
    text = "Hi " + CALL + '<tool_call>{"name": "x", "arguments": {</tool_call>'
    out = parse_tool_calls(text)
    assert out.content == text and out.calls == []


def test_a_bare_json_answer_without_tags_is_content():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert parse_tool_calls(text).calls == []


# -- streaming -------------------------------------------------------------------------------------


class SDKAccumulator:
    """What the openai SDK's stream accumulation does with chat deltas: content concatenated; tool
    calls by index, id/type/name from the delta that has them, arguments concatenated."""

    def __init__(self):
        self.content: str | None = None
        self.calls: dict[int, dict] = {}
        self.deltas: list[dict] = []

    def add(self, delta: dict) -> None:
        self.deltas.append(delta)
        if delta.get("content"):
            self.content = (self.content or "") + delta["content"]
        for entry in delta.get("tool_calls", ()):
            slot = self.calls.setdefault(entry["index"], {"id": None, "type": None, "name": "", "arguments": ""})
            for key in ("id", "type"):
                if entry.get(key):
                    slot[key] = entry[key]
            fn = entry.get("function", {})
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""


def stream(text: str, cuts: list[int]) -> tuple[SDKAccumulator, StreamingToolCallParser]:
    parser, acc = StreamingToolCallParser(), SDKAccumulator()
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for i, piece in enumerate(pieces):
        acc.add(parser.feed(piece, final=i == len(pieces) - 1))
    return acc, parser


def splits(text: str) -> list[list[int]]:
    """Whole; one character at a time; and seeded random chunkings."""
    rng = random.Random(len(text))
    out = [[], list(range(1, len(text)))]
    out += [rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))) for _ in range(20)]
    return out


WELL_FORMED = [
    "Just text, no tools. a < b and <tool is not a tag",
    CALL,
    "Let me check that for you.\n" + CALL,
    call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", '{"tz": "Europe/Oslo", "fmt": {"h": 24}}'),
    call("search", '{"q": "a } b { \\"c\\"", "nested": {"deep": [1, {"x": "}"}]}, "city": "Zürich"}'),
    '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>',
    '<tool_call>\n{"arguments": {"city":"Oslo"}, "name": "get_weather"}\n</tool_call>',
    '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',  # open at the end
    CALL + "\ntrailing words",
    call("f", '{"a": 1   \n  }'),  # spaces inside the arguments, before their brace
    '<tool_call>\n{"name": "f", "arguments": {"a": "x  }  "}   }  \n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments":    {"a": {"b": [1, 2]  }  }\n}\n</tool_call>',
]


@pytest.mark.parametrize("text", WELL_FORMED)
def test_streamed_deltas_accumulate_to_the_whole_output_parse(text):
    whole = parse_tool_calls(text)
    expected = [(c.name, c.arguments) for c in whole.calls]
    for cuts in splits(text):
        acc, parser = stream(text, cuts)
        got = [(acc.calls[i]["name"], acc.calls[i]["arguments"]) for i in sorted(acc.calls)]
        assert got == expected, cuts
        assert acc.content == whole.content, cuts
        assert parser.called == bool(expected)
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in acc.calls.values())


def test_first_delta_of_a_call_carries_index_id_type_and_name_then_only_argument_chunks():
    text = "Sure. " + call("get_weather", '{"city": "Paris", "unit": "celsius"}') + call("get_time", '{"tz": "UTC"}')
    acc, _ = stream(text, list(range(1, len(text))))
    entries = [e for d in acc.deltas for e in d.get("tool_calls", ())]
    firsts = [e for e in entries if "id" in e]
    assert [(e["index"], e["type"], e["function"]["name"]) for e in firsts] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    rest = [e for e in entries if "id" not in e]
    assert rest and all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in rest)
    # Arguments really stream: the first call's arguments arrive in many chunks, before the block ends.
    assert sum(e["index"] == 0 for e in rest) > 10
    # Content only before the first call, never after a tool-call delta.
    kinds = ["content" if d.get("content") else "calls" for d in acc.deltas if d]
    assert kinds == sorted(kinds, key=lambda k: k == "calls")


def test_a_partial_tag_is_held_back_then_released_as_content():
    parser = StreamingToolCallParser()
    assert parser.feed("Use <tool") == {"content": "Use "}
    assert parser.feed("box>") == {"content": "<toolbox>"}
    assert parser.feed(" <", final=True) == {"content": " <"}


def test_nothing_of_the_tag_or_call_leaks_into_content():
    parser = StreamingToolCallParser()
    assert parser.feed("Hi <tool_") == {"content": "Hi "}
    assert parser.feed('call>\n{"name": "f') == {}  # the name is not whole yet
    delta = parser.feed('", "arguments": ')
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert parser.feed('{"a": 1}') == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]}
    assert parser.feed("}\n</tool_call>", final=True) == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}


@pytest.mark.parametrize("text", [
    '<tool_call>\n["get_weather"]\n</tool_call>',
    '<tool_call>\n{"arguments": {"city": "Par',
    'Hello <tool_call>{"nam',
])
def test_a_block_malformed_before_its_name_went_out_is_content_at_the_end(text):
    for cuts in splits(text):
        acc, parser = stream(text, cuts)
        assert acc.content == text and acc.calls == {} and not parser.called, cuts


def test_a_block_malformed_after_its_name_went_out_ends_with_the_models_text():
    # A stream cannot take the name back: the call stays, its arguments as written (not valid JSON).
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    acc, parser = stream(text, list(range(1, len(text))))
    assert parser.called and acc.content is None
    assert acc.calls[0]["name"] == "get_weather" and acc.calls[0]["arguments"] == '{"city": "Par'


def test_choices_do_not_share_state():
    a, b = StreamingToolCallParser(), StreamingToolCallParser()
    a.feed(CALL[:20])
    assert b.feed("plain", final=True) == {"content": "plain"} and not b.called


# -- work per token (issue 57 #5: a long run of spaces or braces froze the event loop) -------------


ARG_CHARS = 100_000
PER_TOKEN_BOUND = MAX_HEAD_CHARS + 64  # characters scanned for one token, whatever came before it


def _feed_counting(parser: StreamingToolCallParser, tokens) -> tuple[int, list[str], list[str]]:
    """(most characters scanned for one token, argument chunks, content chunks)."""
    worst, args, content = 0, [], []
    for i, token in enumerate(tokens):
        before = parser.scanned
        delta = parser.feed(token, final=i == len(tokens) - 1)
        worst = max(worst, parser.scanned - before)
        content.append(delta.get("content") or "")
        args += [e["function"].get("arguments") or "" for e in delta.get("tool_calls", ())]
    return worst, args, content


@pytest.mark.parametrize("filler", [" ", "}", "} ", "x", "\\n", "é", " \\t"])
@pytest.mark.parametrize("token_chars", [1, 7])
def test_a_100k_character_argument_costs_bounded_work_per_token(filler, token_chars):
    value = (filler * ARG_CHARS)[:ARG_CHARS]
    if value.endswith("\\"):
        value = value[:-1] + "x"
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "' + value + '"}}\n</tool_call>'
    tokens = [text[i:i + token_chars] for i in range(0, len(text), token_chars)]
    parser = StreamingToolCallParser()
    worst, args, content = _feed_counting(parser, tokens)
    assert worst <= PER_TOKEN_BOUND, worst
    assert parser.scanned <= 4 * len(text) + 2 * MAX_HEAD_CHARS * MAX_HEAD_CHARS  # linear overall
    assert "".join(args) == parse_tool_calls(text).calls[0].arguments == '{"a": "' + value + '"}'
    assert not "".join(content) and parser.called


@pytest.mark.parametrize("text", [
    '<tool_call>' + " " * ARG_CHARS + '{"name": "f", "arguments": {}}</tool_call>',  # no head in the window
    '<tool_call>{"name": "' + "n" * ARG_CHARS + '", "arguments": {}}</tool_call>',  # a name that never closes
    '<tool_call>{"name": "f", "arguments":' + " " * ARG_CHARS + '{"a": 1}}</tool_call>',
    "just text " * (ARG_CHARS // 10) + "<tool_cal",  # content, with a partial tag at the end
    '<tool_call>{"x": "' + "}" * ARG_CHARS + '"}</tool_call>',  # not a call: content at the end
])
def test_bodies_without_the_usual_head_cost_bounded_work_too(text):
    parser = StreamingToolCallParser()
    worst, args, content = _feed_counting(parser, list(text))
    assert worst <= PER_TOKEN_BOUND, worst
    whole = parse_tool_calls(text)
    assert "".join(args) == "".join(c.arguments for c in whole.calls)
    assert "".join(content) == (whole.content or "")
