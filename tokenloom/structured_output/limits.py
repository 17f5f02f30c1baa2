"""Limits on the grammars a request may bring, and the checks that need no compiler.

Each limit has vLLM's `max_*` style of name, and a request that exceeds one gets a ValueError that
names it (the server's 400). Two kinds of checks:

- Static, here, in pure Python and without recursion (a hostile grammar must not be able to make the
  check itself fail): the size of the grammar's text, its depth (nesting of a JSON schema counted
  through its local `$ref`s; nesting of a regex's groups; the depth a depth-first walk of a
  grammar's rule references reaches from its start rule, which is how deep a recursive compiler
  goes) and its rule count (rules of a grammar, subschemas of a JSON schema, options of a choice).
  A chain of 3,000 rules or 1,200 `$ref`s, which overflows the native compiler's stack, is refused
  here by its depth before any compiler sees it.
- Measured, by the grammar worker (`worker.py`): compile time (CPU seconds), the memory the
  compiled grammar holds, and the first token mask of a fresh sequence, which every sequence pays on
  the engine thread. No syntactic rule predicts those (`(a{2000}){1000}` is 16 bytes), so they are
  measured where a runaway costs nothing.

Two more bound the running side: llguidance's per-step fuel (`step_lexer_fuel`, `step_max_items`),
which puts a matcher whose next mask would cost more into an error state, and `max_mask_ms_per_step`,
which fails a request whose mask computation took longer than that in one step anyway.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GrammarLimits:
    max_grammar_bytes: int = 128 * 1024  # the grammar's text: schema (compact JSON), regex, grammar, choices
    max_grammar_depth: int = 128  # JSON nesting (through $refs), regex group nesting, rule-reference depth
    max_grammar_rules: int = 2000  # grammar rules, JSON subschemas, choice options
    max_grammar_compile_seconds: float = 5.0  # CPU time to convert, compile and build the lexer
    max_grammar_memory_bytes: int = 64 << 20  # resident memory one compiled grammar may hold
    max_grammar_mask_ms: float = 10.0  # CPU time of a fresh sequence's first token mask (paid per sequence)
    max_mask_ms_per_step: float = 100.0  # a running sequence's mask that took longer fails its request
    max_grammar_cache_bytes: int = 512 << 20  # all compiled grammars kept for reuse, by measured memory
    # llguidance's own per-step bounds (LLParserLimits); these are its defaults, pinned here so an
    # upgrade cannot loosen them silently. ~14 ms / ~2.5 ms of work at most per mask.
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000

    def worker_limits(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k in ("step_lexer_fuel", "step_max_items", "max_lexer_states")}

    @property
    def compile_timeout_s(self) -> float:
        """Wall-clock bound on a worker job: the worker runs at a low priority, so under a busy engine a
        compile within `max_grammar_compile_seconds` of CPU can take several times that to finish."""
        return 30.0 + 10 * self.max_grammar_compile_seconds


DEFAULT_LIMITS = GrammarLimits()


def exceeds(kind: str, what: str, value, limit_name: str, limit) -> ValueError:
    return ValueError(f"structured_outputs.{kind}: {what} {value} exceeds {limit_name} ({limit})")


def check_static(kind: str, spec, limits: GrammarLimits) -> None:
    """Size, depth and rule count of one structured-output spec (the text of a schema, regex, grammar,
    or the tuple of choices); ValueError naming the limit it exceeds."""
    if kind == "json_object":
        return
    size = sum(len(c.encode()) for c in spec) if kind == "choice" else len(spec.encode())
    if size > limits.max_grammar_bytes:
        raise exceeds(kind, "a grammar of", f"{size} bytes", "max_grammar_bytes", limits.max_grammar_bytes)
    if kind == "choice":
        rules, depth = len(spec), 1
    elif kind == "regex":
        rules, depth = 1, regex_depth(spec)
    elif kind == "json":
        rules, depth = schema_shape(json.loads(spec))
    else:
        rules, depth = grammar_shape(spec)
    if rules > limits.max_grammar_rules:
        raise exceeds(kind, "a rule count of", rules, "max_grammar_rules", limits.max_grammar_rules)
    if depth > limits.max_grammar_depth:
        raise exceeds(kind, "a depth of", depth, "max_grammar_depth", limits.max_grammar_depth)


# -- JSON --------------------------------------------------------------------------------------------


def json_text_depth(text: str) -> int:
    """Nesting of JSON text, brackets outside strings (before parsing it: `json.loads` recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def json_depth(value) -> int:
    """Nesting of a parsed JSON value (containers), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def schema_shape(schema) -> tuple[int, int]:
    """(subschemas, depth) of a JSON schema: depth counts nesting and each local `$ref` followed (a
    definition is entered once, as a compiler that caches definitions does)."""
    subschemas, deepest = 0, 0
    entered: set[str] = set()
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
            continue
        if not isinstance(node, dict):
            continue
        subschemas += 1
        deepest = max(deepest, depth)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in entered:
            entered.add(ref)
            target = _resolve_pointer(schema, ref)
            if target is not None:
                stack.append((target, depth + 1))
        stack.extend((child, depth + 1) for key, child in node.items()
                     if key not in ("$defs", "definitions") and isinstance(child, dict | list))
        for key in ("$defs", "definitions"):  # definitions count where they are used, not where they sit
            defs = node.get(key)
            if isinstance(defs, dict):
                subschemas += sum(1 for d in defs.values() if not isinstance(d, dict))
    # Definitions never referenced still have to be compiled; count them once each.
    used = {ref.rsplit("/", 1)[-1] for ref in entered}
    for defs in _all_definitions(schema):
        subschemas += sum(_count_dicts(body) for name, body in defs.items() if isinstance(body, dict) and name not in used)
    return subschemas, deepest


def _resolve_pointer(root, ref: str):
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _all_definitions(schema) -> Iterator[dict]:
    if isinstance(schema, dict):
        for key in ("$defs", "definitions"):
            if isinstance(schema.get(key), dict):
                yield schema[key]


def _count_dicts(value) -> int:
    count, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            count += 1
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


# -- regex -------------------------------------------------------------------------------------------


def regex_depth(regex: str) -> int:
    """Group nesting of a regex (escapes and character classes skipped)."""
    depth = deepest = 0
    i, in_class = 0, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if regex[i + 1 : i + 2] == "]":  # a leading ] is a literal
                i += 1
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
        i += 1
    return deepest + 1


# -- EBNF / GBNF / Lark ------------------------------------------------------------------------------

# A rule or terminal definition at the start of a line: `name ::=` (GBNF), `name:` / `?name:` /
# `NAME.2:` (Lark).
_RULE_DEF = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(::=|:)", re.MULTILINE)
# What cannot hold a rule reference: string literals, regexes, character classes, comments.
_NOT_NAMES = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|#[^\n]*|/(?:\\.|[^/\\\n])+/[a-z]*'
                        r"|\[(?:\\.|[^\]\\\n])*\]")
_NAME = re.compile(r"[A-Za-z_][\w-]*")


def grammar_shape(text: str) -> tuple[int, int]:
    """(rules, depth) of an EBNF/GBNF/Lark grammar: depth is how deep a depth-first walk of the rule
    references goes from the start rule (the first rule, or `start` / `root`)."""
    defs = list(_RULE_DEF.finditer(text))
    bodies: dict[str, str] = {}
    for k, m in enumerate(defs):
        end = defs[k + 1].start() if k + 1 < len(defs) else len(text)
        bodies[m.group(1)] = bodies.get(m.group(1), "") + " " + text[m.end() : end]
    if not bodies:
        return 0, 0
    refs = {name: [r for r in dict.fromkeys(_NAME.findall(_NOT_NAMES.sub(" ", body))) if r in bodies]
            for name, body in bodies.items()}
    start = next((s for s in ("start", "root") if s in bodies), defs[0].group(1))
    deepest, seen = 1, {start}
    stack = [iter(refs[start])]
    while stack:
        nxt = next(stack[-1], None)
        if nxt is None:
            stack.pop()
        elif nxt not in seen:
            seen.add(nxt)
            stack.append(iter(refs[nxt]))
            deepest = max(deepest, len(stack))
    return len(bodies), deepest
