"""Speculative decoding (engine/speculation.py, the sampler's verification): exact, batched, no leaks.

The tiny random-weight model exercises the same engine path as the real one; the real SmolLM2 runs
in the slow tests at the end (float32 and the quantized serving path)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch

from tokenloom import EngineConfig, SamplingParams
from tokenloom.config import SpeculativeConfig
from tokenloom.engine.speculation import (
    Acceptance,
    NgramProposer,
    SpeculationPolicy,
    StepCost,
)
from tokenloom.model.sampler import Sampler, choice_generator
from tokenloom.step import Sequence

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
ALWAYS = {**NGRAM, "adaptive": False}  # every draft found is scored: the verification path at full use


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for an upper tail of 1e-4 (z = its normal quantile), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# -- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("value, named", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -3}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 10**9}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 15}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "eagle"}, "method"),
    ({"method": "draft_model"}, "speculative_config.model"),  # no draft model named
    ({"model": ""}, "speculative_config.model"),
    ({"model": 5}, "speculative_config.model"),
    ({"method": "ngram", "model": "draft.gguf"}, "speculative_config.model"),
    ({"temperature": 1}, "unknown key 'temperature'"),
    ("{not json", "not JSON"),
    ("[4]", "JSON object"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_key(value, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(speculative_config=value).validate()


def test_a_draft_row_stays_with_the_decode_kernels():
    from tokenloom.config import MAX_SPECULATIVE_TOKENS
    from tokenloom.runner import SHORT_CHUNK

    assert 1 + MAX_SPECULATIVE_TOKENS < SHORT_CHUNK


def test_config_from_the_command_line():
    from argparse import ArgumentParser

    from tokenloom.config import add_engine_args, engine_config_from_args

    parser = ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    spec = engine_config_from_args(args).validate().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", 3, True)
    assert engine_config_from_args(parser.parse_args([])).speculative is None


# -- the proposer --------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # the longest match (1 2 3) and what followed
    ([1, 2, 3, 4, 5, 9, 2, 3], 3, [4, 5, 9]),  # a match of 2 is enough (prompt_lookup_min)
    ([9, 3, 8, 1, 2, 3], 2, []),  # only the last token matches: below prompt_lookup_min
    ([7, 2, 5, 0, 7, 2, 6, 1, 7, 2], 1, [6]),  # the most recent of equally long matches
    ([1, 2, 1, 2, 1], 5, [2, 1, 2, 1, 2]),  # a match running into the tail repeats with its period
    ([4, 4, 4, 4], 3, [4, 4, 4]),
    ([1, 2, 3], 4, []),
    ([1, 2, 1, 2], 0, []),
])
def test_ngram_proposer(tokens, k, expected):
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4))
    assert proposer.propose(tokens, k) == expected


def test_ngram_prefers_the_longest_match():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    #              a long match (5 6 7) early, a short one (7) late
    tokens = [5, 6, 7, 11, 12, 0, 7, 13, 5, 6, 7]
    assert proposer.propose(tokens, 2) == [11, 12]


# -- the policy ----------------------------------------------------------------------------------

def test_step_cost_fits_a_line_and_falls_back_to_its_prior():
    cost = StepCost(prior_ratio=0.05)
    assert cost.coefficients() == (1.0, 0.05)
    for rows in [1, 5, 9, 2, 7, 3] * 20:
        cost.observe(rows, 0.010 + 0.002 * rows)
    c0, c1 = cost.coefficients()
    assert c0 == pytest.approx(0.010, rel=0.1) and c1 == pytest.approx(0.002, rel=0.1)
    flat = StepCost(prior_ratio=0.05)
    for _ in range(50):
        flat.observe(32, 0.1)  # one batch size only: the slope cannot be told, the prior ratio stands
    c0, c1 = flat.coefficients()
    assert c1 / c0 == pytest.approx(0.05, rel=0.05)


def _seqs(n: int, tokens: list[int]) -> list[Sequence]:
    return [Sequence(f"r{i}", 0, list(tokens), SamplingParams(max_tokens=50)) for i in range(n)]


def test_policy_proposes_at_batch_1_and_little_at_32_busy_streams():
    policy = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=4))
    for rows in (1, 2, 5, 8, 32, 36):
        policy.observe_step(rows, 0.008 + 0.0015 * rows)  # like SmolLM2's int4 decode on 2 cores
    repetitive = [1, 2, 3, 4] * 10
    [one] = _seqs(1, repetitive)
    policy.acceptance[one.seq_id] = Acceptance(accepted=9.0, trials=10.0)  # drafts right 9 times in 10
    policy.propose([one], [4])
    assert one.spec_token_ids == [1, 2, 3, 4]
    many = _seqs(32, repetitive)
    for s in many:  # sequences whose drafts were mostly wrong so far
        policy.acceptance[s.seq_id] = Acceptance(accepted=1.0, trials=4.0)
    policy.propose(many, [4] * 32)
    assert sum(len(s.spec_token_ids) for s in many) == 0
    for s in many:  # drafts that are always right are worth a row even then
        policy.acceptance[s.seq_id] = Acceptance(accepted=40.0, trials=40.5)
    policy.propose(many, [4] * 32)
    assert sum(len(s.spec_token_ids) for s in many) > 32


def test_a_sequence_that_stopped_drafting_tries_again():
    """A rate is only measured on drafts: a sequence whose drafts missed until a row no longer paid
    stops drafting, and without a way back it would never draft again however well a lookup would do."""
    policy = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=4))
    for rows in (1, 2, 5, 8):
        policy.observe_step(rows, 0.005 + 0.0008 * rows)  # SmolLM2's grounded c=1 steps
    [seq] = _seqs(1, [1, 2, 3, 4] * 10)
    drafting = []
    for _ in range(40):
        policy.propose([seq], [4])
        drafting.append(bool(seq.spec_token_ids))
        if seq.spec_token_ids:
            policy.observe(seq, len(seq.spec_token_ids), 0)  # every draft wrong
    first_pause = drafting.index(False)
    assert first_pause <= 6  # it stops after a few misses
    assert any(drafting[first_pause:]), drafting  # and tries again
    assert sum(drafting) < 20  # at long intervals: probes, not a draft every step


def test_acceptance_rate_tracks_what_was_accepted():
    a = Acceptance()
    for _ in range(30):
        a.observe(proposed=4, accepted=4)
    assert a.rate > 0.9
    for _ in range(30):
        a.observe(proposed=4, accepted=0)
    assert a.rate < 0.2


# -- verification against exact enumeration -----------------------------------------------------

def test_verification_matches_exact_enumeration_on_a_toy_distribution():
    """Rows: 3 positions over a 4-token vocabulary, drafts (2, 1). The probability of each outcome (the
    tokens emitted) is enumerated exactly; 20,000 seeded draws must fit it (chi-square, p = 1e-4)."""
    logits = torch.tensor([[0.5, 0.1, 1.2, -0.3], [0.0, 0.9, 0.2, 0.4], [1.0, -1.0, 0.3, 0.3]])
    drafts = [2, 1]
    p = logits.softmax(-1).tolist()
    exact: dict[tuple[int, ...], float] = {}
    for t0 in range(4):
        if t0 != drafts[0]:
            exact[(t0,)] = p[0][t0]
    for t1 in range(4):
        if t1 != drafts[1]:
            exact[(drafts[0], t1)] = p[0][drafts[0]] * p[1][t1]
    for t2 in range(4):
        exact[(*drafts, t2)] = p[0][drafts[0]] * p[1][drafts[1]] * p[2][t2]
    assert sum(exact.values()) == pytest.approx(1.0)

    sampler, params, n = Sampler(), SamplingParams(temperature=1.0), 20_000
    seen = Counter()
    for i in range(n):
        emitted, _ = sampler(logits, [params], [[0]], [[]], [choice_generator(i, 0)], [[None] * 3], [drafts])
        seen[tuple(emitted[0])] += 1
    assert set(seen) <= set(exact)
    stat = sum((seen[o] - n * q) ** 2 / (n * q) for o, q in exact.items())
    assert stat < chi_square_critical(len(exact) - 1), (stat, seen)


def test_greedy_verification_accepts_while_the_draft_is_the_argmax():
    """From the rows' logits (the sampler) and from their argmaxes alone (the head's scan, runner.argmax_only)."""
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    for drafts, expected in [([1, 2], [1, 2, 0]), ([1, 0], [1, 2]), ([0, 2], [1]), ([], [1])]:
        rows = logits[: len(drafts) + 1]
        emitted, _ = Sampler()(rows, [greedy], [[0]], [[]], [None], [[None] * (len(drafts) + 1)], [drafts])
        assert emitted[0] == expected
        assert Sampler().take_argmax([rows.argmax(1).tolist()], [drafts], [[0]]) == [expected]


# -- the engine on the tiny model ----------------------------------------------------------------

REPETITIVE = [[5, 6, 7, 8] * 20, [100, 200] * 30, list(range(300, 360)) * 2]


def _run(make_llm, prompts, params, **kwargs):
    """(llm, per prompt per choice: tokens, text, finish reason, logprobs as sorted (token, value) pairs)."""
    llm = make_llm(**kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [[(c.token_ids, c.text, c.finish_reason, None if c.logprobs is None else
                   [sorted(lp.items()) for lp in c.logprobs]) for c in o.outputs] for o in outs]


def assert_same(spec, base) -> None:
    """Tokens, text and finish reasons equal; logprobs equal to float32 rounding (a row scored with
    drafts runs the same math grouped otherwise: ~1e-6)."""
    for s_choices, b_choices in zip(spec, base, strict=True):
        for (*s_out, s_lp), (*b_out, b_lp) in zip(s_choices, b_choices, strict=True):
            assert s_out == b_out
            if b_lp is not None:
                assert [[t for t, _ in row] for row in s_lp] == [[t for t, _ in row] for row in b_lp]
                assert [v for row in s_lp for _, v in row] == pytest.approx(
                    [v for row in b_lp for _, v in row], abs=1e-4)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(temperature=0, max_tokens=40, logprobs=3),
    SamplingParams(temperature=0, max_tokens=23, min_tokens=10),
    SamplingParams(temperature=0.9, seed=11, max_tokens=40, n=3),  # seeded: the same draws either way
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=5, max_tokens=30, repetition_penalty=1.2,
                   frequency_penalty=0.3, presence_penalty=0.2, logit_bias={5: 2.0, 100: 1.5}),
])
def test_outputs_identical_with_and_without_speculation(make_llm, params):
    _, base = _run(make_llm, REPETITIVE, params)
    llm, spec = _run(make_llm, REPETITIVE, params, speculative_config=ALWAYS)
    assert_same(spec, base)
    if params.greedy:
        assert llm.engine.speculation.stats.num_accepted_tokens > 20  # the drafts were really verified


def test_greedy_does_not_depend_on_the_batch_and_drafts_are_checked_alone(make_llm):
    params = SamplingParams(temperature=0, max_tokens=30)
    alone = [_run(make_llm, [p], params, speculative_config=ALWAYS)[1][0] for p in REPETITIVE]
    batched = _run(make_llm, REPETITIVE + ["Free text that repeats nothing at all."] * 3, params,
                   speculative_config=ALWAYS)[1]
    assert batched[: len(REPETITIVE)] == alone


def test_stop_strings_and_stop_tokens_inside_accepted_drafts(make_llm, tokenizer):
    greedy = SamplingParams(temperature=0, max_tokens=60)
    _, [[(ids, _, _, _)]] = _run(make_llm, [REPETITIVE[0]], greedy)
    stop_text = tokenizer.decode(ids[20:22])
    stop_token = ids[25]
    for extra in ({"stop": [stop_text]}, {"stop_token_ids": [stop_token]}, {"max_tokens": 17}):
        params = greedy.clone(**extra)
        _, base = _run(make_llm, [REPETITIVE[0]], params)
        _, spec = _run(make_llm, [REPETITIVE[0]], params, speculative_config=ALWAYS)
        assert_same(spec, base)
        assert base[0][0][2] in ("stop", "length")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching_with_drafts(make_llm, mode):
    """A KV cache too small for everyone: sequences are preempted and come back; n > 1 shares the
    prompt's blocks. The teardown checks that no block leaked."""
    params = SamplingParams(temperature=0, max_tokens=60, n=2)
    prompts = REPETITIVE * 2
    kwargs = {"num_kv_blocks": 40, "preemption_mode": mode}
    _, base = _run(make_llm, prompts, params, **kwargs)
    llm, spec = _run(make_llm, prompts, params, speculative_config=ALWAYS, **kwargs)
    assert_same(spec, base)
    assert llm.engine.scheduler.num_preemptions > 0


