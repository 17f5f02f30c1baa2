"""Several models behind one server (issue 54): which are resident, loading them on demand, evicting
by bytes, and the requests in flight on each.

Statuses (llama.cpp router's names): `unloaded` (configured, not in memory), `loading`, `loaded`,
`failed` (the load raised: its reason kept; a request for it answers 503 naming the reason, and
`POST /models/load` tries again). A loaded model being unloaded stays `loaded` with `"unloading": true`
until its in-flight requests drained; requests arriving meanwhile wait and then load it again.

Residency: every resident model counts its bytes (its weights and KV pool, a draft model's and the
adapters loaded with it, measured once loaded, and at least the process's RSS growth over its load,
which also holds its tokenizer; before, the estimate of `estimate_bytes`: the weight files plus the KV
pool the flags give). Loading a
model evicts least-recently-used idle models (`plan_evictions`) until the resident bytes plus its own
fit the memory budget and at most `models_max` are resident; a pinned model, or one with requests in
flight (or in a load or unload), is never evicted. When not enough can be evicted now, the load waits
for models to become idle (up to `LOAD_WAIT_S`, then 503 + Retry-After). A model whose bytes exceed the
whole budget is refused (at start, with the numbers). Its prefix cache goes with an evicted model.

Idleness: a model idle (no request in flight) past its keep-alive is unloaded by `run_sleeper`, as
llama.cpp's `--sleep-idle-seconds` and Ollama's `keep_alive` do. Its keep-alive is the last finished
request's `keep_alive` (seconds: 0 unloads it once idle, a negative one keeps it until evicted to make
room), else the set's `sleep_idle_s` (None: never). It then shows `unloaded`, and the next request
autoloads it. A pinned model never sleeps.

Everything here runs on the event loop (the loads themselves in a worker thread); a per-model lock
serialises its load and unload, so concurrent load and unload of one model run in arrival order and
the last one decides the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import APIError

if TYPE_CHECKING:
    from ..model.lora import LoRARequest

logger = logging.getLogger("tokenloom.server.models")

LOAD_WAIT_S = 120.0  # a load waits this long for busy models to become evictable, then 503
STATUSES = ("unloaded", "loading", "loaded", "failed")


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the served name (a request's `model`)
    source: str  # a catalog name, GGUF file or HF directory
    aliases: tuple[str, ...] = ()  # more names it answers to
    flags: tuple[tuple[str, object], ...] = ()  # its own engine flags (argparse dests), over the command line's
    pin: bool = False  # never evicted
    load_on_startup: bool = True  # loaded at start if it fits beside the ones before it
    lora_modules: tuple[LoRARequest, ...] = ()  # its adapters (a preset's `lora_modules`), served by name

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(r.lora_name for r in self.lora_modules)

    def loads_like(self, other: ModelSpec) -> bool:
        """Does `other` load the same bytes (source, engine flags, adapters; names aside)?"""
        return (self.source, self.flags, self.lora_modules) == (other.source, other.flags, other.lora_modules)


def parse_model_specs(tags: list[str]) -> list[ModelSpec]:
    """`serve A B NAME=SOURCE`: each a source (served under its default name) or NAME=SOURCE."""
    from ..model.catalog import CATALOG
    from .loading import default_served_name

    specs: list[ModelSpec] = []
    for tag in tags:
        name, sep, source = tag.partition("=")
        if not sep or os.path.exists(tag) or not name or not source:
            name, source = "", tag
        if not name:
            name = source if source in CATALOG and not os.path.exists(source) else default_served_name(source, source)
        specs.append(ModelSpec(name, source))
    return check_names(specs)


def check_names(specs: list[ModelSpec]) -> list[ModelSpec]:
    """`specs`, if no served name (alias, adapter) is given twice; a ValueError naming it otherwise."""
    seen: dict[str, str] = {}
    for spec in specs:
        for name in (*spec.names, *spec.adapters):
            if name in seen:
                raise ValueError(f"two models are served as {name!r} ({seen[name]} and {spec.source}); "
                                 "name one with NAME=SOURCE (or its preset table)")
            seen[name] = spec.source
    return specs


PRESET_KEYS = ("source", "aliases", "pin", "load_on_startup", "lora_modules")  # the rest are engine flags


@dataclass
class Preset:
    models: list[ModelSpec]
    cascades: list[tuple[str, str, dict]]  # (where, name, table): checked by cascade_config.parse_cascades


def parse_models_preset(path: str, parse_flags: Callable[[str, dict], dict]) -> Preset:
    """`--models-preset FILE`: a TOML table per model, named by its served name, in the file's order:
    `source` (required), `aliases`, `pin`, `load_on_startup`, `lora_modules` (as `--lora-modules`), and
    its own engine flags (`parse_flags` checks them as the command line would, naming the table and the
    key). A table with `tiers` instead
    of `source` is a cascade (as `--cascade NAME=...`). Errors name the file."""
    import tomllib

    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--models-preset: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models-preset {path}: not TOML ({exc})") from None
    if not tables:
        raise ValueError(f"--models-preset {path}: no models (a [NAME] table per model)")
    specs, cascades = [], []
    for name, table in tables.items():
        where = f"--models-preset {path}: [{name}]"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: a table per model ([{name}] with source = ...), got a {type(table).__name__}")  # noqa: TRY004 - the CLI's one-line errors
        if "tiers" in table:
            if "source" in table:
                raise ValueError(f"{where}: a model (`source`) or a cascade (`tiers`), not both")
            cascades.append((where, name, table))
            continue
        source = table.get("source")
        if not isinstance(source, str) or not source:
            raise ValueError(f"{where}: `source` (a catalog name, GGUF file or HF directory) is required")
        aliases = table.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ValueError(f"{where}: `aliases` must be a list of names")
        switches = {key: table.get(key, default) for key, default in (("pin", False), ("load_on_startup", True))}
        for key, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(f"{where}: `{key}` must be true or false, got {value!r}")  # noqa: TRY004 - as above
        flags = parse_flags(where, {k: v for k, v in table.items() if k not in PRESET_KEYS})
        adapters = _preset_adapters(where, table.get("lora_modules", []))
        specs.append(ModelSpec(name, source, tuple(aliases), tuple(flags.items()), **switches, lora_modules=adapters))
    try:
        return Preset(check_names(specs), cascades)
    except ValueError as exc:
        raise ValueError(f"--models-preset {path}: {exc}") from None


def _preset_adapters(where: str, values) -> tuple[LoRARequest, ...]:
    """A table's `lora_modules`: a list as `--lora-modules` takes them, each "NAME=PATH" or a table
    {name = ..., path = ...} (the flag's JSON form)."""
    import json

    from .lora_routes import parse_lora_modules

    if not isinstance(values, list) or not all(isinstance(v, (str, dict)) for v in values):
        raise ValueError(f"{where}: `lora_modules` must be a list of \"NAME=PATH\" or {{name = ..., path = ...}}")
    try:
        return tuple(parse_lora_modules([v if isinstance(v, str) else json.dumps(v, default=str) for v in values]))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclass
class Resident:
    """What the eviction rule sees of a resident model."""
    name: str
    bytes: int
    last_used: float
    evictable: bool  # idle, not pinned, not in a load or unload


def plan_evictions(resident: list[Resident], need_bytes: int, budget: int | None,
                   models_max: int | None) -> list[str] | None:
    """The models to evict, least recently used first, so that one more model of `need_bytes` fits
    `budget` bytes and `models_max` models; [] when it fits already; None when it cannot fit even with
    every evictable model gone (then the caller waits for busy ones, or refuses)."""
    total = sum(r.bytes for r in resident)
    count = len(resident)

    def fits() -> bool:
        return (budget is None or total + need_bytes <= budget) and (models_max is None or count + 1 <= models_max)

    evict: list[str] = []
    for r in sorted((r for r in resident if r.evictable), key=lambda r: r.last_used):
        if fits():
            break
        evict.append(r.name)
        total -= r.bytes
        count -= 1
    return evict if fits() else None


def estimate_bytes(paths: list[str], kv_cache_bytes: int) -> int:
    """Bytes a model will hold before it is loaded: the weight files of its `paths` (the model's, its
    adapters' and a draft's: a GGUF file, or a directory's safetensors / bin files; packed int4 from a
    wider file is smaller, so this errs high) plus its KV pool."""
    total = kv_cache_bytes
    for path in map(Path, paths):
        if path.is_dir():
            total += sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
        elif path.exists():
            total += path.stat().st_size
    return total


class ModelTooLarge(ValueError):
    pass


@dataclass
class Handle:
    """A loaded model as the set drives it: its ASGI app, `start()` / `stop(timeout)` (its engine
    thread), its measured bytes and health. Real ones come from multi_serve.py; tests pass fakes."""
    app: object
    bytes: int
    start: Callable
    stop: Callable
    health_problem: Callable[[], str | None] = lambda: None
    info: dict = field(default_factory=dict)  # extra /v1/models fields (max_model_len, root)
    metrics: object | None = None
    adapters: Callable[[], dict[str, str]] = dict  # name -> path of the adapters it serves now (run-time ones too)
    unfaulted: int = 0  # bytes it holds whose pages are not resident yet at its load (its KV pools')


@dataclass
class ModelSlot:
    spec: ModelSpec
    estimate: int = 0  # bytes before it is loaded
    status: str = "unloaded"
    reason: str | None = None
    handle: Handle | None = None
    pinned: bool = False
    last_used: float = 0.0
    inflight: int = 0
    unloading: bool = False
    loads: int = 0
    load_seconds: float = 0.0
    keep_alive: float | None = None  # seconds idle before it sleeps, from the last request (None: the set's)
    load_waits: int = 0  # requests that waited for a load or unload of this model
    load_wait_seconds: float = 0.0  # the time they waited, summed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def resident_bytes(self) -> int:
        if self.status == "loaded" and self.handle is not None:
            return self.handle.bytes
        return self.estimate if self.status == "loading" else 0  # a load in progress holds its estimate

    def status_json(self) -> dict:
        out: dict = {"value": self.status}
        if self.reason:
            out["reason"] = self.reason
        if self.unloading:
            out["unloading"] = True
        return out


class ModelSet:
    def __init__(self, specs: list[ModelSpec], loader: Callable[[ModelSpec], Handle], *,
                 estimates: dict[str, int] | None = None, budget: int | None = None,
                 models_max: int | None = None, autoload: bool = True, drain_timeout: float = 30.0,
                 pinned: tuple[str, ...] = (), load_wait_s: float = LOAD_WAIT_S, collect: Callable | None = None,
                 sleep_idle_s: float | None = None, rss: Callable[[], int] | None = None):
        """`collect`: run in a worker thread once a stopped model's handle is dropped (the real server's
        garbage collection of the engine, multi_serve.py). `rss`: the process's resident bytes now; a
        model's bytes are then at least what its load added to them (its tokenizer, its engine's other
        buffers: more than the tensors `Handle.bytes` counts)."""
        self.slots = {s.name: ModelSlot(s, (estimates or {}).get(s.name, 0), pinned=s.name in pinned or s.pin)
                      for s in specs}
        # every served name, alias and adapter -> its model's slot (a request for an adapter loads its model)
        self.names = {name: s.name for s in specs for name in (*s.names, *s.adapters)}
        self.default, self.loader, self.evictions = specs[0].name, loader, 0
        self.budget, self.models_max = budget, models_max  # residency: bytes, and a count (None: no limit)
        self.autoload, self.drain_timeout, self.load_wait_s = autoload, drain_timeout, load_wait_s
        self.collect, self.sleep_idle_s, self.sleeps = collect, sleep_idle_s, 0
        self._room = asyncio.Lock()  # one eviction decision at a time
        self._changed = asyncio.Condition()  # a model went idle or left memory
        self._memory = asyncio.Lock()  # one load or freeing at a time, so a load's RSS growth is its own
        self.rss = rss
        for slot in self.slots.values():
            self.check_fits(slot, slot.estimate)

    # -- lookups ----------------------------------------------------------------------------------

    def slot(self, name: str | None) -> ModelSlot:
        key = self.names.get(self.default if name is None else name)
        if key is None:  # an adapter loaded at run time into a resident model (it goes with the model)
            key = next((s.name for s in self.slots.values() if s.handle is not None and name in s.handle.adapters()),
                       None)
        slot = self.slots.get(key or "")
        if slot is None:
            raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(self.slots)}",
                           "invalid_request_error", "model", "model_not_found")
        return slot

    @property
    def resident_bytes(self) -> int:
        return sum(s.resident_bytes for s in self.slots.values())

    def check_fits(self, slot: ModelSlot, nbytes: int) -> None:
        if self.budget is not None and nbytes > self.budget:
            raise ModelTooLarge(f"model {slot.name!r} ({slot.spec.source}) needs {nbytes} bytes (weights, KV pool, "
                                f"draft, adapters) but --memory-budget is {self.budget} bytes")

    # -- requests ---------------------------------------------------------------------------------

    async def acquire(self, name: str | None, autoload: bool = True) -> ModelSlot:
        """The model a request names, loaded (autoloading it unless `autoload` is false or the server was
        started with --no-models-autoload), with the request counted in flight until `release`; raises
        APIError (404 unknown, 400 not loaded and not to be loaded, 503 failed / no room)."""
        slot = self.slot(name)
        started, waited = time.monotonic(), False
        while True:
            if slot.status == "loaded" and not slot.unloading and not slot.lock.locked():
                slot.inflight += 1
                slot.last_used = time.monotonic()
                if waited:
                    slot.load_waits += 1
                    slot.load_wait_seconds += slot.last_used - started
                return slot
            waited = True
            if slot.status == "loaded" or slot.status == "loading" or slot.lock.locked():
                async with slot.lock:  # a load or unload in progress: wait for it, then look again
                    pass
                if slot.status == "loaded" and not slot.unloading:
                    continue
            if not (self.autoload and autoload):
                why = "--no-models-autoload is set" if not self.autoload else "only a generation request loads one"
                raise APIError(400, f"model `{slot.name}` is {slot.status} and {why}; load it with POST /models/load",
                               "invalid_request_error", "model", "model_not_loaded")
            if slot.status == "failed":
                raise APIError(503, f"model `{slot.name}` failed to load: {slot.reason}; retry with POST /models/load",
                               "server_error", "model", "model_load_failed")
            await self.load(slot.name)

    async def release(self, slot: ModelSlot, keep_alive: float | None = None) -> None:
        """A request on `slot` finished; `keep_alive` (its field, seconds) sets how long the model may
        then stay idle before it sleeps (see the module's docstring)."""
        slot.inflight -= 1
        slot.last_used = time.monotonic()
        if keep_alive is not None:
            slot.keep_alive = keep_alive
        if slot.inflight == 0:
            await self._notify()

    def sleep_due(self, slot: ModelSlot, now: float) -> float | None:
        """When `slot` is to sleep (monotonic seconds; None: not while it is as it is)."""
        keep = slot.keep_alive if slot.keep_alive is not None else self.sleep_idle_s
        if (keep is None or keep < 0 or slot.pinned or slot.status != "loaded" or slot.inflight
                or slot.unloading or slot.lock.locked()):
            return None
        return slot.last_used + keep

    async def run_sleeper(self, period: float = 1.0) -> None:
        """Unload each model once idle past its keep-alive; runs until cancelled (the front's lifespan)."""
        while True:
            now = time.monotonic()
            for slot in list(self.slots.values()):
                due = self.sleep_due(slot, now)
                if due is not None and due <= now:
                    try:
                        await _unstoppable(self._sleep(slot))
                    except Exception:
                        logger.exception("model %s: unloading it for idleness failed", slot.name)
            await asyncio.sleep(period)

    async def _sleep(self, slot: ModelSlot) -> None:
        """Unload `slot` for idleness, if it is still idle once its lock is held (a request that came in
        meanwhile keeps it: never drained nor aborted, unlike `unload`)."""
        async with slot.lock:
            if slot.status != "loaded" or slot.inflight or slot.pinned or slot.unloading:
                return
            logger.info("model %s idle for %.0f s: unloaded (it loads again when asked for)",
                        slot.name, time.monotonic() - slot.last_used)
            self.sleeps += 1
            slot.keep_alive = None  # the next load starts from the set's rule again
            await self._stop(slot, 0.0)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- load and unload --------------------------------------------------------------------------

    async def load(self, name: str | None, evict: bool = True) -> ModelSlot:
        """Load a model (no-op when loaded); raises APIError when it fails (the slot then `failed`).
        `evict=False` (the start-up loads): only if it fits beside the resident ones, else left unloaded.
        A caller that goes away (a client disconnecting while its model loads) does not stop the load:
        it runs to its end in a task of its own, so no half-loaded model is left behind."""
        return await _unstoppable(self._load(self.slot(name), evict))

    async def unload(self, name: str | None) -> ModelSlot:
        """Unload a model once its in-flight requests finished (up to `drain_timeout`, then they are
        aborted with an error); a failed model goes back to `unloaded`. Runs to its end, as `load`."""
        return await _unstoppable(self._unload(self.slot(name)))

    async def _load(self, slot: ModelSlot, evict: bool) -> ModelSlot:
        async with slot.lock:
            if slot.status == "loaded":
                return slot
            if not evict and plan_evictions(self._residents(exclude=slot), slot.estimate, self.budget,
                                            self.models_max) != []:
                logger.info("model %s (%d bytes) does not fit beside the resident models: left unloaded",
                            slot.name, slot.estimate)
                return slot
            await self._make_room(slot, slot.estimate)
            slot.status, slot.reason = "loading", None
            started = time.monotonic()
            try:
                async with self._memory:
                    before = self.rss() if self.rss is not None else 0
                    handle = await asyncio.to_thread(self.loader, slot.spec)
                    try:
                        await handle.start()
                    except BaseException:
                        await handle.stop(0.0)
                        raise
                    if self.rss is not None:  # what the load made resident, and the pages it will touch
                        handle.bytes = max(handle.bytes, self.rss() - before + handle.unfaulted)
            except Exception as exc:  # noqa: BLE001 - the model is `failed`, the others keep serving
                slot.status, slot.reason = "failed", f"{type(exc).__name__}: {exc}"
                logger.error("model %s failed to load: %s", slot.name, slot.reason)
                if self.collect is not None:  # what the failed load built (frozen by the engine build) goes
                    async with self._memory:
                        await asyncio.to_thread(self.collect)
                await self._notify()
                raise APIError(503, f"model `{slot.name}` failed to load: {slot.reason}", "server_error",
                               "model", "model_load_failed") from None
            slot.handle, slot.status = handle, "loaded"
            slot.loads += 1
            slot.load_seconds = time.monotonic() - started
            slot.last_used = time.monotonic()
            for same in self.slots.values():  # the next load of this model reserves what it really took
                if same.spec.loads_like(slot.spec):
                    same.estimate = handle.bytes
            logger.info("model %s loaded in %.1fs: %d bytes resident (%d in all%s)", slot.name, slot.load_seconds,
                        handle.bytes, self.resident_bytes, f" of {self.budget}" if self.budget else "")
            over = self.budget is not None and self.resident_bytes > self.budget
            if over and not evict:
                logger.info("model %s took %d bytes, more than the room beside the resident models: unloaded again",
                            slot.name, handle.bytes)
                del handle  # `_stop` drops the last reference, so the collection frees it
                await self._stop(slot, 0.0)
                return slot
            if over and not await self._evict_for_overrun(slot):
                reason = (f"resident {handle.bytes} bytes, with the others' {self.resident_bytes - handle.bytes}, "
                          f"exceed --memory-budget {self.budget}")
                del handle
                await self._stop(slot, 0.0)
                slot.status, slot.reason = "failed", reason
                raise APIError(503, f"model `{slot.name}`: {reason}", "server_error", "model", "model_load_failed")
            return slot

    async def _unload(self, slot: ModelSlot) -> ModelSlot:
        async with slot.lock:
            if slot.status == "failed":
                slot.status, slot.reason = "unloaded", None
            if slot.status != "loaded":
                return slot
            slot.unloading = True
            try:
                deadline = time.monotonic() + self.drain_timeout
                async with self._changed:
                    while slot.inflight > 0 and (left := deadline - time.monotonic()) > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), left)
                await self._stop(slot, max(deadline - time.monotonic(), 0.0))
            finally:
                slot.unloading = False
            return slot

    async def _stop(self, slot: ModelSlot, timeout: float) -> None:
        started = time.monotonic()
        handle, slot.handle = slot.handle, None
        slot.status = "unloaded"
        if handle is not None:
            async with self._memory:
                await handle.stop(timeout)
                del handle  # the last reference to the model's app and engine
                if self.collect is not None:
                    await asyncio.to_thread(self.collect)
        await self._notify()
        logger.info("model %s unloaded in %.2fs (%d bytes resident in all)", slot.name, time.monotonic() - started,
                    self.resident_bytes)

    async def _make_room(self, slot: ModelSlot, need: int) -> None:
        """Evict least-recently-used idle models until `need` more bytes fit (waits for busy ones)."""
        self.check_fits(slot, need)
        deadline = time.monotonic() + self.load_wait_s
        while True:
            async with self._room:
                plan = plan_evictions(self._residents(exclude=slot), need, self.budget, self.models_max)
                if plan is not None:
                    for name in plan:
                        await self._evict(self.slots[name])
                    if plan_evictions(self._residents(exclude=slot), need, self.budget, self.models_max) == []:
                        slot.status = "loading"  # reserve its bytes before the room lock goes
                        return
                    continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(503, f"model `{slot.name}` needs {need} bytes; the resident models are busy "
                               f"({self.resident_bytes} of {self.budget} bytes); retry later", "server_error",
                               "model", "model_no_room", headers={"Retry-After": "5"})
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    async def _evict_for_overrun(self, slot: ModelSlot) -> bool:
        async with self._room:
            plan = plan_evictions(self._residents(exclude=slot), slot.handle.bytes, self.budget, self.models_max)
            for name in plan or ():
                await self._evict(self.slots[name])
            return plan is not None

    async def _evict(self, slot: ModelSlot) -> None:
        async with slot.lock:
            if slot.status == "loaded" and slot.inflight == 0 and not slot.pinned:
                logger.info("evicting model %s (least recently used, idle) to make room", slot.name)
                self.evictions += 1
                await self._stop(slot, 0.0)

    def _residents(self, exclude: ModelSlot) -> list[Resident]:
        return [Resident(s.name, s.resident_bytes, s.last_used,
                         s.status == "loaded" and s.inflight == 0 and not s.pinned and not s.unloading
                         and not s.lock.locked())
                for s in self.slots.values() if s is not exclude and s.status in ("loaded", "loading")]

    async def close(self, timeout: float) -> None:
        """Stop every resident model (the server's shutdown), together, within `timeout`."""
        await asyncio.gather(*(self._stop(s, timeout) for s in self.slots.values() if s.handle is not None))

    # -- views ------------------------------------------------------------------------------------

    def describe(self, paths: bool = False) -> list[dict]:
        """Every configured model; `paths` (the operator's --metrics-token): `root` is its file, else its name."""
        from .state import now_s

        def info(s: ModelSlot) -> dict:
            out = dict(s.handle.info) if s.handle else {"root": s.spec.source}
            return out if paths else out | {"root": s.name}

        listed = []
        for s in self.slots.values():
            listed.append({"id": s.name, "object": "model", "created": now_s(), "owned_by": "tokenloom", **info(s),
                           "status": s.status_json(), "resident_bytes": s.resident_bytes, "estimated_bytes": s.estimate,
                           "pinned": s.pinned, "requests_in_flight": s.inflight})
            # its adapters as `serve MODEL` lists them: with their model as `parent`, paths for the operator
            adapters = s.handle.adapters() if s.handle is not None else {r.lora_name: r.lora_path
                                                                         for r in s.spec.lora_modules}
            for adapter, path in adapters.items():
                listed.append({"id": adapter, "object": "model", "created": now_s(), "owned_by": "tokenloom",
                               "root": path if paths else adapter, **({"lora_path": path} if paths else {}),
                               "parent": s.name, "status": s.status_json(),
                               **({"max_model_len": s.handle.info["max_model_len"]}
                                  if s.handle is not None and "max_model_len" in s.handle.info else {})})
        return listed



async def _unstoppable(coro):
    """`coro` in a task that a cancelled caller does not cancel (its error retrieved either way)."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)
