"""Grammar limits and isolation: every hostile grammar shape is a ValueError naming its limit, a crash
of the native compiler is a ValueError (the worker is replaced), a grammar compiles once, the cache
is bounded in bytes, and a grammar that fails while its request runs fails that request alone."""

from __future__ import annotations

import json
import random
import threading

import pytest
from grammar_shapes import (
    gbnf_chain,
    gbnf_wide,
    lark_chain,
    nested_any_of,
    nested_properties,
    nested_repeat_regex,
    ref_chain,
)

from tokenloom.engine.constraints import BadWords
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams
from tokenloom.structured_output.grammar import GrammarCompiler, GrammarError
from tokenloom.structured_output.limits import GrammarLimits, grammar_shape, regex_depth, schema_shape

VOCAB = 49152
LOOSE = GrammarLimits(max_grammar_depth=10**6, max_grammar_rules=10**6, max_grammar_bytes=10**8)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB)
    yield c
    c.close()


# -- limits checked before any compiler --------------------------------------------------------------


@pytest.mark.parametrize(
    "params, limit",
    [
        ({"json": ref_chain(1200)}, "max_grammar_depth"),
        ({"json": ref_chain(200)}, "max_grammar_depth"),
        ({"grammar": lark_chain(3000)}, "max_grammar_rules"),
        ({"grammar": lark_chain(500)}, "max_grammar_depth"),
        ({"grammar": gbnf_chain(1500)}, "max_grammar_depth"),
        ({"grammar": gbnf_wide(2500)}, "max_grammar_rules"),
        ({"regex": "(" * 300 + "a" + ")" * 300}, "max_grammar_depth"),
        ({"regex": "a" * 200_000}, "max_grammar_bytes"),
        ({"choice": [f"option {i}" for i in range(3000)]}, "max_grammar_rules"),
    ],
)
def test_static_limits_name_the_limit(compiler, params, limit):
    before = compiler.num_worker_restarts
    with pytest.raises(ValueError, match=rf"structured_outputs\.\w+: .* exceeds {limit} \("):
        compiler.compile(StructuredOutputsParams(**params))
    assert compiler.num_worker_restarts == before


@pytest.mark.parametrize("schema", [nested_properties(100), nested_any_of(450), "[" * 100_000 + "]" * 100_000,
                                    '{"a":' * 50_000 + "1" + "}" * 50_000])
def test_deep_json_is_refused_before_parsing(schema):
    """json.loads / json.dumps of these raise RecursionError (a 500); the depth is counted first."""
    with pytest.raises(ValueError, match=r"structured_outputs\.json: a nesting depth of \d+ exceeds max_grammar_depth"):
        StructuredOutputsParams(json=schema)


def test_shapes_are_measured_without_recursion():
    assert schema_shape(ref_chain(50_000))[1] > 50_000  # a recursive walk would hit the recursion limit
    assert grammar_shape(lark_chain(50_000)) == (50_002, 50_002)
    assert grammar_shape(gbnf_wide(10)) == (11, 2)
    assert regex_depth("(" * 50_000 + ")" * 50_000) == 50_001
    assert regex_depth(r"\((a)[(]") == 2  # escaped and class parens do not nest
    # A recursive grammar is as deep as its longest first-visit path, not infinite.
    rules, depth = grammar_shape('root ::= item+\nitem ::= "(" root ")" | "x"')
    assert (rules, depth) == (2, 2)
    # A self-referencing schema (a tree) is legitimate and shallow.
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    assert schema_shape(tree)[1] < 10


# -- limits measured by the worker ------------------------------------------------------------------


@pytest.mark.parametrize("regex", [nested_repeat_regex(2000, 1000, 1000), nested_repeat_regex(2000, 1000),
                                   nested_repeat_regex(500, 500, 500, 500)])
def test_costly_regexes_are_refused_by_a_measured_limit(compiler, regex):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: compiling it measured .* exceeds "
                                         r"max_grammar_(memory_bytes|compile_seconds|mask_ms) \("):
        compiler.compile(StructuredOutputsParams(regex=regex))
    # The verdict is remembered: the same grammar again costs no worker time.
    runs = _count_worker_runs(compiler)
    with pytest.raises(ValueError, match="max_grammar_"):
        compiler.compile(StructuredOutputsParams(regex=regex))
    assert runs() == 0


