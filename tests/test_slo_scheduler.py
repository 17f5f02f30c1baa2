"""`--scheduling-policy slo` (engine/slo_policy.py) rule by rule, on the scheduler alone with a fake clock:
least slack first, rows about to miss their TPOT kept, prefill sized from the decoding rows' slack, late requests
yield (never dropped), shedding with Retry-After."""

from __future__ import annotations

import pytest

from tokenloom import EngineConfig, SamplingParams
from tokenloom.engine.kv_cache import KVCacheManager
from tokenloom.engine.scheduler import Scheduler
from tokenloom.engine.slo_policy import SLOScheduling, SLOShedError
from tokenloom.engine.stall_free import StallFreeBudget
from tokenloom.slo import SLO
from tokenloom.step import Sequence, StepShape

MS = 1e-3


def params(ttft_ms=None, tpot_ms=None, e2e_ms=None, max_tokens=8) -> SamplingParams:
    slo = SLO(ttft_ms, tpot_ms, e2e_ms)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, slo=None if slo.empty else slo)


def seq(name: str, prompt_len: int, arrival: float, **kw) -> Sequence:
    return Sequence(name, 0, list(range(100, 100 + prompt_len)), params(**kw), arrival_time=arrival)


def scheduler(stall_free: StallFreeBudget | None = None, **config) -> Scheduler:
    cfg = EngineConfig(scheduling_policy="slo", **config)
    s = Scheduler(cfg, KVCacheManager(256, 16), stall_free)
    s.slo.step_s, s.slo.token_s = 10 * MS, 1 * MS  # as if measured: a decode step 10 ms, a prompt token 1 ms
    return s


def run_step(s: Scheduler, now: float) -> list[tuple[str, int]]:
    """Plan a step at `now` and apply it as the engine would: tokens computed, a token where a row ends."""
    plan = s.schedule(now)
    for q, n in plan.scheduled:
        q.num_computed_tokens += n
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(7)
            q.times.first_token = q.times.first_token or now
    return [(q.request_id, n) for q, n in plan.scheduled]


def test_least_slack_first_among_waiting():
    s = scheduler(max_num_seqs=1)
    loose = seq("loose", 16, 0.0, ttft_ms=5000)
    tight = seq("tight", 16, 0.5, ttft_ms=1000)  # arrived later, deadline 1.5 s (loose's: 5 s)
    no_slo = seq("none", 16, -1.0)
    for q in (no_slo, loose, tight):
        s.add(q)
    assert run_step(s, 0.6) == [("tight", 16)]
    # A long prompt's prefill counts against its slack: 1,000 tokens x 1 ms leaves less than 0.2 s.
    sl = SLOScheduling()
    sl.token_s = 1 * MS
    long_ = seq("long", 1000, 0.0, ttft_ms=1200)
    short = seq("short", 10, 0.0, ttft_ms=1000)
    assert sl.slack(long_, 0.0) < sl.slack(short, 0.0)


def test_a_request_that_cannot_make_it_sorts_after_those_that_can():
    sl = SLOScheduling()
    sl.token_s = 1 * MS
    missed = seq("missed", 16, 0.0, ttft_ms=100)  # its deadline passed at 0.1 s
    ok = seq("ok", 16, 0.0, ttft_ms=5000)
    assert sl.late(missed, 0.5) and not sl.late(ok, 0.5)
    assert sl.key(ok, 0.5) < sl.key(missed, 0.5)
    # A decoding row whose TPOT cannot come back under target even at one token per step is late too.
    row = seq("row", 4, 0.0, ttft_ms=5000, tpot_ms=20, max_tokens=10)
    row.times.first_token = 0.1
    row.token_ids += [7, 7]  # 2 tokens by t = 1.0: 0.9 s for 1 gap, 8 more at 10 ms each cannot average 20 ms
    sl.step_s = 10 * MS
    assert sl.late(row, 1.0)
    assert not sl.late(row, 0.11)


def test_rows_about_to_miss_their_tpot_are_kept_and_preempted_last():
    s = scheduler()
    at_risk = seq("at-risk", 4, 0.0, tpot_ms=50)
    relaxed = seq("relaxed", 4, 0.0, tpot_ms=5000)
    for q in (relaxed, at_risk):
        s.add(q)
    run_step(s, 0.0)  # both prefill and get their first token at t = 0
    run_step(s, 0.03)
    s.running.sort(key=lambda q: s.policy(q, 0.04))
    assert [q.request_id for q in s.running] == ["at-risk", "relaxed"]  # the victim is the last
    assert s.slo.slack(at_risk, 0.04) < s.slo.slack(relaxed, 0.04)


def test_late_rows_give_up_their_seats_to_requests_that_can_still_make_it():
    s = scheduler(max_num_seqs=1)
    late = seq("late", 8, 0.0, ttft_ms=50, max_tokens=100)
    s.add(late)
    run_step(s, 0.2)  # its first token at 0.2 s: TTFT missed
    fresh = seq("fresh", 8, 0.25, ttft_ms=1000)
    s.add(fresh)
    plan = s.schedule(0.3)
    assert [q.request_id for q in plan.preempted] == ["late"]
    assert [q.request_id for q, _ in plan.scheduled] == ["fresh"]
    assert late in s.waiting  # preempted, never dropped: it finishes once there is room
    fresh.num_computed_tokens = fresh.num_tokens
    s.remove(fresh)
    assert [q.request_id for q, _ in s.schedule(0.4).scheduled] == ["late"]


