"""Structured outputs: grammars that constrain sampling (`StructuredOutputsParams`, the request's side,
is in sampling_params.py, importing neither llguidance nor torch).

- `grammar.py`: `GrammarCompiler` (compiled once, off the engine thread, cached by memory), the
  per-sequence `GrammarState`, the token bitmasks;
- `limits.py`: the limits a grammar is held to, and the checks that need no compiler;
- `worker.py` / `sandbox.py`: the child process that converts and compiles untrusted grammars first,
  and the server's side of it.

Nothing is imported here: `limits.py` is pure Python, the rest loads llguidance (and torch).
"""
