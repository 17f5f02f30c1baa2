"""Several models in one server, without a model: the eviction rule and the ModelSet's load, unload,
autoload and eviction with fake models (bytes only)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenloom.server.errors import APIError
from tokenloom.server.model_set import (
    Handle,
    ModelSet,
    ModelSpec,
    ModelTooLarge,
    Resident,
    parse_model_specs,
    plan_evictions,
)

# -- the eviction rule -----------------------------------------------------------------------------


def test_plan_evicts_least_recently_used_idle_until_it_fits():
    resident = [Resident("a", 400, 3.0, True), Resident("b", 300, 1.0, True), Resident("c", 200, 2.0, True)]
    assert plan_evictions(resident, 100, 1000, None) == []  # 900 + 100 fits
    assert plan_evictions(resident, 250, 1000, None) == ["b"]  # b is the least recently used
    assert plan_evictions(resident, 500, 1000, None) == ["b", "c"]
    assert plan_evictions(resident, 100, None, 2) == ["b", "c"]  # by count: 3 resident, 1 more allowed


def test_plan_never_evicts_busy_or_pinned_and_says_when_it_cannot_fit():
    resident = [Resident("busy", 600, 0.0, False), Resident("idle", 300, 5.0, True)]
    assert plan_evictions(resident, 300, 1000, None) == ["idle"]
    assert plan_evictions(resident, 500, 1000, None) is None  # only by evicting the busy one


def test_parse_model_specs_names_and_duplicates(tmp_path):
    f = tmp_path / "Qwen2.5-0.5B-Instruct.Q4_0.gguf"
    f.write_bytes(b"")
    specs = parse_model_specs([str(f), f"fast={f}"])
    assert specs == [ModelSpec("Qwen2.5-0.5B-Instruct", str(f)), ModelSpec("fast", str(f))]
    with pytest.raises(ValueError, match="two models are served as 'x'"):
        parse_model_specs([f"x={f}", f"x={f}"])


# -- the model set with fake models ----------------------------------------------------------------


class Fakes:
    def __init__(self, sizes: dict[str, int], fail: set[str] = frozenset()):
        self.sizes = sizes
        self.fail = set(fail)
        self.live: set[str] = set()
        self.loads: list[str] = []

    def loader(self, spec: ModelSpec) -> Handle:
        time.sleep(0.01)
        if spec.name in self.fail:
            raise OSError(f"cannot read {spec.source}")
        self.loads.append(spec.name)

        async def start():
            self.live.add(spec.name)

        async def stop(timeout: float):
            self.live.discard(spec.name)

        return Handle(object(), self.sizes[spec.name], start, stop)

    def model_set(self, estimates: dict[str, int] | None = None, **kwargs) -> ModelSet:
        specs = [ModelSpec(n, f"/m/{n}") for n in self.sizes]
        return ModelSet(specs, self.loader, estimates=estimates or dict(self.sizes), **kwargs)


def test_request_autoloads_and_evicts_lru_idle_within_budget():
    async def main():
        fakes = Fakes({"a": 500, "b": 400, "c": 300})
        models = fakes.model_set(budget=1000)
        for name in ("a", "b"):
            await models.release(await models.acquire(name))
        assert fakes.live == {"a", "b"}
        await models.release(await models.acquire("a"))  # a used last: b is the LRU
        await models.release(await models.acquire("c"))
        assert fakes.live == {"a", "c"} and models.evictions == 1
        assert models.slots["b"].status == "unloaded" and models.resident_bytes == 800 <= models.budget
        assert models.resident_bytes == sum(fakes.sizes[n] for n in fakes.live)

    asyncio.run(main())


def test_a_models_bytes_are_at_least_the_rss_its_load_added_and_loads_take_turns():
    async def main():
        fakes = Fakes({"a": 500, "b": 400, "c": 300})
        rss = {"now": 10_000, "loading": 0}
        loader = fakes.loader

        def growing(spec):  # "a" takes 700 bytes more than its tensors (its tokenizer, say)
            rss["loading"] += 1
            assert rss["loading"] == 1, "two loads at once: neither's RSS growth would be its own"
            time.sleep(0.02)
            handle = loader(spec)
            rss["now"] += handle.bytes + (700 if spec.name == "a" else 0)
            rss["loading"] -= 1
            return handle

        models = fakes.model_set(budget=2000, rss=lambda: rss["now"])
        models.loader = growing
        await asyncio.gather(*(models.load(n) for n in ("a", "b", "c")))
        assert {n: s.resident_bytes for n, s in models.slots.items()} == {"a": 1200, "b": 400, "c": 300}
        assert models.slots["a"].estimate == 1200  # its next load reserves what it really took

    asyncio.run(main())


def test_busy_and_pinned_models_are_never_evicted_and_a_load_waits_for_room():
    async def main():
        fakes = Fakes({"a": 600, "b": 600, "p": 100})
        models = fakes.model_set(budget=1200, pinned=("p",), load_wait_s=0.3)
        await models.release(await models.acquire("p"))
        held = await models.acquire("a")  # a request in flight on a
        with pytest.raises(APIError) as info:
            await models.acquire("b")  # only a could make room: it is busy, p is pinned
        assert info.value.status == 503 and "busy" in str(info.value)
        assert fakes.live == {"a", "p"}

        async def free_later():
            await asyncio.sleep(0.05)
            await models.release(held)

        models.load_wait_s = 5.0
        release = asyncio.create_task(free_later())
        slot = await models.acquire("b")  # waits until a is idle, then evicts it
        await release
        assert slot.status == "loaded" and fakes.live == {"b", "p"}
        await models.release(slot)

    asyncio.run(main())


def test_unload_drains_in_flight_requests_then_autoload_or_refusal():
    async def main():
        fakes = Fakes({"a": 100, "b": 100})
        models = fakes.model_set(budget=1000)
        held = await models.acquire("a")
        unloading = asyncio.create_task(models.unload("a"))
        await asyncio.sleep(0.05)
        assert "a" in fakes.live and models.slots["a"].status_json() == {"value": "loaded", "unloading": True}
        await models.release(held)
        await unloading
        assert "a" not in fakes.live and models.slots["a"].status == "unloaded"
        await models.release(await models.acquire("a"))  # autoload
        assert fakes.loads == ["a", "a"]
        models.autoload = False
        await models.unload("a")
        with pytest.raises(APIError) as info:
            await models.acquire("a")
        assert info.value.status == 400 and "`a` is unloaded" in str(info.value)

    asyncio.run(main())


def test_failed_model_keeps_its_reason_and_others_serve_unknown_is_404():
    async def main():
        fakes = Fakes({"bad": 100, "good": 100}, fail={"bad"})
        models = fakes.model_set(budget=1000)
        with pytest.raises(APIError) as info:
            await models.load("bad")
        assert info.value.status == 503
        assert models.slots["bad"].status_json() == {"value": "failed", "reason": "OSError: cannot read /m/bad"}
        with pytest.raises(APIError) as info:
            await models.acquire("bad")  # a request does not retry it: 503 with the reason
        assert info.value.status == 503 and "cannot read" in str(info.value)
        await models.release(await models.acquire("good"))
        for op in (models.load, models.unload, models.acquire):
            with pytest.raises(APIError) as info:
                await op("nope")
            assert info.value.status == 404 and info.value.code == "model_not_found"
        fakes.fail.clear()
        await models.load("bad")  # POST /models/load tries again
        assert models.slots["bad"].status == "loaded"

    asyncio.run(main())


def test_concurrent_load_and_unload_run_in_order_and_leak_nothing():
    async def main():
        fakes = Fakes({"a": 100})
        models = fakes.model_set(budget=1000)
        ops = [models.load("a"), models.unload("a"), models.load("a"), models.load("a"), models.unload("a")]
        results = await asyncio.gather(*ops)
        assert [r.name for r in results] == ["a"] * 5
        assert models.slots["a"].status == "unloaded" and fakes.live == set() and models.resident_bytes == 0
        assert fakes.loads == ["a", "a"]  # the second load of the pair was a no-op
        await asyncio.gather(models.unload("a"), models.load("a"))
        assert models.slots["a"].status == "loaded" and fakes.live == {"a"} and models.resident_bytes == 100

    asyncio.run(main())


def test_model_larger_than_the_budget_is_refused_with_the_numbers():
    with pytest.raises(ModelTooLarge, match=r"'big' \(/m/big\) needs 2000 bytes .* --memory-budget is 1000"):
        Fakes({"big": 2000}).model_set(budget=1000)


def test_start_up_loads_only_what_fits_beside_the_models_before_it():
    async def main():
        fakes = Fakes({"a": 500, "b": 600, "c": 400})
        # b's estimate is low (its files are smaller than what it takes once loaded): it loads, does not
        # fit beside a, and is unloaded again, a untouched; c fits by its estimate and its bytes.
        models = fakes.model_set(estimates={"a": 500, "b": 100, "c": 400}, budget=1000)
        for name in models.slots:
            await models.load(name, evict=False)
        assert fakes.live == {"a", "c"} and models.evictions == 0
        assert models.slots["b"].status == "unloaded" and models.slots["b"].estimate == 600
        assert models.resident_bytes == 900

    asyncio.run(main())


def test_a_request_that_goes_away_during_its_models_load_leaves_it_loaded_not_half_loaded():
    async def main():
        fakes = Fakes({"a": 100})
        models = fakes.model_set(budget=1000)
        waiting = asyncio.create_task(models.acquire("a"))
        await asyncio.sleep(0.002)  # the load is under way in its thread
        assert models.slots["a"].status == "loading"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        async with models.slots["a"].lock:  # the load ran to its end
            pass
        slot = models.slots["a"]
        assert slot.status == "loaded" and fakes.live == {"a"} and slot.inflight == 0 and models.resident_bytes == 100
        await models.unload("a")
        assert fakes.live == set() and models.resident_bytes == 0

    asyncio.run(main())


# -- --models-preset --------------------------------------------------------------------------------

def preset(tmp_path, text: str):
    from tokenloom.server.model_set import parse_models_preset
    from tokenloom.server.multi_flags import preset_flags

    path = tmp_path / "models.toml"
    path.write_text(text)
    return parse_models_preset(str(path), preset_flags)


def preset_models(tmp_path, text: str) -> list:
    return preset(tmp_path, text).models


def test_a_preset_gives_each_model_its_source_names_switches_and_own_flags(tmp_path):
    specs = preset_models(tmp_path, """