def test_a_native_crash_is_a_valueerror_and_the_worker_is_replaced(tokenizer):
    """Past the static limits, 5,000 chained rules overflow the native compiler's stack (SIGSEGV):
    in the worker, which dies and is replaced; this process carries on."""
    compiler = GrammarCompiler(tokenizer, VOCAB, LOOSE)
    try:
        with pytest.raises(ValueError, match=r"structured_outputs\.grammar: the grammar compiler crashed .*SIGSEGV"):
            compiler.compile(StructuredOutputsParams(grammar=lark_chain(5000)))
        with pytest.raises(ValueError, match=r"structured_outputs\.json: the grammar compiler crashed"):
            compiler.compile(StructuredOutputsParams(json=ref_chain(5000)))
        assert compiler.num_worker_restarts >= 2
        state = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
        assert state.error is None and state.forced_tokens() == []
    finally:
        compiler.close()


def test_a_compile_past_its_time_is_a_valueerror(tokenizer):
    class Hurried(GrammarLimits):
        compile_timeout_s = 0.001  # the 2,500-rule GBNF -> Lark conversion alone takes ~100 ms

    compiler = GrammarCompiler(tokenizer, VOCAB, Hurried(max_grammar_rules=10**6))
    try:
        with pytest.raises(ValueError, match=r"structured_outputs\.grammar: .*max_grammar_compile_seconds"):
            compiler.compile(StructuredOutputsParams(grammar=gbnf_wide(2500)))
        assert compiler.num_worker_restarts == 1  # killed; the next job starts a new worker
    finally:
        compiler.close()


# -- once per grammar, a cache bounded in bytes -----------------------------------------------------


def _count_worker_runs(compiler: GrammarCompiler):
    calls = []
    run = compiler._sandbox.run
    compiler._sandbox.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    return lambda: len(calls)


def test_a_second_request_with_the_same_grammar_compiles_nothing(compiler):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}}
    compiler.compile(StructuredOutputsParams(json=schema))
    before, runs = compiler.num_compiled, _count_worker_runs(compiler)
    for text in (schema, json.dumps(schema, indent=4)):
        compiler.compile(StructuredOutputsParams(json=text))
        compiler.matcher(StructuredOutputsParams(json=text))
    assert compiler.num_compiled == before and runs() == 0


def test_concurrent_requests_for_one_new_grammar_compile_it_once(compiler):
    params = [StructuredOutputsParams(regex=r"[a-z]{3}-\d{4}-concurrent") for _ in range(6)]
    before = compiler.num_compiled
    threads = [threading.Thread(target=compiler.compile, args=(p,)) for p in params]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiler.num_compiled == before + 1
    assert len({id(p._compiled) for p in params}) == 1


def test_the_cache_is_bounded_in_bytes(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, GrammarLimits(max_grammar_cache_bytes=150_000))
    try:
        sizes = []
        for i in range(12):
            entry = compiler.compile(StructuredOutputsParams(regex=rf"item-{i}-[a-z]{{1,{20 + i}}}"))
            sizes.append(entry.memory_bytes)
            assert compiler.cache_bytes <= 150_000 or len(compiler._cache) == 1
        assert compiler.num_compiled == 12 and 1 <= len(compiler._cache) < 12
        assert compiler.cache_bytes == sum(e.memory_bytes for e in compiler._cache.values())
    finally:
        compiler.close()


def test_wide_gbnf_is_accepted_and_shared_by_twenty_sequences(compiler):
    """1,500 rules, shallow: accepted; its 20 sequences copy one compiled grammar."""
    params = StructuredOutputsParams(grammar=gbnf_wide(1500))
    before = compiler.num_compiled
    states = [compiler.matcher(params) for _ in range(20)]
    assert compiler.num_compiled == before + 1
    assert len({id(s.matcher) for s in states}) == 20


# -- failing while running --------------------------------------------------------------------------


def test_a_token_the_grammar_refuses_is_a_grammar_error(compiler, tokenizer):
    state = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(GrammarError, match="structured_outputs: the grammar failed"):
        state.accept(tokenizer.encode("maybe")[0])
    with pytest.raises(GrammarError):  # and it stays failed
        state.accept(tokenizer.encode("yes")[0])