def test_drafts_take_only_what_the_step_leaves(make_engine):
    """A budget of 12 tokens and 10 decoding sequences: every sequence decodes in every step (drafts
    use the 2 tokens left, never a later sequence's), and a small KV cache preempts no more than
    without drafts."""
    params = SamplingParams(temperature=0, max_tokens=40)
    counts = []
    for spec in (None, ALWAYS):
        engine = make_engine(speculative_config=spec, max_num_batched_tokens=12, num_kv_blocks=60, block_size=4,
                             enable_chunked_prefill=True, max_model_len=200)
        for i in range(10):
            engine.add_request(str(i), REPETITIVE[i % 3][:40], params)
        while engine.has_unfinished_requests():
            decoding = {s.seq_id for s in engine.scheduler.running if s.num_tokens - s.num_computed_tokens == 1}
            preempted = engine.scheduler.num_preemptions
            engine.step()
            if engine.scheduler.num_preemptions == preempted:
                assert decoding <= set(engine.last_step.seq_ids)  # nobody's decode gave way to drafts
            assert engine.last_step.num_batched_tokens <= 12
        counts.append(engine.scheduler.num_preemptions)
    assert counts[1] <= counts[0]


def test_structured_output_drafts_go_through_the_grammar(make_llm):
    """A regex the drafts can follow for a while: the grammar's masks after each draft decide."""
    from tokenloom.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex="(ab|cd){3,12}x"))
    prompt = "abcdabcdabcdabcdabcdabcd" * 4
    _, base = _run(make_llm, [prompt], params)
    llm, spec = _run(make_llm, [prompt], params, speculative_config=ALWAYS)
    assert_same(spec, base)
    assert llm.engine.speculation.stats.num_draft_tokens > 0


