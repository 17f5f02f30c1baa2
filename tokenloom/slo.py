"""Service-level objectives: what a request's latency must be, where that comes from, and whether it was met.

An `SLO` holds up to three targets in milliseconds, each optional: `ttft_ms` (arrival to first token),
`tpot_ms` (time per output token after the first) and `e2e_ms` (arrival to last token). Definitions are
the load generator's (`bench/serving_metrics.py`, vLLM's): TPOT = (E2E - TTFT) / (output tokens - 1);
a request with at most one output token has TPOT 0. A target that is not set is met; a request meets
"both" when it meets TTFT and TPOT (and E2E, when set) — goodput counts those.

Where a request's SLO comes from, first match wins per field: the body's `slo` object (`ttft_ms`,
`tpot_ms`, `e2e_ms`, and `class`), the class it names, the class of its tenant in the `--slo-classes`
file, that file's `default_class`, the server's `--slo-ttft-ms` / `--slo-tpot-ms` / `--slo-e2e-ms`.

The classes file (JSON), e.g.::

    {"classes": {"interactive": {"ttft_ms": 1000, "tpot_ms": 100},
                 "batch": {"ttft_ms": 60000, "e2e_ms": 600000}},
     "tenants": {"alice": "interactive", "nightly-etl": "batch"},
     "default_class": "interactive"}

A tenant is the request's `user` field. Every value is checked (a finite number of ms in (0, 1 h]).
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field

MAX_SLO_MS = 3_600_000.0  # one hour: a larger target is a typo, not an objective
SLO_FIELDS = ("ttft_ms", "tpot_ms", "e2e_ms")
ATTAINMENT_KINDS = ("ttft", "tpot", "both")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in SLO_FIELDS)

    def over(self, base: SLO | None) -> SLO:
        """This SLO's fields, the unset ones taken from `base`."""
        if base is None:
            return self
        return SLO(*(getattr(self, f) if getattr(self, f) is not None else getattr(base, f) for f in SLO_FIELDS))

    def attained(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> dict[str, bool]:
        """Which targets a finished request met: {"ttft", "tpot", "both"} (both = every target set).
        `ttft_s` None (no token ever came) misses a TTFT target; `tpot_s` None (at most one output token)
        counts as TPOT 0, as the load generator counts it."""

        def ok(target_ms: float | None, value_s: float | None) -> bool:
            return target_ms is None or (value_s is not None and value_s * 1000 <= target_ms)

        ttft = ok(self.ttft_ms, ttft_s)
        tpot = ok(self.tpot_ms, 0.0 if tpot_s is None else tpot_s)
        return {"ttft": ttft, "tpot": tpot, "both": ttft and tpot and ok(self.e2e_ms, e2e_s)}


def slo_number(name: str, value) -> float:
    """A target in ms: a finite number in (0, MAX_SLO_MS]; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 < value <= MAX_SLO_MS:
        raise ValueError(f"{name}: must be a finite number of milliseconds in (0, {MAX_SLO_MS:g}], got {value!r}")
    return float(value)


def parse_slo(value, name: str = "slo") -> tuple[SLO, str | None]:
    """A request's `slo` object -> (its targets, the class it names or None)."""
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be an object with ttft_ms, tpot_ms, e2e_ms or class, got {value!r}")  # noqa: TRY004 - a 400
    unknown = sorted(set(value) - {*SLO_FIELDS, "class"})
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: unknown field (known: class, {', '.join(SLO_FIELDS)})")
    targets = {f: slo_number(f"{name}.{f}", value[f]) for f in SLO_FIELDS if value.get(f) is not None}
    cls = value.get("class")
    if cls is not None and not isinstance(cls, str):
        raise ValueError(f"{name}.class: must be a class name (a string), got {cls!r}")
    return SLO(**targets), cls


@dataclass
class SLOPolicy:
    """The server's SLO sources: its defaults, the classes and which tenant has which (see module doc)."""

    default: SLO = field(default_factory=SLO)
    classes: dict[str, SLO] = field(default_factory=dict)
    tenants: dict[str, str] = field(default_factory=dict)
    default_class: str | None = None

    @classmethod
    def from_file(cls, path: str, default: SLO | None = None) -> SLOPolicy:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"slo_classes: cannot read {path}: {exc}") from None
        return cls.from_dict(data, default)

    @classmethod
    def from_dict(cls, data, default: SLO | None = None) -> SLOPolicy:
        if not isinstance(data, dict) or set(data) - {"classes", "tenants", "default_class"}:
            raise ValueError("slo_classes: must be an object of classes, tenants and default_class")
        classes_in = data.get("classes", {})
        if not isinstance(classes_in, dict):
            raise ValueError("slo_classes.classes: must map class names to SLO objects")  # noqa: TRY004 - by name
        classes = {}
        for name, spec in classes_in.items():
            slo, named = parse_slo(spec, f"slo_classes.classes.{name}")
            if named is not None:
                raise ValueError(f"slo_classes.classes.{name}.class: a class cannot name another")
            classes[name] = slo
        tenants = data.get("tenants", {})
        if not isinstance(tenants, dict) or not all(isinstance(v, str) for v in tenants.values()):
            raise ValueError("slo_classes.tenants: must map tenant names to class names")
        for tenant, c in tenants.items():
            if c not in classes:
                raise ValueError(f"slo_classes.tenants.{tenant}: unknown class {c!r} (known: {', '.join(classes)})")
        default_class = data.get("default_class")
        if default_class is not None and default_class not in classes:
            raise ValueError(f"slo_classes.default_class: unknown class {default_class!r}")
        return cls(default or SLO(), classes, dict(tenants), default_class)

    def resolve(self, body_slo, tenant: str | None) -> SLO | None:
        """The SLO of a request with body field `slo` (None or a dict) from `tenant`; None if it has none.
        ValueError naming the field for a bad value or an unknown class."""
        own, cls = parse_slo(body_slo) if body_slo is not None else (SLO(), None)
        if cls is not None and cls not in self.classes:
            known = ", ".join(self.classes) or "none: the server has no --slo-classes"
            raise ValueError(f"slo.class: unknown class {cls!r} (known: {known})")
        cls = cls or self.tenants.get(tenant or "") or self.default_class
        slo = own.over(self.classes.get(cls)).over(self.default) if cls else own.over(self.default)
        return None if slo.empty else slo

    def all_slos(self) -> list[tuple[str, SLO]]:
        return [("server default", self.default), *((f"class {n}", s) for n, s in self.classes.items())]


