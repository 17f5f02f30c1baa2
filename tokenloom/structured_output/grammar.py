"""Structured outputs: grammars that constrain sampling, compiled once, off the engine thread, in isolation.

A request asks for one of vLLM's `structured_outputs` kinds (`StructuredOutputsParams`, in sampling_params.py) (a JSON schema, any JSON object, a regex,
a choice among strings, or a grammar in EBNF/GBNF or Lark); OpenAI's `response_format` and tool
calls are mapped onto them by the server. `GrammarCompiler.compile` looks the request's grammar up
by its own text (`cache_key`, before any conversion), so a second request with the same grammar
compiles nothing and gets a copy of the cached matcher (microseconds). On a miss:

1. `limits.check_static`: size, depth and rule count, in pure Python (a 400 naming the limit);
2. the grammar worker, a child process (`worker.py`), converts and compiles it and builds its
   first masks, measuring CPU time, memory and a fresh sequence's first-mask cost; a crash or a
   timeout there fails this request alone and the worker is replaced (`sandbox.py`);
3. the measured costs are held to their limits, and the server compiles the proven llguidance grammar
   on its own low-priority thread with a stack larger than the worker's.

The cache is bounded by the memory its grammars hold, as the worker measured it, not by a count.

Each constrained sequence owns one matcher (`GrammarState`), which fills the row's token bitmask
before sampling, consumes the sampled token after it, and says which tokens are forced next
(jump-forward). A matcher that fails while a request runs (llguidance's `LexerTooComplex`, a step
over its fuel, a mask slower than `max_mask_ms_per_step`) raises `GrammarError`: the request ends
with finish_reason "error" and the error, never "stop" with text the grammar did not produce.

Generated JSON is compact (no whitespace between the tokens of the JSON syntax, as vLLM's
`disable_any_whitespace`): a small model cannot loop on blank lines, and fixed keys and punctuation
become forced tokens that jump-forward appends without a forward each.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from .limits import DEFAULT_LIMITS, GrammarLimits, check_static, exceeds
from .sandbox import GrammarSandbox
from .worker import WORKER_STACK_BYTES, first_line, parser_limits

if TYPE_CHECKING:
    from ..sampling_params import StructuredOutputsParams

logger = logging.getLogger("tokenloom.grammar")

# The server's compile thread: four times the worker's stack, so what compiled there compiles here.
_COMPILE_STACK_BYTES = 4 * WORKER_STACK_BYTES
_MAX_REFUSED = 4096  # digests of refused grammars remembered (32 bytes each)
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it only around our thread's start


class GrammarError(RuntimeError):
    """A grammar failed while its request ran; the request ends with finish_reason "error"."""


SERVER_COPY_FACTOR = 2  # server memory per byte the worker measures for a grammar (see GrammarCompiler)

@dataclass
class CompiledGrammar:
    """A compiled grammar in the cache: the template every sequence copies, and what it cost."""

    matcher: llguidance.LLMatcher
    memory_bytes: int  # resident memory the worker measured for it (what the cache's bound counts)
    compile_seconds: float  # CPU time in the worker
    mask_ms: float  # a fresh sequence's first mask, CPU time in the worker


class GrammarCompiler:
    """Compiles grammars against one tokenizer; thread-safe; an LRU cache bounded in bytes.

    `compile` is called off the engine thread (the server's executor); the engine's `matcher` finds
    the grammar the server compiled on the params themselves (`_compiled`), so it never compiles,
    even if the cache evicted the grammar in between."""

    def __init__(self, tokenizer, vocab_size: int, limits: GrammarLimits = DEFAULT_LIMITS):
        self.limits = limits
        # The tokenizer as JSON, made when a grammar first needs it: held, Qwen2.5's would be 21 MB of str.
        self._tokenizer_json = tokenizer.tokenizer.to_str
        self._eos = list(tokenizer.eos_token_ids)
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future] = {}  # one compile per distinct grammar at a time
        # Grammars the worker refused (crash, timeout, measured limit), by digest: sent again, they are
        # refused at once instead of costing a worker restart each.
        self._refused: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()
        self._sandbox = GrammarSandbox(self._tokenizer_json, vocab_size, self._eos)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile", initializer=_lower_priority)
        self.cache_bytes = 0  # memory held by the cached grammars (as measured)
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and metrics
        self.num_rejected = 0  # grammars refused by a limit, a crash or a timeout of the worker

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:  # ~0.3 s: built on first use, not at start-up
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    @property
    def num_worker_restarts(self) -> int:
        return self._sandbox.num_restarts

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The cached grammar for `params`, compiled on a miss (ValueError naming the limit or the
        field when it cannot be). Blocks for the compile: call it off the engine thread."""
        key = params.cache_key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            else:
                waiting = self._inflight.get(key)
                if waiting is None:
                    mine = self._inflight[key] = Future()
        if entry is None and waiting is not None:
            entry = waiting.result()  # another request is compiling this grammar: share its result
        elif entry is None:
            try:
                entry = self._compile(params)
            except BaseException as exc:
                mine.set_exception(exc)
                raise
            else:
                mine.set_result(entry)
            finally:
                with self._lock:
                    self._inflight.pop(key, None)
        object.__setattr__(params, "_compiled", entry)
        return entry

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh per-sequence state (a copy of the compiled template)."""
        entry = getattr(params, "_compiled", None) or self.compile(params)
        return GrammarState(entry.matcher.deep_copy(), self._vocab_size, self.limits.max_mask_ms_per_step)

    def close(self) -> None:
        self._sandbox.close()
        self._thread.shutdown(wait=False)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind, limits = params.kind, self.limits
        digest = hashlib.sha256(repr(params.cache_key).encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            refused = self._refused.get(digest)
        if refused is not None:
            self.num_rejected += 1
            raise ValueError(refused)
        try:
            check_static(kind, params.spec, limits)
            spec = list(params.spec) if kind == "choice" else params.spec
            try:
                report = self._sandbox.run(kind, spec, limits.worker_limits(), limits.compile_timeout_s)
            except ValueError as e:
                self._refuse(digest, str(e))
            if report.get("error"):
                raise ValueError(f"structured_outputs.{kind}: {report['error']}")
            for value, name, unit in ((report["compile_seconds"], "max_grammar_compile_seconds", " s"),
                                      (report["memory_bytes"], "max_grammar_memory_bytes", " bytes"),
                                      (report["mask_ms"], "max_grammar_mask_ms", " ms")):
                if value > getattr(limits, name):
                    shown = f"{value:.3g}{unit}" if isinstance(value, float) else f"{value}{unit}"
                    self._refuse(digest, str(exceeds(kind, "compiling it measured", shown, name, getattr(limits, name))))
        except ValueError:
            with self._lock:
                self.num_rejected += 1
            raise
        matcher = self._build(report["grammar"])
        # The server's copy holds about twice what the worker measured for the grammar (allocator slack and
        # the server's own first mask: 535 MB counted, +1,141 MB RSS at the bound in
        # benchmarks/reliability.md), so the cache charges it twice and its bound holds for real memory.
        held = SERVER_COPY_FACTOR * report["memory_bytes"] + len(report["grammar"]) + len(params.cache_key[1])
        entry = CompiledGrammar(matcher, held, report["compile_seconds"], report["mask_ms"])
        with self._lock:
            self.num_compiled += 1
            self._cache[params.cache_key] = entry
            self.cache_bytes += entry.memory_bytes
            while self.cache_bytes > limits.max_grammar_cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self.cache_bytes -= evicted.memory_bytes
        return entry

    def _refuse(self, digest: bytes, message: str) -> None:
        with self._lock:
            self._refused[digest] = message
            while len(self._refused) > _MAX_REFUSED:
                self._refused.popitem(last=False)
        raise ValueError(message)

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        """The server's copy of a grammar the worker compiled: on our compile thread (larger stack, low
        priority), with its first mask built so the lexer is ready before any sequence copies it."""
        def build() -> llguidance.LLMatcher:
            matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0,
                                           limits=parser_limits(self.limits.worker_limits()))
            if not matcher.is_error():
                mask = torch.zeros(bitmask_words(self._vocab_size), dtype=torch.int32)
                matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            if matcher.is_error():  # the worker compiled the same text: not expected
                raise ValueError(f"structured_outputs: {first_line(matcher.get_error())}")
            return matcher

        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(_COMPILE_STACK_BYTES)
            try:
                future = self._thread.submit(build)
            finally:
                threading.stack_size(previous)
        return future.result()


def _lower_priority() -> None:
    """The compile thread yields the cores to the engine thread (Linux: nice is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, max_mask_ms: float = DEFAULT_LIMITS.max_mask_ms_per_step):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.max_mask_seconds = max_mask_ms / 1000
        self.failed: str | None = None  # once a grammar fails, it stays failed

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32 words, bit i of word w = token 32w+i);
        GrammarError when the matcher failed or took longer than its per-step bound."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.numel() == bitmask_words(self.vocab_size)
        if self.failed is not None:
            raise GrammarError(self.failed)
        start = time.thread_time()  # CPU time: what this mask cost, not what the machine's load added
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        took = time.thread_time() - start
        if self.matcher.is_error():
            self._fail(f"the grammar failed: {first_line(self.matcher.get_error())}")
        if not bool(row.any()):  # e.g. a character whose UTF-8 bytes no token has (SmolLM2 lacks 0xF1)
            self._fail("no token of this model's vocabulary can continue the grammar")
        if took > self.max_mask_seconds:
            self._fail(f"computing the grammar's token mask took {took * 1000:.0f} ms, over max_mask_ms_per_step "
                       f"({self.max_mask_seconds * 1000:g})")

    def accept(self, token_id: int) -> bool:
        """Consume a token (True); GrammarError when the matcher fails on it (the sampler only offers
        tokens the grammar allows, so this is llguidance failing, not the model breaking the grammar)."""
        if self.failed is not None:
            raise GrammarError(self.failed)
        consumed = self.matcher.consume_token(token_id)
        if not consumed and self.matcher.is_error():
            self._fail(f"the grammar failed: {first_line(self.matcher.get_error())}")
        return consumed

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar admits as the only continuation (jump-forward); [] when there is a choice.
        llguidance tokenizes the forced bytes itself, and where they end inside a multi-byte character
        its tokens can be ones the grammar then refuses (found by fuzzing non-ASCII choices: a 500): only
        the prefix the matcher validates is forced, the rest is sampled as usual."""
        tokens = self.matcher.compute_ff_tokens()
        return tokens[: self.matcher.validate_tokens(tokens)] if tokens else tokens

    def lookahead(self, drafts: list[int]) -> list[torch.Tensor]:
        """The masks after each prefix of speculative `drafts` (d0; d0 d1; ...): what a step verifying
        them needs past its first row. Only the drafts the matcher validates are consumed (a refused
        token would leave it in its error state for good), each mask is checked as `fill_bitmask` checks
        one, and everything is rolled back: a draft whose mask would fail is dropped with the ones after
        it, and the request's own state is untouched (its first row fails, or not, as without drafts)."""
        if self.failed is not None or not drafts:
            return []
        valid = drafts[: self.matcher.validate_tokens(drafts)]
        masks: list[torch.Tensor] = []
        consumed = 0
        try:
            for token in valid:
                if not self.matcher.consume_token(token):
                    break
                consumed += 1
                row = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
                start = time.thread_time()
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
                if (self.matcher.is_error() or not bool(row.any())
                        or time.thread_time() - start > self.max_mask_seconds):
                    break
                masks.append(row)
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return masks

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.failed or (self.matcher.get_error() if self.matcher.is_error() else None)

    def _fail(self, why: str) -> None:
        self.failed = f"structured_outputs: {why}"
        raise GrammarError(self.failed)


class FixedMask:
    """A mask computed ahead (`GrammarState.lookahead`), handed to the sampler as a `TokenMask`."""

    def __init__(self, words: torch.Tensor):
        self.words = words

    def fill_bitmask(self, row: torch.Tensor) -> None:
        row.copy_(self.words)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size]: True where a token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