def test_a_grammar_refuses_drafts_it_does_not_admit(make_llm):
    from tokenloom.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    _, base = _run(make_llm, [[5, 6, 7, 8] * 20], params)
    llm, spec = _run(make_llm, [[5, 6, 7, 8] * 20], params, speculative_config=ALWAYS)
    assert_same(spec, base)
    assert base[0][0][1] in ("yes", "no")
    assert llm.engine.speculation.stats.num_draft_tokens == 0  # token 5 is neither


def test_grammar_lookahead_drops_refused_drafts_and_leaves_the_state_as_it_was(make_engine):
    """Drafts past what the grammar admits (a third 'ab' where only 'x' may come) are cut; the masks
    after the admitted ones are computed and rolled back, and the matcher is not left failed."""
    from tokenloom.sampling_params import StructuredOutputsParams
    from tokenloom.structured_output.grammar import bitmask_words

    engine = make_engine()
    state = engine.grammars.matcher(StructuredOutputsParams(regex="(ab){2}x"))
    ab, x = (engine.tokenizer.tokenizer.token_to_id(t) for t in ("ab", "x"))
    assert ab is not None and x is not None  # single tokens of SmolLM2's vocabulary

    def mask() -> torch.Tensor:
        row = torch.zeros(bitmask_words(engine.model_config.vocab_size), dtype=torch.int32)
        state.fill_bitmask(row)
        return row

    before = mask()
    assert len(state.lookahead([ab, ab, ab, x])) == 2
    assert state.error is None and torch.equal(mask(), before)  # rolled back, not failed
    assert state.lookahead([x]) == []  # 'x' first is refused outright
    assert state.error is None and torch.equal(mask(), before)
    assert state.accept(ab) and state.accept(ab) and state.accept(x)