def test_prefill_allowance_is_sized_from_the_tightest_tpot():
    budget = StallFreeBudget(block_size=16, factor=4.0, refit_every=4, min_samples=4, start_tokens=64)
    for decodes in range(1, 9):  # decode-only steps: 10 ms + 1 ms a row
        rows = [(1, 50)] * decodes
        budget.observe(StepShape(rows, decodes, 0), (10 + decodes) * MS, rows, 0)
    s = scheduler(budget, max_num_batched_tokens=512)
    row = seq("row", 4, 0.0, tpot_ms=20)
    s.add(row)
    run_step(s, 0.0)
    s.add(seq("prompt", 300, 0.0, ttft_ms=60000))  # shorter than a step's budget: sliced all the same
    run_step(s, 0.011)
    assert budget.tpot_cap == pytest.approx(0.020)
    decodes = [(1, 6)]
    assert budget.target(decodes) == pytest.approx(0.020)  # 4 x 11 ms would be 44 ms: the TPOT caps it
    budget.observe(StepShape([*decodes, (64, 64)], 2, 0), 40 * MS, decodes, 64)  # 2x over the 20 ms target
    assert budget.allowance == int(64 / 2 * 0.9)
    assert dict(run_step(s, 0.05))["prompt"] <= budget.allowance


def test_rows_ahead_of_their_tpot_let_a_step_run_longer():
    sl = SLOScheduling()
    ahead = seq("ahead", 4, 0.0, tpot_ms=20)
    ahead.times.first_token = 0.0
    ahead.token_ids += [7] * 10  # 10 tokens by 0.05 s: its 10th gap is due at 0.2 s
    pressed = seq("pressed", 4, 0.0, tpot_ms=50)
    pressed.times.first_token = 0.0
    pressed.token_ids += [7] * 2  # due at 0.1 s
    no_tpot = seq("no-tpot", 4, 0.0, ttft_ms=100)
    no_tpot.times.first_token = 0.0
    assert sl.tpot_cap([ahead], 0.05) == pytest.approx(0.15)
    assert sl.tpot_cap([ahead, pressed, no_tpot], 0.05) == pytest.approx(0.05)  # the most pressed row's
    assert sl.tpot_cap([ahead], 0.5) == pytest.approx(0.020)  # behind: never tighter than its own target
    assert sl.tpot_cap([no_tpot], 0.05) is None


def test_shedding_refuses_requests_predicted_to_miss_by_far():
    sl = SLOScheduling()
    queued = [seq(f"q{i}", 1000, 0.0, ttft_ms=10_000) for i in range(5)]
    new = seq("new", 100, 1.0, ttft_ms=500)
    sl.check_admission([new], queued, [], 64, 1.0)  # nothing measured yet: never shed
    sl.token_s = 1 * MS
    sl.check_admission([new], queued, [], 64, 1.0)  # its deadline is the nearest: nothing ahead of it
    tight = [seq(f"t{i}", 1000, 0.0, ttft_ms=1100) for i in range(5)]  # less slack: ahead, 5,000 tokens, 5 s
    hopeless = [seq(f"h{i}", 1000, 0.0, ttft_ms=400) for i in range(5)]  # cannot make it: not ahead of anybody
    sl.check_admission([seq("new", 100, 0.0, ttft_ms=500)], hopeless, [], 64, 0.0)
    with pytest.raises(SLOShedError, match=r"^slo\.ttft_ms: ") as exc:
        sl.check_admission([seq("new", 100, 0.0, ttft_ms=500)], tight, [], 64, 0.0)
    assert exc.value.retry_after_s == 5 and sl.num_shed == 1
    sl.check_admission([seq("no-slo", 100, 1.0)], tight, [], 64, 1.0)  # without a TTFT target: never shed
    # A full batch: seats free as the running rows finish their outputs (100 decode steps of 10 ms away).
    sl.step_s = 10 * MS
    busy = [seq(f"b{i}", 4, 0.0, max_tokens=100) for i in range(2)]
    for b in busy:
        b.times.first_token = 0.0
    sl.check_admission([seq("new", 10, 0.0, ttft_ms=1000)], [], busy, 2, 0.0)  # 1 s to a seat: < 2x target
    with pytest.raises(SLOShedError):
        sl.check_admission([seq("new", 10, 0.0, ttft_ms=400)], [], busy, 2, 0.0)


def test_slo_shed_is_a_429_with_retry_after(make_engine):
    import httpx
    from test_server_tenancy import error_of, run_app

    engine = make_engine(scheduling_policy="slo", slo_shed=True)
    engine.scheduler.slo.token_s = 1.0  # a second a prompt token: every tight request is hopeless
    for i in range(3):
        engine.add_request(f"q{i}", list(range(100, 140)), params())  # no SLO: never shed

    async def scenario(client: httpx.AsyncClient, app):
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "slo": {"ttft_ms": 100}})
        error_of(r, 429, "slo.ttft_ms")
        assert int(r.headers["retry-after"]) >= 1
        r = await client.get("/metrics")
        assert 'tokenloom:slo_shed_total{model_name="tiny"} 1.0' in r.text

    run_app(engine, scenario)


def test_the_slo_policy_runs_everything_to_the_end(make_engine):
    engine = make_engine(scheduling_policy="slo", max_num_seqs=2, max_num_batched_tokens=32)
    for i in range(6):
        engine.add_request(f"r{i}", list(range(100 + i, 140 + i)), params(ttft_ms=1 + 50 * i, tpot_ms=1, max_tokens=6))
    engine.add_request("plain", list(range(300, 320)), params(max_tokens=6))
    done = set()
    for _ in range(500):
        done |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    assert done == {*(f"r{i}" for i in range(6)), "plain"}
    assert EngineConfig(slo_shed=True).scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="^slo_shed"):
        EngineConfig(slo_shed=True).validate()
