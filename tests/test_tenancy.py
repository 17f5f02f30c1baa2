"""Tenants that cannot read or starve each other, and the quiet fields (seeds) right, without a server:

- prefix-cache keys are SHA-256 digests of (parent key, token ids), salted per request by `cache_salt`:
  equal prompts under different salts share nothing, under one salt they share as before;
- the scheduler's priority order with the operator's client range: a loop of the most urgent
  requests a client may send cannot starve a priority-0 request past its aging bound;
- /metrics access and the public view without the prefix-cache counters;
- seeded choices draw independent 64-bit streams.
"""

from __future__ import annotations

import hashlib
from array import array

import numpy as np
import pytest

from tokenloom import EngineConfig, SamplingParams
from tokenloom.engine.kv_cache import KVCacheManager, block_key
from tokenloom.engine.scheduler import Scheduler
from tokenloom.model.sampler import choice_generator
from tokenloom.server.errors import APIError
from tokenloom.server.tenancy import ClientPriorityRange, MetricsAccess, public_metrics
from tokenloom.step import Sequence

# -- prefix-cache keys ---------------------------------------------------------------------------


def admitted(kv: KVCacheManager, tokens, salt=None, name="s") -> tuple[Sequence, int]:
    """Admit a sequence as the scheduler does; returns it and its prefix-cache hit tokens."""
    seq = Sequence(name, 0, list(tokens), SamplingParams(max_tokens=4, cache_salt=salt))
    hits = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - len(hits) * kv.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    return seq, len(hits) * kv.block_size


