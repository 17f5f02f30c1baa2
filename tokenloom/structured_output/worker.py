"""The grammar worker: a child process that turns untrusted grammars into llguidance grammars.

Everything a client's grammar text can make expensive or fatal happens here first, in a process of
its own, so that nothing it does reaches the server: the conversion to llguidance's form (the
GBNF -> Lark conversion is Python and can take seconds or hit the recursion limit), the native
compile (a chain of a few thousand rules or `$ref`s overflows the stack: signal 11, no exception),
and the first token masks (a regex like `(a{2000}){1000}` builds a lexer of ~170 MB there). The
worker reports the llguidance grammar, the CPU time it took, the memory it held and how long a
fresh sequence's first mask takes; `GrammarCompiler` then applies the limits and compiles the
proven grammar once more in the server, where the same work can no longer surprise it.

Why a process rather than a thread with a large stack: a stack overflow is only one way native code
dies (an abort, an out-of-memory kill or an endless loop in a native call cannot be caught or
interrupted in a thread either); a process can be killed on a timeout and restarted, and it is
started with a lower CPU priority so that a long compile leaves the cores to the engine.

This file imports only the standard library and llguidance (not the tokenloom package, which
loads torch): the worker starts in ~0.3 s and holds little besides the tokenizer.

Protocol (over the child's stdin/stdout): frames of a 4-byte big-endian length and a JSON body.
The first frame sets the tokenizer; each later one is a job `{"kind", "spec", "limits"}` answered
by `{"grammar", "error", "compile_seconds", "mask_ms", "memory_bytes"}`.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import threading
import time

import llguidance

# Compact JSON (no whitespace between the tokens of the JSON syntax, as vLLM's
# `disable_any_whitespace`): a small model cannot loop on blank lines, and fixed keys and
# punctuation become forced tokens.
JSON_OPTIONS = {"whitespace_flexible": False}
# The worker's compile thread gets half the stack of a server thread (8 MiB on Linux), so a grammar
# that compiles here uses at most half of what the server's threads have.
WORKER_STACK_BYTES = 4 << 20


def llguidance_grammar(kind: str, spec) -> str:
    """The llguidance grammar for one of vLLM's structured-output kinds; ValueError if it cannot be built."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(spec))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)
    raise ValueError(f"unknown grammar kind {kind!r}")


def parser_limits(limits: dict) -> llguidance.LLParserLimits:
    """llguidance's own per-step bounds (its "fuel"): a mask step that would exceed them puts the
    matcher in an error state instead of running on; error messages without the parser's state."""
    return llguidance.LLParserLimits(step_lexer_fuel=limits["step_lexer_fuel"], step_max_items=limits["step_max_items"],
                                     max_lexer_states=limits["max_lexer_states"], verbose_errors=False)


def first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


# -- the child ------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Give freed heap back to the OS so the next job's resident-memory delta is its own."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Mask:
    """A token bitmask buffer without torch."""

    def __init__(self, vocab_size: int):
        self.size = (vocab_size + 31) // 32 * 4
        self.buf = ctypes.create_string_buffer(self.size)

    def fill(self, matcher) -> None:
        matcher.unsafe_compute_mask_ptr(ctypes.addressof(self.buf), self.size)


def _run_job(tokenizer, vocab_size: int, job: dict) -> dict:
    _trim()
    before = _rss_bytes()
    start = time.thread_time()
    try:
        grammar = llguidance_grammar(job["kind"], job["spec"])
    except (ValueError, RecursionError) as e:
        return {"error": first_line(str(e)) if isinstance(e, ValueError) else "nested too deeply to convert"}
    mask = _Mask(vocab_size)
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits(job["limits"]))
    if not template.is_error():
        mask.fill(template)  # the first mask builds the lexer: part of compiling, measured with it
    compile_seconds = time.thread_time() - start
    if template.is_error():
        return {"error": first_line(template.get_error())}
    # What each sequence pays on the engine thread: the first mask of a fresh copy.
    copy = template.deep_copy()
    start = time.thread_time()
    mask.fill(copy)
    mask_ms = (time.thread_time() - start) * 1000
    if copy.is_error():
        return {"error": first_line(copy.get_error())}
    memory = max(0, _rss_bytes() - before)
    return {"grammar": grammar, "compile_seconds": compile_seconds, "mask_ms": mask_ms, "memory_bytes": memory}


def _read_frame(stream) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    return json.loads(stream.read(size))


def write_frame(stream, obj: dict) -> None:
    body = json.dumps(obj).encode()
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def _serve() -> None:
    os.nice(10)  # a compile competes with the engine for two cores: let the engine win
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    setup = _read_frame(stdin)
    if setup is None:
        return
    tokenizer = llguidance.LLTokenizer(setup["tokenizer_json"], n_vocab=setup["vocab_size"], eos_token=setup["eos"])
    vocab_size = setup["vocab_size"]
    write_frame(stdout, {"ready": True})
    threading.stack_size(WORKER_STACK_BYTES)
    while (job := _read_frame(stdin)) is not None:
        result: dict = {}

        def work(job=job, result=result) -> None:
            result.update(_run_job(tokenizer, vocab_size, job))

        thread = threading.Thread(target=work, name="grammar-job")
        thread.start()
        thread.join()
        write_frame(stdout, result or {"error": "the grammar worker failed on this grammar"})


if __name__ == "__main__":
    _serve()
