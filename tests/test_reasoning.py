"""--reasoning-parser: `<think>` blocks as reasoning_content, the same split whole or streamed however
the text is cut into deltas."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenloom.server.reasoning import StreamingReasoningSplitter, split_reasoning


def test_whole_answers():
    s = split_reasoning("<think>\nAdd them.\n</think>\n\n4")
    assert (s.reasoning, s.content) == ("\nAdd them.\n", "\n\n4")
    assert split_reasoning("4").reasoning is None and split_reasoning("4").content == "4"
    assert (split_reasoning("  <think>cut off").reasoning, split_reasoning("  <think>cut off").content) == ("cut off",
                                                                                                           None)
    assert split_reasoning("<think></think>").content is None
    assert split_reasoning("no <think>here</think>").reasoning is None  # only an answer that opens with one


def streamed(chunks: list[str], parser: str = "qwen3") -> tuple[str | None, str | None]:
    splitter, reasoning, content = StreamingReasoningSplitter(parser), [], []
    for i, chunk in enumerate(chunks):
        s = splitter.feed(chunk, final=i == len(chunks) - 1)
        reasoning += [s.reasoning] if s.reasoning else []
        content += [s.content] if s.content else []
    return "".join(reasoning) or None, "".join(content) or None


pieces = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n", "4", "<th"]),
                  max_size=12)


@given(pieces, st.data(), st.sampled_from(["qwen3", "deepseek_r1"]))
def test_a_stream_splits_as_the_whole_answer(parts, data, parser):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)] or [""]
    whole = split_reasoning(text, parser)
    assert streamed(chunks, parser) == (whole.reasoning or None, whole.content or None)


def test_deepseek_r1_answers_open_in_reasoning():
    s = split_reasoning("Add them.\n</think>\n\n4", "deepseek_r1")
    assert (s.reasoning, s.content) == ("Add them.\n", "\n\n4")
    assert split_reasoning("still thinking", "deepseek_r1").reasoning == "still thinking"


def test_work_per_delta_is_bounded():
    splitter = StreamingReasoningSplitter()
    splitter.feed("<think>")
    for _ in range(20_000):
        assert splitter.feed("x").reasoning == "x"
        assert len(splitter._pending) < len("</think>")