def unreachable(slo_policy: SLOPolicy, step_s: float) -> list[str]:
    """Warnings for targets no request could meet: a TTFT or TPOT below one step's time `step_s`."""
    return [f"{where}: {key} {getattr(slo, key):g} ms is below one engine step ({step_s * 1000:.1f} ms): "
            "no request can meet it"
            for where, slo in slo_policy.all_slos() for key in ("ttft_ms", "tpot_ms", "e2e_ms")
            if getattr(slo, key) is not None and getattr(slo, key) < step_s * 1000]


def request_latencies(out) -> tuple[float | None, float | None, float | None]:
    """(TTFT, TPOT, E2E) in seconds of a finished `RequestOutput`, by the load generator's definitions: from
    the arrival, to the first and the last token; TPOT over the output tokens after the first (None: at most
    one token)."""
    m = out.metrics
    tokens = sum(len(c.token_ids) for c in out.outputs)
    ttft = m.first_token_time - m.arrival_time if m.first_token_time is not None else None
    e2e = (m.last_token_time or m.finished_time) - m.arrival_time if ttft is not None else None
    tpot = (m.last_token_time - m.first_token_time) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return ttft, tpot, e2e


class Attainment:
    """Running SLO attainment: finished requests that had an SLO, how many met TTFT, TPOT and both, and the
    goodput (requests meeting both per second) over the last `window_s`. A request the server refused under
    --slo-shed counts as one that met nothing. Fed by the server's metrics and the dashboard alike."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.requests = 0
        self.met = dict.fromkeys(ATTAINMENT_KINDS, 0)
        self.shed = 0
        self._good: deque[float] = deque()  # finish times of requests that met both, in the window
        self._since: float | None = None

    def add_output(self, out, now: float) -> dict[str, bool] | None:
        """Count a finished output (stop or length; aborts and errors are not judged); None if not counted."""
        slo = out.metrics.slo if out.metrics is not None else None
        if slo is None or out.error is not None or out.outputs[0].finish_reason not in ("stop", "length"):
            return None
        return self.add(slo.attained(*request_latencies(out)), now)

    def add(self, met: dict[str, bool], now: float) -> dict[str, bool]:
        self._since = now if self._since is None else self._since
        self.requests += 1
        for kind, ok in met.items():
            self.met[kind] += ok
        if met["both"]:
            self._good.append(now)
        return met

    def add_shed(self, now: float) -> None:
        self.shed += 1
        self.add(dict.fromkeys(ATTAINMENT_KINDS, False), now)

    def goodput(self, now: float) -> float:
        while self._good and self._good[0] < now - self.window_s:
            self._good.popleft()
        span = min(self.window_s, now - self._since) if self._since is not None else 0.0
        return len(self._good) / span if span > 0 else 0.0

    def to_dict(self, now: float) -> dict:
        return {"requests": self.requests, "shed": self.shed, **{k: self.met[k] for k in ATTAINMENT_KINDS},
                "goodput": round(self.goodput(now), 3)}


__all__ = ["ATTAINMENT_KINDS", "SLO", "Attainment", "SLOPolicy", "parse_slo", "request_latencies", "slo_number",
           "unreachable"]