def test_block_key_is_sha256_of_parent_and_tokens():
    first = block_key(None, [1, 2, 3, 4])
    empty = (0).to_bytes(8, "little")  # no salt, no LoRA adapter: each an empty length-prefixed string
    expected = hashlib.sha256(b"first\0" + empty + empty + array("I", [1, 2, 3, 4]).tobytes())
    assert first == expected.digest() and len(first) == 32
    second = block_key(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(b"next\0" + first + array("I", [5, 6, 7, 8]).tobytes()).digest()


def test_block_keys_chain_and_depend_on_salt():
    assert block_key(None, [1, 2]) != block_key(None, [1, 2], "tenant-a")
    assert block_key(None, [1, 2], "a") != block_key(None, [1, 2], "b")
    assert block_key(None, [1, 2], "ab") == block_key(None, [1, 2], "ab")
    # Equal tokens under different parents are different blocks.
    assert block_key(block_key(None, [1, 2]), [3, 4]) != block_key(block_key(None, [9, 9]), [3, 4])
    # The salt is length-prefixed: no salt + tokens spelling can mimic another salt.
    assert block_key(None, [0], "a") != block_key(None, [0], "a\0")
    assert block_key(None, [0], None, "sql") != block_key(None, [0])  # an adapter's KV is its own
    assert block_key(None, [0], "x", "y") != block_key(None, [0], "xy")
    assert block_key(None, [0], None, "a") != block_key(None, [0], "a")


@pytest.mark.parametrize(("salt_a", "salt_b", "shared"), [
    (None, None, True), ("t1", "t1", True), ("t1", "t2", False), (None, "t2", False), ("t1", None, False),
])
def test_prefix_cache_shared_only_under_the_same_salt(salt_a, salt_b, shared):
    kv = KVCacheManager(num_blocks=32, block_size=4)
    secret = list(range(100, 121))  # 5 full blocks + 1 token
    a, hits_a = admitted(kv, secret, salt_a, "a")
    assert hits_a == 0
    kv.free(a)  # freed blocks stay cached
    b, hits_b = admitted(kv, secret, salt_b, "b")
    assert hits_b == (20 if shared else 0)
    kv.free(b)
    kv.check_invariants()
    assert kv.all_free()


def test_salted_requests_still_share_within_their_tenant_after_a_guess():
    """The attack: a tenant guesses another's prompt; with distinct salts the guess never hits, and the
    victim's own second request still does."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    victim_prompt = [7] * 12 + [1234, 5678, 9, 9, 9]
    v, _ = admitted(kv, victim_prompt, "victim", "v1")
    kv.free(v)
    seen = {}
    for guess in (1233, 1234, 1235):  # the right guess among wrong ones
        g, seen[guess] = admitted(kv, [7] * 12 + [guess, 5678, 9, 9, 9], "attacker", f"g{guess}")
        kv.free(g)
    # The attacker hits only its own earlier guesses' common prefix: the right guess looks like any other.
    assert seen == {1233: 0, 1234: 12, 1235: 12}
    v2, hits = admitted(kv, victim_prompt, "victim", "v2")
    assert hits == 16
    kv.free(v2)


def test_cache_salt_is_checked_offline():
    for bad in ("", 5, "x" * 1025):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)


# -- priority ------------------------------------------------------------------------------------


def test_client_priority_range_refuses_queue_jumping_by_default():
    rng = ClientPriorityRange()
    rng.check(0)
    rng.check(5)
    for bad in (-1, -(2**31), 1001):
        with pytest.raises(APIError) as err:
            rng.check(bad)
        assert err.value.status == 400 and err.value.param == "priority"
    ClientPriorityRange(-10, 10).check(-10)
    with pytest.raises(ValueError, match="min_client_priority"):
        ClientPriorityRange(5, 0)


@pytest.mark.parametrize("urgent", [-5, 0])
def test_a_loop_of_urgent_requests_cannot_starve_a_priority_zero_one(urgent):
    """One sequence runs at a time; a new request at the most urgent priority a client may send
    (`urgent`) arrives every 0.5 s and each takes 1 s (an overload: the queue grows). The priority-0
    request arriving at t=0 goes before every urgent request that arrived more than -urgent x aging_s
    after it (its aging bound), on the scheduler's own clock; at urgent 0 it is plain FCFS."""
    aging_s = 2.0
    config = EngineConfig(scheduling_policy="priority", priority_aging_s=aging_s, max_num_seqs=1,
                          max_num_batched_tokens=64, num_kv_blocks=64, block_size=4)
    kv = KVCacheManager(64, 4)
    sched = Scheduler(config, kv)
    rng = ClientPriorityRange(urgent, 1000)
    rng.check(urgent)
    victim = Sequence("victim", 0, [1, 2, 3], SamplingParams(priority=0, max_tokens=1), arrival_time=0.0)
    sched.add(victim)
    now, step, admitted_at, started = 0.0, 0.25, None, {}
    n = 0
    while now < 200 and admitted_at is None:
        if now >= n * 0.5:  # a new urgent request
            sched.add(Sequence(f"u{n}", 0, [5, 6, 7], SamplingParams(priority=urgent, max_tokens=1), arrival_time=now))
            n += 1
        plan = sched.schedule(now)
        for seq, tokens in plan.scheduled:
            seq.num_computed_tokens += tokens
            started.setdefault(seq.seq_id, now)
            if seq is victim:
                admitted_at = now
        for seq in list(sched.running):  # each runs 1 s, then finishes
            if now - started[seq.seq_id] >= 1.0:
                sched.remove(seq)
        now += step
    assert admitted_at is not None
    overtook = [sid for sid, t in started.items() if t < admitted_at]
    latest_arrival = max((0.5 * int(sid[1:].split("#")[0]) for sid in overtook), default=0.0)
    assert latest_arrival <= -urgent * aging_s, (admitted_at, overtook)
    assert len(overtook) <= (-urgent * aging_s) / 0.5 + 1  # only that window's arrivals went first


def test_without_bounds_the_same_loop_starves_it():
    """The reason for the range: at -2**31 aging never catches up (the check above can fail)."""
    config = EngineConfig(scheduling_policy="priority", priority_aging_s=2.0, max_num_seqs=1,
                          max_num_batched_tokens=64, num_kv_blocks=64, block_size=4)
    sched = Scheduler(config, KVCacheManager(64, 4))
    victim = Sequence("victim", 0, [1, 2, 3], SamplingParams(priority=0, max_tokens=1), arrival_time=0.0)
    sched.add(victim)
    for t in range(100):
        sched.add(Sequence(f"u{t}", 0, [5], SamplingParams(priority=-(2**31), max_tokens=1), arrival_time=float(t)))
        plan = sched.schedule(float(t))
        assert victim not in [s for s, _ in plan.scheduled]
        for seq, _ in plan.scheduled:
            sched.remove(seq)


# -- /metrics ------------------------------------------------------------------------------------

EXPOSITION = (b"# HELP tokenloom:prefix_cache_hits_total Prompt tokens served by the prefix cache.\n"
              b"# TYPE tokenloom:prefix_cache_hits_total counter\n"
              b'tokenloom:prefix_cache_hits_total{model_name="m"} 42.0\n'
              b'tokenloom:prefix_cache_hit_rate{model_name="m"} 0.5\n'
              b"# HELP tokenloom:num_requests_running Sequences running.\n"
              b'tokenloom:num_requests_running{model_name="m"} 1.0\n')


def test_public_metrics_drop_every_prefix_cache_line():
    public = public_metrics(EXPOSITION)
    assert b"prefix_cache" not in public
    assert b'tokenloom:num_requests_running{model_name="m"} 1.0' in public and public.count(b"\n") == 2


@pytest.mark.parametrize(("access", "header", "view"), [
    (MetricsAccess(), b"", "full"),
    (MetricsAccess(api_key="k"), b"", None),
    (MetricsAccess(api_key="k"), b"Bearer k", "public"),
    (MetricsAccess(api_key="k"), b"Bearer x", None),
    (MetricsAccess(api_key="k", metrics_token="m"), b"Bearer k", None),
    (MetricsAccess(api_key="k", metrics_token="m"), b"Bearer m", "full"),
    (MetricsAccess(metrics_token="m"), b"", None),
    (MetricsAccess(api_key="k", open=True), b"", "public"),
    (MetricsAccess(api_key="k", metrics_token="m", open=True), b"", "public"),
    (MetricsAccess(api_key="k", metrics_token="m", open=True), b"Bearer m", "full"),
])
def test_metrics_access(access, header, view):
    assert access.view(header) == view


# -- seeds ---------------------------------------------------------------------------------------


def draws(seed: int, choice: int) -> np.ndarray:
    return choice_generator(seed, choice).standard_exponential(64, dtype=np.float32)


def test_choice_streams_are_independent_and_use_all_64_bits():
    assert np.array_equal(draws(7, 1), draws(7, 1))
    assert not np.array_equal(draws(7, 1), draws(8, 0))  # choice i of seed s is not seed s+i's stream
    assert not np.array_equal(draws(7, 0), draws(7, 1))
    assert not np.array_equal(draws(5, 0), draws(5 + 2**32, 0))  # the high 32 bits count
    assert not np.array_equal(draws(-1, 0), draws(2**63 - 1, 0))


def test_seeded_choices_on_the_engine(make_llm):
    llm = make_llm()
    prompt = "The quick brown fox"

    def texts(seed: int, n: int) -> list[str]:
        params = SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=12, ignore_eos=True)
        return [c.text for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]

    two = texts(11, 2)
    assert two == texts(11, 2)  # reproducible
    assert two[1] != texts(12, 1)[0]
    assert two[0] == texts(11, 1)[0]  # choice 0 does not depend on n
    assert texts(11, 1) != texts(11 + 2**32, 1)
    assert texts(2**63 - 1, 1) == texts(2**63 - 1, 1)
