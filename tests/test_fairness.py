"""`--fairness vtc` (engine/fairness.py) on the scheduler alone: weights, lowest counter first, no more share
for sending more, the lift rule for a tenant back from idle."""

from __future__ import annotations

from test_slo_scheduler import run_step

from tokenloom import EngineConfig, SamplingParams
from tokenloom.engine.fairness import W_INPUT, W_OUTPUT, VirtualTokenCounter
from tokenloom.engine.kv_cache import KVCacheManager
from tokenloom.engine.scheduler import Scheduler
from tokenloom.step import Sequence


def req(tenant: str, i: int, prompt_len: int = 16, max_tokens: int = 4, arrival: float = 0.0) -> Sequence:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, tenant=tenant)
    start = 100 + 1000 * i + 10000 * len(tenant)  # no prefix-cache hits between requests
    return Sequence(f"{tenant}-{i}", 0, list(range(start, start + prompt_len)), p, arrival_time=arrival)


def scheduler(**config) -> Scheduler:
    return Scheduler(EngineConfig(fairness="vtc", **config), KVCacheManager(512, 16))


def finish_done(s: Scheduler) -> list[str]:
    done = [q for q in s.running if q.num_output_tokens >= q.params.max_tokens]
    for q in done:
        s.remove(q)
    return [q.request_id for q in done]


def test_weights_input_1_output_2():
    assert (W_INPUT, W_OUTPUT) == (1.0, 2.0)
    s = scheduler()
    s.add(req("a", 0, prompt_len=10, max_tokens=3))
    for t in range(4):
        run_step(s, float(t))
    assert s.vtc.counters["a"] == 10 * 1 + 3 * 2  # the prompt, then 3 decode rows (the 1st token came with it)


def test_lowest_counter_first_and_sending_more_buys_no_more_share():
    s = scheduler(max_num_seqs=2)
    for i in range(20):
        s.add(req("heavy", i))
    for i in range(4):
        s.add(req("light", i))
    served: list[str] = []
    for t in range(60):
        run_step(s, float(t))
        served += finish_done(s)
        if not any(r.startswith("light") for r in (q.request_id for q in s.waiting + s.running)):
            break
    light_done = [r for r in served if r.startswith("light")]
    heavy_done = [r for r in served if r.startswith("heavy")]
    assert len(light_done) == 4
    # While both were backlogged they were served alike (VTC's bound: within one request's tokens), though
    # heavy sent 5x as many requests.
    assert abs(len(heavy_done) - len(light_done)) <= 2
    assert abs(s.vtc.counters["heavy"] - s.vtc.counters["light"]) <= 2 * (16 + 2 * 4)


def test_fcfs_without_vtc_serves_the_heavy_tenant_first():
    s = Scheduler(EngineConfig(max_num_seqs=2), KVCacheManager(512, 16))
    for i in range(20):
        s.add(req("heavy", i))
    s.add(req("light", 0, arrival=0.1))
    served: list[str] = []
    for t in range(30):
        run_step(s, float(t))
        served += finish_done(s)
    assert "light-0" not in served[:10]


def test_a_tenant_with_nothing_running_gets_a_seat_within_a_step():
    """The batch full of a heavy tenant's long requests: a light one's request does not wait for one of
    them to end (about 50 steps), only for its counter to be the lower one (a step). The heavy row with the least done gives up its seat once (recomputed later), and no
    more seats change hands while each tenant has a row running."""
    s = scheduler(max_num_seqs=2)
    for i in range(4):
        s.add(req("heavy", i, max_tokens=50))
    for t in range(5):
        run_step(s, float(t))
    assert {q.request_id for q in s.running} == {"heavy-0", "heavy-1"}
    s.add(req("light", 0, arrival=5.0))  # lifted to heavy's counter: the seat changes hands once heavy's is above
    assert "light-0" not in [rid for rid, _ in run_step(s, 5.0)]
    assert "light-0" in [rid for rid, _ in run_step(s, 6.0)]
    assert s.num_preemptions == 1 and len([q for q in s.running if q.params.tenant == "heavy"]) == 1
    for t in range(7, 13):
        run_step(s, float(t))
        finish_done(s)
    assert s.num_preemptions == 1  # light's request ran to its end; nobody else was put out


def test_a_tenant_back_from_idle_is_lifted_to_the_backlogged_minimum():
    vtc = VirtualTokenCounter()
    a, b, c = req("a", 0), req("b", 0), req("c", 0)
    vtc.arrive(a, [])
    vtc.charge(a, 100, 0)  # a was served 100 while b was idle
    vtc.arrive(b, [a])
    assert vtc.counters["b"] == 100  # b competes from where a is, not from 0
    vtc.charge(b, 50, 0)
    vtc.arrive(req("a", 1), [a, b])  # a is backlogged: no lift for its own new requests
    assert vtc.counters["a"] == 100
    vtc.arrive(c, [])  # nobody backlogged: lifted to the last served tenant's counter
    assert vtc.counters["c"] == 150
    vtc.counters["d"] = 500
    vtc.arrive(req("d", 0), [a, b])  # a counter above the others' is never lowered
    assert vtc.counters["d"] == 500


def test_the_tenant_is_the_user_field(make_engine):
    engine = make_engine(fairness="vtc")
    engine.add_request("x", list(range(100, 110)), SamplingParams(max_tokens=2, tenant="alice", temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.vtc.counters["alice"] > 0


def test_the_server_charges_the_user_fields_tenant(make_engine):
    from test_server_tenancy import run_app

    engine = make_engine(fairness="vtc")

    async def scenario(client, app):
        for user in ("alice", "bob"):
            r = await client.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 3, "user": user})
            assert r.status_code == 200, r.text

    run_app(engine, scenario)
    assert set(engine.scheduler.vtc.counters) == {"alice", "bob"}


def test_within_one_step_each_admission_goes_to_the_lowest_counter():
    s = scheduler(max_num_batched_tokens=512)
    for i in range(3):
        s.add(req("a", i, prompt_len=100))
    s.add(req("bb", 0, prompt_len=100, arrival=1.0))
    s.add(req("bb", 1, prompt_len=100, arrival=1.0))
    order = [rid for rid, _ in run_step(s, 2.0)]
    assert order == ["a-0", "bb-0", "a-1", "bb-1", "a-2"]  # alternating as each admission charges its tenant


def test_a_new_user_every_request_does_not_grow_the_table_without_bound():
    from tokenloom.engine.fairness import MAX_REMEMBERED_TENANTS

    vtc = VirtualTokenCounter()
    heavy = req("heavy", 0)
    vtc.charge(heavy, 500, 0)  # served a lot, and backlogged: never forgotten
    for i in range(5 * MAX_REMEMBERED_TENANTS):
        vtc.arrive(req(f"u{i}", i), [heavy])
    assert len(vtc.counters) <= MAX_REMEMBERED_TENANTS + 1 and vtc.counters["heavy"] == 500
    assert vtc.counter(req("u-new", 0)) == 0.0
    vtc.arrive(req("u-new", 0), [heavy])
    assert vtc.counter(req("u-new", 0)) == 500  # lifted to the floor as before