def test_rejected_drafts_release_their_blocks(make_engine):
    """Drafts that cross into new blocks and are rejected (token 1, which logit_bias makes impossible)
    give those blocks back in the same step."""
    engine = make_engine(speculative_config={**ALWAYS, "num_speculative_tokens": 14}, block_size=4)
    engine.speculation.proposer.propose = lambda tokens, k: [1] * k
    engine.add_request("a", list(range(300, 340)) * 2,
                       SamplingParams(temperature=0, max_tokens=30, logit_bias={1: -100.0}))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert engine.kv.blocks_needed(seq.num_computed_tokens) <= len(seq.block_table) <= engine.kv.blocks_needed(seq.num_tokens)
        engine.check_kv_invariants()
    st = engine.speculation.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == 0


def test_metrics_and_step_stats_count_drafts(make_engine):
    from tokenloom.engine.metrics import EngineMetrics

    engine = make_engine(speculative_config=ALWAYS)
    metrics = EngineMetrics(log_requests=False)
    engine.add_request("a", REPETITIVE[0], SamplingParams(temperature=0, max_tokens=30))
    drafts = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        drafts += engine.last_step.num_draft_tokens
        assert engine.last_step.num_prefill_tokens >= 0
        metrics.on_step(engine, engine.last_step, outs)
    text = metrics.render().decode()
    st = engine.speculation.stats
    assert drafts == st.num_draft_tokens > 0
    assert f'tokenloom:spec_decode_num_draft_tokens_total{{model_name="tokenloom"}} {float(st.num_draft_tokens)}' in text
    assert f'tokenloom:spec_decode_num_accepted_tokens_total{{model_name="tokenloom"}} {float(st.num_accepted_tokens)}' in text
    assert 'tokenloom:spec_decode_num_accepted_tokens_per_pos_total{model_name="tokenloom",position="0"}' in text