def _engine_with(make_engine, tokenizer, limits: GrammarLimits):
    engine = make_engine()
    engine.inputs._grammars = GrammarCompiler(tokenizer, engine.model_config.vocab_size, limits)
    return engine


def _run(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


def test_a_mask_over_its_time_fails_its_request_alone(make_engine, tokenizer):
    engine = _engine_with(make_engine, tokenizer, GrammarLimits(max_mask_ms_per_step=0))
    try:
        engine.add_request("plain", "Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.add_request("grammar", "Hello there", SamplingParams(
            temperature=0, max_tokens=6, n=3, structured_outputs={"regex": "[a-z]+ [a-z]+ [a-z]+"}))
        outs = _run(engine)
        assert outs["plain"].outputs[0].finish_reason == "length" and outs["plain"].error is None
        bad = outs["grammar"]
        assert bad.error and "max_mask_ms_per_step" in bad.error and "internal error" not in bad.error
        assert {c.finish_reason for c in bad.outputs} == {"error"}
    finally:
        engine.inputs._grammars.close()


def test_a_grammar_failing_mid_generation_ends_in_error_not_stop(make_engine, tokenizer, monkeypatch):
    """llguidance failing after a few tokens (as LexerTooComplex does) is the request's error: never
    finish_reason "stop" with text the grammar did not accept."""
    from tokenloom.structured_output.grammar import GrammarState

    engine = make_engine()
    accept = GrammarState.accept
    seen: dict[int, int] = {}

    def failing_after_two(self, token):
        seen[id(self)] = seen.get(id(self), 0) + 1
        if seen[id(self)] > 2:
            self.failed = "structured_outputs: the grammar failed: LexerTooComplex (injected)"
            raise GrammarError(self.failed)
        return accept(self, token)

    monkeypatch.setattr(GrammarState, "accept", failing_after_two)
    engine.add_request("g", "Write", SamplingParams(temperature=0, max_tokens=20,
                                                     structured_outputs={"regex": "[a-z ]{1,40}"}))
    engine.add_request("plain", "Write", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = _run(engine)
    assert outs["g"].outputs[0].finish_reason == "error"
    assert "LexerTooComplex" in outs["g"].error
    assert outs["plain"].outputs[0].finish_reason == "length"


# -- per-request constraints, priced once ------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"allowed_token_ids": list(range(1 << 18)) + [0]}, "allowed_token_ids"),
        ({"bad_words": ["x" * 1000] * 17}, "bad_words"),
        ({"bad_words": ["w"] * 1025}, "bad_words"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ],
)
def test_constraint_sizes_are_bounded(fields, name):
    with pytest.raises(ValueError, match=rf"^{name}: at most"):
        SamplingParams(**fields)


def test_constraints_are_built_once_and_shared_by_the_rows(make_engine):
    """n=16 rows with 40,000 allowed ids, a logit bias and 150 long bad words: every row of every step
    gets the same prebuilt objects (the per-row, per-step rebuild cost seconds with n=64)."""
    engine = make_engine()
    rows = []
    original = engine.core._row_constraints
    engine.core._row_constraints = lambda seq: (made := original(seq), rows.extend(made))[0]
    words = [f"word{i} " * 12 for i in range(150)]
    engine.add_request("r", "Hello", SamplingParams(n=16, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True,
                                                    allowed_token_ids=list(range(40_000)), logit_bias={5: 3.0},
                                                    bad_words=words))
    _run(engine)
    assert len(rows) >= 16 * 4
    assert len({id(r.allowed_ids) for r in rows}) == 1 and len({id(r.logit_bias) for r in rows}) == 1
    assert rows[0].allowed_ids.mask.sum() == 40_000


def _naive_bans(words: list[list[int]], output: list[int]) -> set[int]:
    return {w[-1] for w in words if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1])}


def test_bad_word_automaton_bans_what_a_scan_of_the_output_would():
    rng = random.Random(0)
    for _ in range(200):
        words = [[rng.randrange(6) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 8))]
        automaton, state, output = BadWords(words), 0, []
        for _ in range(30):
            assert set(automaton.banned[state]) == _naive_bans(words, output)
            token = rng.randrange(6)
            output.append(token)
            state = automaton.advance(state, token)
