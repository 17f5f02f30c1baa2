"""Tokenizer, chat template and incremental detokenizer.

The tokenizer is built with the `tokenizers` library from a GGUF file's metadata (GPT-2 style
byte-level BPE from tokens, merges and the pre-tokenizer's name; or SentencePiece-style BPE over "▁"
words with byte fallback, its merges ranked by the tokens' scores, as Gemma's) or loaded from a
`tokenizer.json`. The chat template
comes from the same metadata (or `tokenizer_config.json`) and is rendered with jinja2 in a sandbox,
as Hugging Face renders it. `IncrementalDetokenizer` turns a growing list of token ids into text
deltas that never split a UTF-8 character.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream

# Tokens that end a chat turn (besides the file's own EOS): Qwen's, Llama 3's (end of turn, end of a
# tool-calling message) and Gemma's. Generation stops at any of them, as the models' own configs say.
TURN_ENDS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")
_GGUF_NORMAL = 1  # tokenizer.ggml.token_type values
_GGUF_CONTROL = 3  # control (special) tokens
_GGUF_USER_DEFINED = 4
_GGUF_BYTE = 6  # <0x41>: SentencePiece's byte-fallback pieces

# Pre-tokenizer split rules by GGUF `tokenizer.ggml.pre` (each the regex the model's own tokenizer.json
# uses; ByteLevel then maps bytes without splitting again). Not listed: GPT-2's own regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")}
_DIGIT_SPLIT = ("smollm", "starcoder")  # single digits, then GPT-2's regex


class TokenizerWrapper:
    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        max_token_chars: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = _compile_template(chat_template) if chat_template else None
        self._max_token_chars = max_token_chars

    @property
    def max_token_chars(self) -> int:
        """The longest token's text in characters (a GGUF's is known from its token list; asking the
        tokenizer for every token takes a large vocabulary's build time again)."""
        if self._max_token_chars is None:
            tok = self.tokenizer
            self._max_token_chars = max(
                (len(tok.id_to_token(i) or "") for i in range(tok.get_vocab_size(with_added_tokens=True))), default=0)
        return self._max_token_chars

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str) -> TokenizerWrapper:
        from .loader import gguf_field, read_gguf_metadata

        reader = read_gguf_metadata(path)
        kind = gguf_field(reader, "tokenizer.ggml.model")
        tokens = list(gguf_field(reader, "tokenizer.ggml.tokens", []))
        types = list(gguf_field(reader, "tokenizer.ggml.token_type", [_GGUF_NORMAL] * len(tokens)))
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, list(gguf_field(reader, "tokenizer.ggml.merges")),
                                  gguf_field(reader, "tokenizer.ggml.pre"))
        elif kind == "llama":
            tok = _sentencepiece_bpe(tokens, list(gguf_field(reader, "tokenizer.ggml.scores")), types,
                                     unk=int(gguf_field(reader, "tokenizer.ggml.unknown_token_id", 0)),
                                     space_prefix=bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True)))
        else:
            raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                             "SentencePiece BPE 'llama' are)")
        # Control tokens are special (skipped when decoding); user-defined ones (Gemma's whitespace runs,
        # Qwen's <tool_call>) are whole tokens that decode as text, as in the models' own tokenizer.json.
        tok.add_tokens([AddedToken(t, special=ty == _GGUF_CONTROL, normalized=False)
                        for t, ty in zip(tokens, types, strict=True) if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)])
        eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
        bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos_ids = [int(eos)] if eos is not None else []
        # The end-of-text token also ends generation for chat models trained with a separate turn end.
        eos_ids += [tokens.index(t) for t in TURN_ENDS if t in tokens]
        return cls(
            tok,
            eos_ids,
            bos_token_id=int(bos) if bos is not None else None,
            chat_template=gguf_field(reader, "tokenizer.chat_template"),
            add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
            max_token_chars=max(map(len, tokens), default=0),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> TokenizerWrapper:
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg: dict = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if value else None

        eos = [i for i in (token_id("eos_token"),) if i is not None]
        eos += [i for t in TURN_ENDS if (i := tok.token_to_id(t)) is not None]
        eos += _generation_config_eos(path)
        return cls(tok, eos, bos_token_id=token_id("bos_token"), chat_template=cfg.get("chat_template"))

    # -- use -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token's text as the OpenAI API shows it in logprobs (bytes decoded, not 'Ġ' form)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_kwargs: dict | None = None) -> str:
        """`template_kwargs`: further variables for the template (e.g. Qwen3's `enable_thinking`), checked
        by the caller; they never replace the ones set here."""
        if self._template is None:
            raise ValueError("messages: this model has no chat template; use a completion prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be an object with a 'role'")
        special = self.tokenizer.id_to_token
        return self._template.render(
            **(template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=special(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=special(self.eos_token_ids[0]) if self.eos_token_ids else "",
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a partial UTF-8 character stays partial): byte-level BPE tokens
        map back through GPT-2's byte alphabet; added/special tokens are their UTF-8 text."""
        decoder = self.__dict__.get("_byte_decoder")
        if decoder is None:  # GPT-2's bytes_to_unicode, inverted
            printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
            extra = [b for b in range(256) if b not in printable]
            decoder = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
            self._byte_decoder = decoder
            self._added_ids = set(self.tokenizer.get_added_tokens_decoder())
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids or any(c not in decoder for c in piece):
            return piece.encode("utf-8")
        return bytes(decoder[c] for c in piece)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    """GPT-2 style: text split by the model's regex, bytes mapped to printable characters, BPE merges."""
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk: int,
                       space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE (llama.cpp's "llama" tokenizer model): spaces become "▁", pairs merge best score
    first, and a character outside the vocabulary falls back to its UTF-8 bytes (<0xNN> pieces). The
    merges are every split of a vocabulary piece into two vocabulary pieces, ranked by the piece's
    score (as Hugging Face's converter derives them)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = [(score, i, t) for i, (t, score, ty) in enumerate(zip(tokens, scores, types, strict=True))
                 if ty == _GGUF_NORMAL and len(t) > 1]
    merges = []
    for score, _, t in sorted(mergeable, key=lambda m: -m[0]):  # stable: ties keep the vocabulary order
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        merges += sorted(splits, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if space_prefix else replace
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tok


def same_tokenizer(a: TokenizerWrapper, b: TokenizerWrapper) -> bool:
    """Do the two map every token string to the same id (a draft model's ids must mean the target's)?"""
    return a.vocab_size == b.vocab_size and a.tokenizer.get_vocab(with_added_tokens=True) == b.tokenizer.get_vocab(
        with_added_tokens=True)


def _generation_config_eos(path: str) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list: Llama 3.x's 128001, 128008, 128009)."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = value if isinstance(value, list) else [value]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


# Tokenizers built in this process, by their files as they were (the least recently used of more than
# KEPT_TOKENIZERS dropped): a model unloaded and loaded again (a multi-model server's swap) finds its
# tokenizer built, where building a large vocabulary's takes 0.1-3 s (Gemma's SentencePiece merges, derived
# here, the longest). A wrapper is never changed once built (a tool-bound view is a copy), so the engines
# of successive loads share it. They stay in the process's fixed memory: 10-70 MiB each.
KEPT_TOKENIZERS = 8
_built: collections.OrderedDict[tuple, TokenizerWrapper] = collections.OrderedDict()
_built_lock = threading.Lock()


def load_tokenizer(model_path: str) -> TokenizerWrapper:
    files = ([os.path.join(model_path, f) for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")]
             if os.path.isdir(model_path) else [model_path])
    key = tuple(_identity(f) for f in files)
    with _built_lock:
        if (tokenizer := _built.get(key)) is not None:
            _built.move_to_end(key)
            return tokenizer
    tokenizer = (TokenizerWrapper.from_hf_dir if os.path.isdir(model_path) else TokenizerWrapper.from_gguf)(model_path)
    with _built_lock:
        _built[key] = tokenizer
        while len(_built) > KEPT_TOKENIZERS:
            _built.popitem(last=False)
    return tokenizer


def _identity(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return (path, None)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str):
        raise ValueError(f"messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Text deltas for a growing sequence of ids; a delta never ends inside a UTF-8 character."""

    def __init__(self, tokenizer: TokenizerWrapper, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer.tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""
