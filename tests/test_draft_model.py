"""Speculation with a draft model (engine/draft_model.py): exact, batched, rolled back, no leaks.

Random-weight tiny models stand in for the pair: the target drafting for itself (its drafts are its
own greedy tokens, so they are accepted) and a second random model (its drafts are almost all
rejected). The real pair, Qwen2.5-Coder-0.5B drafting for the 1.5B, is in test_model_1_5b.py."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TINY, assert_engine_clean

from tokenloom import LLM, EngineConfig, SamplingParams
from tokenloom.config import SpeculativeConfig
from tokenloom.engine.draft_model import DraftModelProposer
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.speculation import Acceptance, SpeculationPolicy
from tokenloom.model.loader import random_model
from tokenloom.step import Sequence

PROMPTS = [[5, 6, 7, 8] * 20, [100, 200] * 30, list(range(300, 360)) * 2, list(range(1000, 1300))]
ALWAYS = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4, "adaptive": False}


@pytest.fixture(scope="module")
def other_model():
    return random_model(TINY, seed=1)


@pytest.fixture
def make_draft_engine(tiny_model, tokenizer):
    engines: list[LLMEngine] = []

    def make(draft, **kwargs) -> LLMEngine:
        kwargs.setdefault("max_model_len", 1024)
        kwargs.setdefault("num_kv_blocks", 256)
        engine = LLMEngine(EngineConfig(**kwargs), model=tiny_model, tokenizer=tokenizer, draft_model=draft)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_engine_clean(engine)
        if engine.speculation is not None and engine.speculation.draft is not None:
            draft = engine.speculation.draft
            assert not draft.mirrors and draft.kv.all_free(), "the draft model's KV blocks leaked"


def _tokens(engine: LLMEngine, params: SamplingParams) -> list[list[list[int]]]:
    outs = LLM(engine=engine).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(temperature=0, max_tokens=23, min_tokens=10, stop_token_ids=[7]),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=5, max_tokens=30, n=2, repetition_penalty=1.2,
                   logit_bias={5: 2.0, 100: 1.5}),  # seeded: the same draws either way
])
def test_outputs_identical_with_a_draft_model(make_draft_engine, tiny_model, other_model, params):
    base = _tokens(make_draft_engine(None), params)
    itself = make_draft_engine(tiny_model, speculative_config=ALWAYS)
    assert _tokens(itself, params) == base
    other = make_draft_engine(other_model, speculative_config={**ALWAYS, "num_speculative_tokens": 3})
    assert _tokens(other, params) == base
    if params.greedy:  # the target's own greedy tokens, drafted by the target: accepted
        st = itself.speculation.stats
        assert st.num_accepted_tokens > 0.8 * st.num_draft_tokens > 50, st
        assert other.speculation.stats.num_accepted_tokens < 0.1 * other.speculation.stats.num_draft_tokens


def test_greedy_does_not_depend_on_the_batch(make_draft_engine, tiny_model):
    params = SamplingParams(temperature=0, max_tokens=30)
    alone = [_tokens_one(make_draft_engine(tiny_model, speculative_config=ALWAYS), p, params) for p in PROMPTS]
    engine = make_draft_engine(tiny_model, speculative_config=ALWAYS)
    assert _tokens(engine, params) == [[t] for t in alone]


def _tokens_one(engine, prompt, params):
    return LLM(engine=engine).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_rolled_back_mirror_drafts_what_a_fresh_one_does(tiny_model):
    """After the target rejects drafts, the mirror's KV is cut back to what the two share: its next
    drafts are exactly those of a mirror that never saw the rejected ones."""
    used = DraftModelProposer(tiny_model, num_blocks=64, block_size=4)
    seq = Sequence("a", 0, list(range(300, 330)), SamplingParams(temperature=0))
    [drafts] = used.propose([seq], [5])
    seq.token_ids += drafts[:2] + [(drafts[2] + 1) % TINY.vocab_size]  # two accepted, a bonus token differing
    [again] = used.propose([seq], [5])
    fresh = DraftModelProposer(tiny_model, num_blocks=64, block_size=4)
    assert again == fresh.propose([seq], [5])[0]
    mirror = used.mirrors[seq.seq_id]
    assert len(mirror.block_table) == used.kv.blocks_needed(mirror.num_computed_tokens)
    used.forget(seq)
    assert used.kv.all_free() and not used.mirrors


def test_a_long_prompt_is_caught_up_a_chunk_a_step(tiny_model):
    proposer = DraftModelProposer(tiny_model, num_blocks=256, block_size=16, max_catch_up=100)
    seq = Sequence("a", 0, list(range(1000, 1250)), SamplingParams(temperature=0))
    assert proposer.propose([seq], [4]) == [[]]  # 100 of 250 tokens fed
    assert proposer.propose([seq], [4]) == [[]]  # 200
    assert len(proposer.propose([seq], [4])[0]) == 4  # the last 50, then drafts
    assert proposer.mirrors[seq.seq_id].num_computed_tokens == 250 + 3


def test_a_full_draft_pool_costs_drafts_not_requests(make_draft_engine, tiny_model):
    """A draft KV pool too small for everyone: sequences draft less, outputs stay the same, nothing leaks."""
    params = SamplingParams(temperature=0, max_tokens=30)
    base = _tokens(make_draft_engine(None), params)
    engine = make_draft_engine(tiny_model, speculative_config=ALWAYS)
    engine.speculation.draft = small = DraftModelProposer(tiny_model, num_blocks=40, block_size=16)
    assert _tokens(engine, params) == base
    assert small.kv.all_free()


def _policy(ratio: float, rows_cost: float) -> SpeculationPolicy:
    policy = SpeculationPolicy(SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=6),
                               draft=_PricedDraft(ratio))
    for rows in (1, 2, 5, 8, 32, 36):
        policy.observe_step(rows, 0.035 + rows_cost * rows)
    return policy


@dataclasses.dataclass
class _PricedDraft:
    """A draft proposer that only has a price (the policy's input), for the depth choice alone."""

    size_ratio: float

    lags: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        from tokenloom.engine.speculation import StepCost
        self.cost = StepCost()

    def lag(self, seq: Sequence) -> int:
        return self.lags.get(seq.seq_id, 1)


def test_the_policy_drafts_deep_at_batch_1_and_not_at_32_streams():
    cheap = _policy(ratio=0.2, rows_cost=0.0015)
    [one] = [Sequence("a", 0, [1, 2, 3], SamplingParams())]
    cheap.acceptance[one.seq_id] = Acceptance(accepted=9.0, trials=10.0)
    assert cheap._draft_depths([one], [10]) == [6]  # a cheap draft right 9 times in 10: the deepest
    assert cheap._draft_depths([one], [2]) == [2]  # never past what max_tokens leaves
    poor = Acceptance(accepted=3.0, trials=10.0)
    cheap.acceptance[one.seq_id] = poor
    assert 0 < cheap._draft_depths([one], [10])[0] < 6
    many = [Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams()) for i in range(32)]
    for s in many:
        cheap.acceptance[s.seq_id] = Acceptance(accepted=6.0, trials=10.0)
    assert sum(cheap._draft_depths(many, [10] * 32)) == 0  # 32 busy streams: a row costs what a token brings
    costly = _policy(ratio=1.0, rows_cost=0.0015)  # drafting with a model as big as the target never pays
    costly.acceptance[one.seq_id] = Acceptance(accepted=9.0, trials=10.0)
    assert costly._draft_depths([one], [10]) == [0]


