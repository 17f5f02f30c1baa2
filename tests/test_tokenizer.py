"""The tokenizer built from the GGUF metadata, the chat template, and incremental detokenization."""

from __future__ import annotations

import pytest

from tokenloom.model.tokenizer import IncrementalDetokenizer

TEXTS = ["Hello world 12345 Café 東京\n\n  x", "emoji 🎉🚀 and ünïcödé", "def f(x):\n\treturn x**2  # ok"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_split_one_by_one(tokenizer):
    # SmolLM2's pre-tokenizer ("smollm") splits numbers into single digits.
    assert len(tokenizer.encode("12345")) == 5


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_end|>") == [2]
    assert set(tokenizer.eos_token_ids) == {0, 2}


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_emits_broken_utf8(tokenizer, text):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.step(t) for t in tokenizer.encode(text)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # A 4-byte emoji spans several byte-level tokens: some steps must hold text back.
    if "🎉" in text:
        assert "" in pieces


def test_chat_template_renders_with_default_system_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template([{"content": "no role"}])


def test_an_hf_directory_stops_at_generation_config_eos_ids(tmp_path, tokenizer):
    """Llama 3.x lists its turn ends in generation_config.json (128001, 128008, 128009): each one stops."""
    from tokenloom.model.tokenizer import TokenizerWrapper

    (tmp_path / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 11, true, -1, "x"]}')
    wrapper = TokenizerWrapper.from_hf_dir(str(tmp_path))
    im_end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert {im_end, 7, 11} <= set(wrapper.eos_token_ids) and -1 not in wrapper.eos_token_ids
    assert True not in [i for i in wrapper.eos_token_ids if isinstance(i, bool)]
    (tmp_path / "generation_config.json").write_text("[1, 2]")  # valid JSON, not an object: ignored
    assert 7 not in TokenizerWrapper.from_hf_dir(str(tmp_path)).eos_token_ids


def test_the_longest_token_read_from_the_gguf_list_is_the_tokenizers_own(tokenizer):
    # The server bounds a prompt's characters by it; the GGUF's list gives it without a pass over the
    # built tokenizer (which costs a large vocabulary's build time again on every model load).
    from tokenloom.model.tokenizer import TokenizerWrapper

    asked = TokenizerWrapper(tokenizer.tokenizer, tokenizer.eos_token_ids)  # no list: asks every token
    assert tokenizer.max_token_chars == asked.max_token_chars > 1