@pytest.mark.slow
def test_token_distribution_matches_without_speculation(make_llm):
    """Unseeded sampling over a 5-token slice of the vocabulary (allowed_token_ids), 10,000 samples
    each way: at each of the first 4 positions the token's distribution with speculation matches the one
    without (two-sample chi-square, p = 1e-4). The prompt makes the proposer draft from the slice."""
    vocab = [5, 6, 7, 8, 9]
    prompt = [5, 6, 7, 8, 9] * 12
    params = SamplingParams(temperature=1.0, max_tokens=4, n=100, allowed_token_ids=vocab, ignore_eos=True)
    counts = []
    for spec in (None, {**ALWAYS, "prompt_lookup_min": 1}):
        # A budget with room for drafts beside 256 decodes (drafts only take what a step leaves over).
        llm = make_llm(speculative_config=spec, max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=2048,
                       seed=1 if spec else 2)
        outs = llm.generate([prompt] * 100, params, use_tqdm=False)
        tokens = np.array([c.token_ids for o in outs for c in o.outputs])
        assert tokens.shape == (10_000, 4)
        counts.append([[int((tokens[:, pos] == t).sum()) for t in vocab] for pos in range(4)])
        if spec:
            assert llm.engine.speculation.stats.num_accepted_tokens > 1000
    for pos in range(4):
        a, b = counts[0][pos], counts[1][pos]
        stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b, strict=True) if x + y)
        assert stat < chi_square_critical(len(vocab) - 1), (pos, a, b)


# -- the real model ------------------------------------------------------------------------------

GROUNDED = ("Repeat the following list exactly, one item per line:\n"
            + "\n".join(f"- item {i}: the {c} box holds {i * 7} marbles" for i, c in
                        zip(range(1, 13), itertools.cycle(["red", "green", "blue", "yellow"]))))


def drafts_verified_on_argmaxes(llm) -> list[int]:
    """A list that gets every draft token the runner verifies on the rows' argmaxes alone (the head's
    scan, no logits: runner.argmax_only), from now on."""
    seen, take = [], llm.engine.runner.sampler.take_argmax

    def counting(argmaxes, drafts, prompt_ids):
        seen.extend(t for d in drafts for t in d)
        return take(argmaxes, drafts, prompt_ids)

    llm.engine.runner.sampler.take_argmax = counting
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_real_model_greedy_identical_with_speculation(quantization):
    """SmolLM2 (float32 reference path and the quantized serving path): greedy tokens are the same with
    n-gram speculation, alone and batched with other requests, and most drafts are accepted on a
    prompt the answer copies."""
    from tokenloom import LLM

    params = SamplingParams(temperature=0, max_tokens=96)
    chat = [{"role": "user", "content": GROUNDED}]
    others = ["Once upon a time", "def quicksort(xs):", "The three primary colors are"]
    results = []
    for spec in (None, NGRAM, ALWAYS):
        llm = LLM(quantization=quantization, speculative_config=spec, max_num_batched_tokens=512)
        on_argmaxes = drafts_verified_on_argmaxes(llm)
        alone = llm.chat(chat, params)[0].outputs[0].token_ids
        prompt = llm.engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        batched = llm.generate([prompt, *others], params, use_tqdm=False)
        results.append((alone, [o.outputs[0].token_ids for o in batched]))
        if spec is not None:
            st = llm.engine.speculation.stats
            assert st.num_accepted_tokens > 20, st  # drafts were proposed, verified and accepted
            # A head that scans for the argmax (the serving path's int4 one on the C kernels) finds greedy
            # rows' argmax without logits, drafts' rows too.
            assert (len(on_argmaxes) > 20) == llm.engine.runner._head_scans, len(on_argmaxes)
        del llm
    assert results[1] == results[0] and results[2] == results[0]
    assert results[0][1][0] == results[0][0]