[chat]
source = "smollm2-135m"
aliases = ["default", "small"]
pin = true
quantization = "none"
max-model-len = 1024
enable_prefix_caching = false

[coder]
source = "qwen2.5-coder-0.5b"
load_on_startup = false
speculative_config = {method = "ngram", num_speculative_tokens = 3}
""")
    chat, coder = specs
    assert (chat.name, chat.source, chat.aliases, chat.pin, chat.load_on_startup) == (
        "chat", "smollm2-135m", ("default", "small"), True, True)
    assert dict(chat.flags) == {"quantization": "none", "max_model_len": 1024, "enable_prefix_caching": False}
    assert (coder.pin, coder.load_on_startup) == (False, False)
    assert dict(coder.flags)["speculative_config"] == '{"method": "ngram", "num_speculative_tokens": 3}'
    models = ModelSet(specs, lambda spec: None)
    assert models.slot("small") is models.slot("chat") and models.slots["chat"].pinned
    assert not models.slots["coder"].pinned
    with pytest.raises(APIError) as err:
        models.slot("coder2")
    assert err.value.status == 404


@pytest.mark.parametrize(("text", "says"), [
    ("", "no models"),
    ("[a]\nsource = ", "not TOML"),
    ("a = 1", "a table per model"),
    ("[a]\nquantization = 'int4'", "`source`"),
    ("[a]\nsource = 'x'\nport = 8001", "unknown key 'port'"),
    ("[a]\nsource = 'x'\nmodel = 'y'", "unknown key 'model'"),
    ("[a]\nsource = 'x'\nmax_model_len = 'long'", "invalid int value"),
    ("[a]\nsource = 'x'\nquantization = 'q9'", "invalid choice"),
    ("[a]\nsource = 'x'\nenable_prefix_caching = 3", "`enable_prefix_caching` must be true or false"),
    ("[a]\nsource = 'x'\npin = 'yes'", "`pin` must be true or false"),
    ("[a]\nsource = 'x'\naliases = 'b'", "`aliases` must be a list"),
    ("[a]\nsource = 'x'\n[b]\nsource = 'y'\naliases = ['a']", "two models are served as 'a'"),
    ("[a]\nsource = 'x'\ntiers = ['a', 'b']", "a model .* or a cascade .*, not both"),
])
def test_a_bad_preset_is_one_clear_error_naming_the_file_and_table(tmp_path, text, says):
    with pytest.raises(ValueError, match=says) as err:
        preset(tmp_path, text)
    assert "--models-preset" in str(err.value)


PRESET_WITH_CASCADE = """
[small]
source = "x.gguf"
[large]
source = "y.gguf"
[coder]
tiers = ["small", "large"]
threshold = 1
k = 8
"""


def test_a_preset_table_with_tiers_is_a_cascade_checked_as_the_flag_is(tmp_path):
    from tokenloom.server.cascade_config import parse_cascades

    got = preset(tmp_path, PRESET_WITH_CASCADE)
    assert [m.name for m in got.models] == ["small", "large"]
    flagged = parse_cascades(["fast=large,small;signal=min_top1"], {"small": "x", "large": "y"}, got.cascades)
    by_name = {c.name: c for c in flagged}
    assert by_name["coder"].tiers == ("small", "large") and by_name["coder"].options == {"threshold": 1.0, "k": 8}
    assert by_name["fast"].options == {"signal": "min_top1"}


@pytest.mark.parametrize(("table", "says"), [
    ("tiers = 'small'", "`tiers` must be a list"),
    ("tiers = ['small']", "at least two tiers"),
    ("tiers = ['small', 'nope']", "tier 'nope' is not a served model"),
    ("tiers = ['small', 'coder']", "names itself"),
    ("tiers = ['small', 'large']\nthreshold = true", "`threshold` must be a number"),
    ("tiers = ['small', 'large']\nk = 2.5", "`k` must be an integer"),
    ("tiers = ['small', 'large']\nport = 1", "unknown key `port` for a cascade"),
])
def test_a_bad_preset_cascade_names_the_file_table_and_key(tmp_path, table, says):
    from tokenloom.server.cascade_config import parse_cascades

    got = preset(tmp_path, "[small]\nsource = 'x'\n[large]\nsource = 'y'\n[coder]\n" + table)
    with pytest.raises(ValueError, match=says) as err:
        parse_cascades(None, {"small": "x", "large": "y"}, got.cascades)
    assert "--models-preset" in str(err.value) and "[coder]" in str(err.value)


def test_a_missing_preset_file_is_one_clear_error(tmp_path):
    from tokenloom.server.model_set import parse_models_preset
    from tokenloom.server.multi_flags import preset_flags

    with pytest.raises(ValueError, match="cannot read .*nope.toml"):
        parse_models_preset(str(tmp_path / "nope.toml"), preset_flags)


# -- idleness: --sleep-idle-seconds and a request's keep_alive -------------------------------------

def test_idle_models_sleep_after_their_keep_alive_and_pinned_or_busy_ones_never():
    async def main():
        fakes = Fakes({"a": 100, "b": 100, "c": 100, "p": 100})
        models = fakes.model_set(sleep_idle_s=0.3, pinned=("p",))
        sleeper = asyncio.create_task(models.run_sleeper(period=0.05))
        try:
            for name in "abcp":
                await models.release(await models.acquire(name))
            busy = await models.acquire("b")  # in flight: never sleeps
            await models.release(await models.acquire("c"), keep_alive=-1)  # kept until evicted
            await asyncio.sleep(0.6)
            assert fakes.live == {"b", "c", "p"} and models.sleeps == 1  # a slept after 0.3 s idle
            await models.release(busy, keep_alive=0)  # once idle: at once
            await asyncio.sleep(0.2)
            assert fakes.live == {"c", "p"} and models.slots["b"].status == "unloaded"
            await models.release(await models.acquire("b"))  # asked for again: autoloaded, the set's rule again
            assert models.slots["b"].keep_alive is None and "b" in fakes.live
            await asyncio.sleep(0.6)
            assert fakes.live == {"c", "p"} and models.sleeps == 3
        finally:
            sleeper.cancel()

    asyncio.run(main())


def test_without_a_rule_nothing_sleeps_but_a_request_can_ask():
    async def main():
        fakes = Fakes({"a": 100, "b": 100})
        models = fakes.model_set()
        sleeper = asyncio.create_task(models.run_sleeper(period=0.05))
        try:
            await models.release(await models.acquire("a"))
            await models.release(await models.acquire("b"), keep_alive=0.1)
            await asyncio.sleep(0.4)
            assert fakes.live == {"a"}
        finally:
            sleeper.cancel()

    asyncio.run(main())


def test_requests_that_wait_for_their_models_load_are_counted():
    async def main():
        fakes = Fakes({"a": 100})
        models = fakes.model_set()
        await models.release(await models.acquire("a"))  # autoloaded: waited
        await models.release(await models.acquire("a"))  # resident: did not
        slot = models.slots["a"]
        assert slot.load_waits == 1 and 0 < slot.load_wait_seconds < 5

    asyncio.run(main())


def test_a_request_that_comes_in_as_its_model_is_put_to_sleep_keeps_it():
    async def main():
        fakes = Fakes({"a": 100})
        models = fakes.model_set(sleep_idle_s=0)
        await models.release(await models.acquire("a"))
        slot = models.slots["a"]
        assert models.sleep_due(slot, time.monotonic()) is not None  # due: the sleeper would take it ...
        held = await models.acquire("a")  # ... but a request acquires it first
        await models._sleep(slot)
        assert slot.status == "loaded" and "a" in fakes.live and models.sleeps == 0  # neither drained nor aborted
        await models.release(held)
        await models._sleep(slot)
        assert slot.status == "unloaded" and models.sleeps == 1

    asyncio.run(main())


# -- the dashboard's overview of every model and cascade ---------------------------------------------

def test_the_dashboard_overview_shows_every_model_its_batch_and_each_cascade():
    from types import SimpleNamespace

    from tokenloom.engine.stats import EngineStats
    from tokenloom.server.cascade import Cascade, CascadeMetrics
    from tokenloom.server.cascade_config import CascadeSpec
    from tokenloom.server.multi_serve import overview

    async def main():
        fakes = Fakes({"a": 100, "b": 200})
        models = fakes.model_set(budget=1000)
        slot = await models.acquire("a")
        slot.handle.metrics = SimpleNamespace(latest=EngineStats(3, 2, 0, 0.25, 0, 0, 0))  # as its engine published
        metrics = CascadeMetrics()
        cascades = {"c": Cascade(CascadeSpec("c", ("a", "b")), metrics)}
        metrics.requests.labels("c").inc(3)
        metrics.answered.labels("c", "a").inc(2)
        metrics.answered.labels("c", "b").inc()
        metrics.escalations.labels("c", "a", "low_confidence").inc()
        metrics.tokens.labels("c", "a", "completion").inc(40)
        view = overview(models, cascades, metrics)
        a, b = view["models"]
        assert (a["name"], a["status"], a["resident_bytes"], a["in_flight"]) == ("a", "loaded", 100, 1)
        assert (a["running"], a["waiting"], a["kv_usage"]) == (3, 2, 0.25)
        assert (b["status"], b["resident_bytes"]) == ("unloaded", 0) and "running" not in b
        assert (view["resident_bytes"], view["budget_bytes"], view["evictions"]) == (100, 1000, 0)
        assert view["cascades"] == [{"name": "c", "tiers": ["a", "b"], "requests": 3, "answered": {"a": 2, "b": 1},
                                     "escalations": {"low_confidence": 1}, "completion_tokens": {"a": 40}}]
        await models.release(slot)

    asyncio.run(main())