def test_a_long_catch_up_is_paid_only_by_a_long_answer():
    """A new sequence's draft must first read its whole prompt: worth it for 200 more tokens, not for 4."""
    policy = _policy(ratio=0.2, rows_cost=0.0015)
    for tokens in (1, 2, 128, 256):  # a draft round: 7 ms + 1.5 ms a token fed
        policy.draft.cost.observe(tokens, 0.007 + 0.0015 * tokens)
    [new] = [Sequence("a", 0, list(range(500)), SamplingParams())]
    policy.draft.lags[new.seq_id] = 500
    policy.acceptance[new.seq_id] = Acceptance(accepted=9.0, trials=10.0)
    assert policy._draft_depths([new], [200])[0] > 0
    assert policy._draft_depths([new], [4]) == [0]


def test_a_draft_model_that_does_not_fit_is_refused_at_start(make_draft_engine, tokenizer, tiny_model):
    other_vocab = random_model(dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 64), seed=2)
    with pytest.raises(ValueError, match="speculative_config.model: its vocabulary has 49216 ids"):
        make_draft_engine(other_vocab, speculative_config=ALWAYS)
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLMEngine(EngineConfig(max_model_len=256, num_kv_blocks=64,
                               speculative_config={"model": "/no/such/draft.gguf"}),
                  model=tiny_model, tokenizer=tokenizer)


@pytest.mark.slow
def test_a_draft_model_with_another_tokenizer_is_refused_by_name():
    """Gemma 3's 262k-token vocabulary drafting for SmolLM2: refused at start-up, naming the key."""
    from tokenloom.model import catalog

    gemma = str(catalog.pull("gemma-3-270m", progress=False, log=lambda _: None))
    with pytest.raises(ValueError, match="speculative_config.model: .* has another tokenizer"):
        LLM(quantization="auto", speculative_config={"model": gemma})
