"""The cascade's calibration set (issue 55): small Python problems in HumanEval's format, NOT HumanEval.

Each problem is a function signature and docstring (with an example) for the model to complete, and a
`check(candidate)` of asserts whose expected values come from the reference solution here. Templates
(arithmetic, strings, lists, dicts) are instantiated with different names and constants, so the set
spans tasks a 0.5B coder gets right and ones it gets wrong. Deterministic (seeded). Each problem names
its template (`group`): calibration's folds keep a template's variants together, so the probe is
scored on templates it was not fitted to.

    python benchmarks/cascade/make_dev.py            # writes benchmarks/cascade/dev.jsonl
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from pathlib import Path

OUT = Path(__file__).with_name("dev.jsonl")


def _sum_multiples(a, b):
    return lambda n: sum(i for i in range(n) if i % a == 0 or i % b == 0)


def _rle(s):
    out, i = [], 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(f"{s[i]}{j - i}")
        i = j
    return "".join(out)


def _caesar(k):
    return lambda s: "".join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)


def _collatz(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _second_largest(xs):
    u = sorted(set(xs))
    return u[-2] if len(u) > 1 else None


def _chunks(k):
    return lambda xs: [xs[i:i + k] for i in range(0, len(xs), k)]


def _rotate(k):
    return lambda xs: xs[-(k % len(xs)):] + xs[:-(k % len(xs))] if xs else []


def _fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _to_base(base):
    def convert(n):
        digits = ""
        while n:
            digits = str(n % base) + digits
            n //= base
        return digits or "0"
    return convert


def _is_palindrome(s):
    t = [c.lower() for c in s if c.isalnum()]
    return t == t[::-1]


def _is_prime(n):
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _top_word(s):
    counts = Counter(s.split())
    best = max(counts.values())
    return min(w for w, c in counts.items() if c == best)


# (name, signature, docstring, reference factory(params) -> fn, params choices, test inputs (as arg tuples))
TEMPLATES = [
    ("sum_multiples", "n: int", "Return the sum of all non-negative integers below n divisible by {a} or {b}.",
     lambda p: _sum_multiples(p["a"], p["b"]), {"a": [2, 3, 5], "b": [7, 11, 4]}, [(10,), (1,), (50,), (100,)]),
    ("count_char", "s: str", "Return how many times the character '{c}' occurs in s, ignoring case.",
     lambda p: (lambda s: s.lower().count(p["c"])), {"c": list("aeiostnrl")},
     [("Banana",), ("",), ("Mississippi Oasis",), ("TATTOO tea",)]),
    ("reverse_words", "s: str", "Return s with the order of its space-separated words reversed, joined by one space.",
     lambda p: (lambda s: " ".join(reversed(s.split()))), {}, [("hello big world",), ("one",), ("a b  c",)]),
    ("greater_than", "xs: list", "Return the elements of xs greater than {t}, in their original order.",
     lambda p: (lambda xs: [x for x in xs if x > p["t"]]), {"t": [0, 3, 10, -2, 5, 7, 100, 1]},
     [([1, 5, 12, -3, 3],), ([],), ([10, 11, 2, 40],)]),
    ("second_largest", "xs: list", "Return the second largest distinct value in xs, or None if there is none.",
     lambda p: _second_largest, {}, [([3, 1, 4, 4],), ([7],), ([5, 5, 5],), ([-1, -2, -3],)]),
    ("running_sum", "xs: list", "Return the running sums of xs: element i is the sum of xs[0..i].",
     lambda p: (lambda xs: [sum(xs[:i + 1]) for i in range(len(xs))]), {}, [([1, 2, 3],), ([],), ([5, -5, 2],)]),
    ("dedupe", "xs: list", "Return xs without repeated elements, keeping the first occurrence of each.",
     lambda p: (lambda xs: list(dict.fromkeys(xs))), {}, [([1, 2, 1, 3, 2],), ([],), (["a", "b", "a"],)]),
    ("rotate", "xs: list", "Return xs rotated right by {k} positions (the last {k} elements move to the front).",
     lambda p: _rotate(p["k"]), {"k": [1, 2, 3, 5, 4, 7]}, [([1, 2, 3, 4, 5],), ([],), ([9, 8],)]),
    ("chunk", "xs: list", "Split xs into consecutive chunks of {k} elements; the last chunk may be shorter.",
     lambda p: _chunks(p["k"]), {"k": [2, 3, 4, 5, 6]}, [([1, 2, 3, 4, 5, 6, 7],), ([],), ([1],)]),
    ("digit_sum", "n: int", "Return the sum of the decimal digits of the non-negative integer n.",
     lambda p: (lambda n: sum(map(int, str(n)))), {}, [(0,), (1234,), (99999,)]),
    ("is_prime", "n: int", "Return True if n is a prime number, else False.",
     lambda p: _is_prime, {}, [(1,), (2,), (15,), (97,), (91,)]),
    ("fib_mod", "n: int", "Return the n-th Fibonacci number (fib(0) = 0, fib(1) = 1) modulo {m}.",
     lambda p: (lambda n: _fib(n) % p["m"]),
     {"m": [10, 7, 1000, 13, 97]}, [(0,), (1,), (10,), (15,)]),
    ("collatz_steps", "n: int", "Return how many Collatz steps (n -> n/2 if even, else 3n+1) take n to 1.",
     lambda p: _collatz, {}, [(1,), (6,), (27,)]),
    ("caesar", "s: str", ("Shift every lowercase letter of s forward by {k} in the alphabet (wrapping z to a); "
      "leave other characters unchanged."), lambda p: _caesar(p["k"]), {"k": [1, 3, 13, 25, 5, 7]},
     [("abc xyz",), ("Hello, World!",), ("",)]),
    ("is_palindrome", "s: str", ("Return True if s reads the same backwards, ignoring case and non-alphanumeric "
      "characters."), lambda p: _is_palindrome, {},
     [("A man, a plan, a canal: Panama",), ("abc",), ("",), ("No lemon, no melon",)]),
    ("run_length", "s: str", ("Return the run-length encoding of s: each run of one character as the character "
      "followed by the run's length."), lambda p: _rle, {}, [("aaabcc",), ("",), ("abc",), ("zzzzzz",)]),
    ("long_words", "s: str", "Return how many space-separated words of s have more than {k} characters.",
     lambda p: (lambda s: sum(len(w) > p["k"] for w in s.split())), {"k": [2, 3, 5, 4, 6]},
     [("the quick brown fox jumps",), ("",), ("extraordinary a bb ccc",)]),
    ("top_word", "s: str", ("Return the most frequent space-separated word in s; on a tie, the alphabetically "
      "smallest."), lambda p: _top_word, {}, [("b a b a c",), ("x",), ("dog cat dog bird cat dog",)]),
    ("invert", "d: dict", "Return a dict mapping each value of d to its key (the values are distinct).",
     lambda p: (lambda d: {v: k for k, v in d.items()}), {}, [({"a": 1, "b": 2},), ({},)]),
    ("scale_clip", "xs: list", "Multiply each element of xs by {f} and clip the result to at most {c}.",
     lambda p: (lambda xs: [min(x * p["f"], p["c"]) for x in xs]), {"f": [2, 3, 4], "c": [10, 5, 20]},
     [([1, 2, 3, 4],), ([],), ([-5, 6],)]),
    ("every_kth_upper", "s: str", "Return s with every {k}-th character (counting from 1) made uppercase.",
     lambda p: (lambda s: "".join(c.upper() if (i + 1) % p["k"] == 0 else c for i, c in enumerate(s))),
     {"k": [2, 3, 4, 5]}, [("abcdef",), ("",), ("hello world",)]),
    ("gcd_list", "xs: list", "Return the greatest common divisor of the positive integers in xs.",
     lambda p: (lambda xs: math.gcd(*xs)), {}, [([12, 18, 24],), ([7],), ([9, 28],)]),
    ("power_sum", "n: int", "Return the sum of i**{e} for i from 1 to n inclusive.",
     lambda p: (lambda n: sum(i ** p["e"] for i in range(1, n + 1))), {"e": [1, 2, 3, 4]}, [(3,), (0,), (10,)]),
    ("count_divisible", "xs: list", "Return how many elements of xs are divisible by {d}.",
     lambda p: (lambda xs: sum(x % p["d"] == 0 for x in xs)), {"d": [2, 3, 5, 7, 4]},
     [([1, 2, 3, 4, 10, 14, 15],), ([],), ([0, 21, 35],)]),
    ("pad_left", "s: str", ("Return s padded on the left with '{c}' to a width of {w} characters (longer strings "
      "unchanged)."), lambda p: (lambda s: s.rjust(p["w"], p["c"])), {"c": list("*0-"), "w": [5, 8]},
     [("ab",), ("",), ("abcdefghij",)]),
    ("take_every", "xs: list", "Return every {k}-th element of xs, starting with the first.",
     lambda p: (lambda xs: xs[:: p["k"]]), {"k": [2, 3, 4, 5]}, [(list(range(10)),), ([],), ([7, 8],)]),
    ("replace_char", "s: str", "Return s with every '{a}' replaced by '{b}'.",
     lambda p: (lambda s: s.replace(p["a"], p["b"])), {"a": list("aeo"), "b": list("xz")},
     [("banana",), ("",), ("hello world",)]),
    ("sum_between", "xs: list", "Return the sum of the elements of xs that lie between {lo} and {hi} inclusive.",
     lambda p: (lambda xs: sum(x for x in xs if p["lo"] <= x <= p["hi"])), {"lo": [0, 2, -5], "hi": [5, 10]},
     [([1, 2, 3, 6, 11, -4],), ([],), ([5, 10, 0],)]),
    ("to_base", "n: int", "Return the non-negative integer n written in base {b} as a string of digits.",
     lambda p: _to_base(p["b"]), {"b": [2, 3, 5, 7, 8]},
     [(0,), (10,), (255,)]),
    ("longest_run", "s: str", "Return the length of the longest run of consecutive '{c}' characters in s.",
     lambda p: (lambda s: max((len(x) for x in re.findall(re.escape(p["c"]) + "+", s)), default=0)),
     {"c": list("abx")}, [("aabbbaaaa",), ("",), ("xxbxxx",)]),
]

NAMES = ["", "_v2"]


def instantiate(rng: random.Random):
    problems = []
    for base, sig, doc, make, choices, inputs in TEMPLATES:
        combos = [dict(zip(choices, vals, strict=True)) for vals in _product(*choices.values())] if choices else [{}]
        rng.shuffle(combos)
        for j, params in enumerate(combos[:8] if choices else [{}]):
            for suffix in (NAMES[: 1 + (8 - len(combos[:8])) // 2] if not choices else [NAMES[j % len(NAMES)]]):
                fn = make(params)
                name = base + suffix
                text = doc.format(**params)
                example = inputs[0]
                prompt = (f"def {name}({sig}):\n    \"\"\"{text}\n    >>> {name}({', '.join(map(repr, example))})\n"
                          f"    {fn(*example)!r}\n    \"\"\"\n")
                asserts = "".join(f"    assert candidate({', '.join(map(repr, args))}) == {fn(*args)!r}\n"
                                  for args in inputs)
                problems.append({"task_id": f"cascade_dev/{len(problems)}", "group": base, "prompt": prompt,
                                 "entry_point": name, "test": f"def check(candidate):\n{asserts}"})
    return problems


def _product(*lists):
    if not lists:
        return [()]
    return [(x, *rest) for x in lists[0] for rest in _product(*lists[1:])]


if __name__ == "__main__":
    problems = instantiate(random.Random(55))
    with open(OUT, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in problems)
    print(f"{len(problems)} problems -> {OUT}")
