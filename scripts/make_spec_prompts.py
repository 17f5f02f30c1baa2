"""Write the speculative-decoding benchmark's prompt sets (benchmarks/data/*.jsonl), from text every
Python 3.11 has (the stdlib's own reference topics and source code), seeded and reproducible:

- grounded.jsonl: answers that copy spans of a 300-1,000-token input, the kind prompt lookup is for:
  repeat a passage, fix the typos injected into one, rename a function in real code, make a small
  change to a list.
- freewrite.jsonl: short prompts whose answers copy nothing.

    python scripts/make_spec_prompts.py
"""

from __future__ import annotations

import difflib
import inspect
import json
import json as json_module
import random
import re
import shlex
import string
import textwrap
from pathlib import Path
from pydoc_data.topics import topics

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
MAX_TOKENS = 256


def words_between(text: str, lo: int, hi: int) -> str:
    """A prefix of `text` of about lo..hi words (~1.3 tokens each), cut at a paragraph end."""
    out, count = [], 0
    for para in text.split("\n\n"):
        n = len(para.split())
        if count + n > hi:
            break
        out.append(para)
        count += n
    return "\n\n".join(out) if count >= lo else " ".join(text.split()[:hi])


def with_typos(text: str, rng: random.Random, rate: float = 0.04) -> str:
    def typo(m: re.Match) -> str:
        w = m.group(0)
        if len(w) < 4 or rng.random() > rate:
            return w
        i = rng.randrange(1, len(w) - 2)
        return w[:i] + w[i + 1] + w[i] + w[i + 2 :]  # swap two letters

    return re.sub(r"[A-Za-z]+", typo, text)


def main() -> None:
    rng = random.Random(0)
    prose = [t for name, t in sorted(topics.items()) if len(t.split()) > 400]
    rng.shuffle(prose)
    code = []
    for module in (difflib, json_module, shlex, string, textwrap):
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not fn.__name__.startswith("_"):
                src = inspect.getsource(fn)
                if 150 <= len(src.split()) <= 600:
                    code.append((fn.__name__, src))
    rng.shuffle(code)
    grounded = []
    for i in range(6):
        grounded.append("Repeat the following text exactly, word for word:\n\n" + words_between(prose[i], 220, 700))
    for i in range(6, 12):
        text = words_between(prose[i], 220, 700)
        grounded.append("Correct the spelling mistakes in the following text and output the corrected text:\n\n"
                        + with_typos(text, rng))
    for name, src in code[:6]:
        grounded.append(f"Rewrite the following Python function with `{name}` renamed to `{name}_v2`. "
                        f"Output only the code.\n\n```python\n{src}```")
    items = [f"{c} {o}" for c, o in zip(["red", "green", "blue", "black", "white"] * 8,
                                         ["box", "cup", "jar", "bag", "tin", "pot", "can", "tray"] * 5)]
    for i in range(2):
        rows = [f"- {items[j]}: {rng.randrange(2, 99)} marbles, shelf {rng.randrange(1, 9)}" for j in range(30)]
        grounded.append("Here is an inventory list:\n\n" + "\n".join(rows)
                        + f"\n\nRepeat the list with every shelf number increased by {i + 1}.")
    free = [f"Write a short story about {t}." for t in
            ("a lighthouse keeper who finds a map", "a robot learning to bake bread", "two rival chess players",
             "a village where it never stops raining", "the last train of the night", "a dragon afraid of heights")]
    free += [f"Explain {t} to a curious twelve-year-old." for t in
             ("why the sky is blue", "how vaccines work", "what a black hole is", "how a compiler works",
              "why we have seasons", "how bees make honey")]
    OUT.mkdir(parents=True, exist_ok=True)
    for name, prompts in (("grounded", grounded), ("freewrite", free)):
        with open(OUT / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"prompt": p, "max_tokens": MAX_TOKENS}) + "\n" for p in prompts)
        print(f"{name}: {len(prompts)} prompts, {sum(len(p.split()) for p in prompts) // len(prompts)} words on average")


if __name__ == "__main__":
    main()
