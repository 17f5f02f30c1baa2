"""Hostile grammar shapes shared by the grammar tests, the fuzzing and the reliability benchmark."""

from __future__ import annotations


def ref_chain(n: int) -> dict:
    """A JSON schema whose `$ref`s chain n definitions deep (1,200 overflowed the native compiler)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_properties(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_any_of(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"anyOf": [schema, {"type": "string"}]}
    return schema


def lark_chain(n: int) -> str:
    """A Lark grammar of n rules, each referring to the next (3,000 overflowed the native compiler)."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "x"'])


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0", *(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(n)), f'r{n} ::= "z"'])


def gbnf_wide(n: int) -> str:
    """A GBNF grammar of n + 1 rules, all alternatives of the root: many rules, shallow."""
    return "\n".join(["root ::= " + " | ".join(f"r{i}" for i in range(n)),
                      *(f'r{i} ::= "w{i}" [0-9]' for i in range(n))])


def nested_repeat_regex(*counts: int) -> str:
    """((a{c0}){c1}){c2}...: 16 bytes of text, hundreds of MB of lexer."""
    regex = "a"
    for c in counts:
        regex = f"({regex}){{{c}}}"
    return regex
