"""What a cascade is (issue 55): `--cascade NAME=SMALL,LARGE[,...]`, its decision rule (`--cascade-k`,
`--cascade-threshold`, `--cascade-signal`) and the calibration file `--cascade-config FILE` loads.

Everything here is checked at start and fails as a ValueError naming the flag (the CLI's error line):
a cascade naming an unknown model, itself, another cascade (cascades of cascades, and so cycles, are
refused: a tier is a model), a tier twice, fewer than two tiers, a threshold outside [0, 1] or NaN, a
calibration file fitted for other models (each tier's file is identified by its size and a sampled
sha256, catalog.sample_sha256). Without a file, a calibration shipped for the same tier files
(cascade_defaults/) is used when there is one.

The rule: a tier's answer stands when its confidence (cascade_signals.py) over its first k tokens is at
least the threshold; threshold 0 never escalates, and 1.0 always does (a confidence can reach 1.0 in
float32, so "always" is stated, not left to `<`).

With `target_escalation` (`--cascade-target-escalation RATE`) the threshold is not fixed: it is the
RATE-quantile of the first tier's confidence over the last BUDGET_WINDOW requests, so about that share
of the traffic actually served goes on to the next tier, whatever the dev set was like (a threshold
fitted on one set of prompts escalates another set's at another rate). The window starts from the
calibration's own dev-set confidences, spread over their range, so the first requests are judged by the
calibrated threshold's quantile; without a calibration, by the fixed threshold until the window fills.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .cascade_signals import SIGNALS, LogisticProbe

DEFAULT_K = 16  # a few lines of code: enough tokens to see the answer's start, few to waste on escalation
DEFAULT_SIGNAL = "p10_top1"
DEFAULT_THRESHOLD = 0.8  # the seed text's "top token < 0.8", on the 10th percentile over the first k
BUDGET_WINDOW = 64  # recent requests the running threshold is the quantile of: it follows a shift in traffic
BUDGET_MIN = 16  # observations before the running threshold replaces the fixed one (no calibration to start)
CONFIG_VERSION = 1
SHIPPED = Path(__file__).with_name("cascade_defaults")


class EscalationBudget:
    """The running threshold of `target_escalation`: the `rate`-quantile of recent confidences."""

    def __init__(self, rate: float, seed: Sequence[float] = ()):
        self.rate = rate
        seed = sorted(seed)  # spread over the seed's range: its quantiles, not its last rows
        n = min(len(seed), BUDGET_WINDOW)
        self.window: deque[float] = deque((seed[round(i * (len(seed) - 1) / max(n - 1, 1))] for i in range(n)),
                                          maxlen=BUDGET_WINDOW)

    def threshold(self, fixed: float) -> float:
        if self.rate >= 1.0:
            return 1.0  # always
        if len(self.window) < BUDGET_MIN:
            return fixed
        ranked = sorted(self.window)
        return ranked[min(round(self.rate * len(ranked)), len(ranked) - 1)] if self.rate > 0 else 0.0

    def observe(self, confidence: float) -> None:
        self.window.append(confidence)


@dataclass
class CascadeRule:
    k: int = DEFAULT_K
    signal: str = DEFAULT_SIGNAL
    threshold: float = DEFAULT_THRESHOLD
    probe: LogisticProbe | None = None  # signal "probe" (from a calibration file)
    probe_pool: str = "prompt"  # what the probe's hidden state is pooled over: "prompt" or "prompt+k"
    thresholds: dict = field(default_factory=dict)  # a calibration's threshold per signal (the same target)
    target_escalation: float | None = None  # the share of requests to escalate: a running threshold
    dev_confidences: dict = field(default_factory=dict)  # a calibration's dev-set confidences per signal
    budget: EscalationBudget | None = None  # made by build_rule when target_escalation is set

    @property
    def hold(self) -> int:
        """Tokens held before the decision: one for the prompt-only probe (a router: it decides once the
        prompt ran), else k."""
        return 1 if self.signal == "probe" and self.probe_pool == "prompt" else self.k

    def current_threshold(self) -> float:
        return self.threshold if self.budget is None else self.budget.threshold(self.threshold)

    def escalates(self, confidence: float) -> bool:
        threshold = self.current_threshold()
        return threshold >= 1.0 or confidence < threshold

    def observe(self, confidence: float) -> None:
        """The first tier's confidence for one request (the running threshold's window)."""
        if self.budget is not None:
            self.budget.observe(confidence)


@dataclass
class CascadeSpec:
    name: str
    tiers: tuple[str, ...]
    rule: CascadeRule = field(default_factory=CascadeRule)
    options: dict = field(default_factory=dict)  # this cascade's own threshold / k / signal (`;key=value`)


OPTION_TYPES = {"threshold": float, "k": int, "signal": str, "config": str, "target_escalation": float}
TOML_KINDS = {float: "a number", int: "an integer", str: "a string"}


def add_cascade_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cascade", action="append", default=None, metavar="NAME=SMALL,LARGE[,...][;KEY=VALUE]",
                   help="with several models: a request for `model: NAME` runs the tiers in order; each answers "
                        "unless its confidence over its first --cascade-k tokens is below --cascade-threshold, "
                        "then the next answers from scratch (repeat the flag for more cascades; `;threshold=T`, "
                        "`;k=N`, `;signal=S`, `;config=FILE`, `;target_escalation=R` set one cascade's own, over "
                        "the flags)")
    p.add_argument("--cascade-k", type=int, default=None,
                   help=f"tokens a tier writes before its answer is judged (default: {DEFAULT_K}, or the calibration "
                        "file's)")
    p.add_argument("--cascade-threshold", type=float, default=None,
                   help=f"in [0, 1]: a tier escalates when its confidence is below it; 0 never, 1 always (default: "
                        f"{DEFAULT_THRESHOLD}, or the calibration file's)")
    p.add_argument("--cascade-target-escalation", type=float, default=None, metavar="RATE",
                   help="in [0, 1]: instead of a fixed threshold, escalate about this share of the requests served: "
                        f"the threshold is the RATE-quantile of the first tier's confidence over the last {BUDGET_WINDOW} "
                        "requests (starting from the calibration's dev set)")
    p.add_argument("--cascade-signal", choices=SIGNALS, default=None,
                   help=f"the confidence signal (default: {DEFAULT_SIGNAL}, or the calibration file's, whose "
                        "threshold for another signal comes with it; `probe` needs a calibration file)")
    p.add_argument("--cascade-config", metavar="FILE", default=None,
                   help="a calibration file from `tokenloom calibrate-cascade` (signal, threshold, k, probe), for "
                        "the cascade of the same tier models; flags given beside it win")


def parse_cascades(texts: list[str] | None, models: dict[str, str],
                   preset: list[tuple[str, str, dict]] = ()) -> list[CascadeSpec]:
    """`--cascade` values and a models preset's cascade tables (`preset`: (where, name, table) each, the
    table's `tiers` and options as TOML gave them), checked against the served models (name -> source)."""
    entries = [_from_flag(text) for text in texts or ()] + [_from_table(*entry) for entry in preset]
    names = [name for _, name, _, _ in entries]
    specs: list[CascadeSpec] = []
    for where, name, tiers, options in entries:
        if name in models:
            raise ValueError(f"{where}: {name!r} is already a model's name; a cascade needs its own")
        if names.count(name) > 1:
            raise ValueError(f"{where}: two cascades are named {name!r}")
        if len(tiers) < 2:
            raise ValueError(f"{where}: a cascade needs at least two tiers (SMALL,LARGE)")
        for tier in tiers:
            if tier == name:
                raise ValueError(f"{where}: the cascade names itself as a tier")
            if tier in names:
                raise ValueError(f"{where}: tier {tier!r} is a cascade; a tier must be a model "
                                 "(cascades of cascades, and so cycles, are refused)")
            if tier not in models:
                raise ValueError(f"{where}: tier {tier!r} is not a served model (served: {', '.join(models)})")
        if len(set(tiers)) < len(tiers):
            raise ValueError(f"{where}: a tier is named twice")
        specs.append(CascadeSpec(name, tiers, options=options))
    return specs


def _from_flag(text: str) -> tuple[str, str, tuple[str, ...], dict]:
    """One `--cascade NAME=SMALL,LARGE[;key=value...]`: (where, name, tiers, options)."""
    where = f"--cascade {text!r}"
    head, *extras = text.split(";")
    name, sep, rest = head.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"{where}: give it as NAME=SMALL,LARGE[,...]")
    options = {}
    for extra in extras:
        key, eq, value = extra.partition("=")
        key = key.strip()
        if key not in OPTION_TYPES or not eq:
            raise ValueError(f"{where}: {extra!r} is not one of {', '.join(k + '=...' for k in OPTION_TYPES)}")
        try:
            options[key] = OPTION_TYPES[key](value.strip())
        except ValueError:
            raise ValueError(f"{where}: {key} must be a {OPTION_TYPES[key].__name__}") from None
    return where, name.strip(), tuple(t.strip() for t in rest.split(",") if t.strip()), options


def _from_table(where: str, name: str, table: dict) -> tuple[str, str, tuple[str, ...], dict]:
    """A models preset's cascade table (`tiers = ["small", "large"]`, and `threshold`, `k`, `signal`,
    `config` as `;key=value` takes them; a path as the command line takes it, like a model's `source`)."""
    if not name:
        raise ValueError(f"{where}: a cascade needs a name (the table's)")
    tiers = table.get("tiers")
    if not isinstance(tiers, list) or not all(isinstance(t, str) and t for t in tiers):
        raise ValueError(f"{where}: `tiers` must be a list of model names, the smallest first")
    options = {}
    for key, value in table.items():
        if key == "tiers":
            continue
        kind = OPTION_TYPES.get(key)
        if kind is None:
            raise ValueError(f"{where}: unknown key `{key}` for a cascade (tiers, {', '.join(OPTION_TYPES)})")
        # TOML's own types: an integer is a fine threshold, a bool is no number
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else (
            type(value) is kind)
        if not ok:
            raise ValueError(f"{where}: `{key}` must be {TOML_KINDS[kind]}, got {value!r}")
        options[key] = float(value) if kind is float else value
    return where, name, tuple(tiers), options


def build_rule(args: argparse.Namespace, spec: CascadeSpec, sources: dict[str, str]) -> CascadeRule:
    """The cascade's rule: the calibration file's (checked against the tiers' files), then the flags."""
    tier_sources = [sources[t] for t in spec.tiers]
    path = spec.options.get("config") or args.cascade_config
    rule = load_config(path, tier_sources) if path else shipped_rule(tier_sources)
    if args.cascade_k is not None:
        rule.k = args.cascade_k
    signal = spec.options.get("signal", args.cascade_signal)
    if signal is not None and signal != rule.signal:
        # Another signal of a calibrated file: its own threshold for the same escalation target.
        rule.signal, rule.threshold = signal, rule.thresholds.get(signal, rule.threshold)
    if args.cascade_threshold is not None:
        rule.threshold = args.cascade_threshold
    if args.cascade_target_escalation is not None:
        rule.target_escalation = args.cascade_target_escalation
    for key, value in spec.options.items():
        if key not in ("config", "signal"):
            setattr(rule, key, value)
    check_rule(rule, spec.name)
    if rule.target_escalation is not None:
        rule.budget = EscalationBudget(rule.target_escalation, rule.dev_confidences.get(rule.signal, []))
    return rule


def check_rule(rule: CascadeRule, name: str = "") -> None:
    where = f" (cascade {name})" if name else ""
    if not (isinstance(rule.threshold, int | float) and not math.isnan(rule.threshold) and 0 <= rule.threshold <= 1):
        raise ValueError(f"--cascade-threshold{where}: must be a number in [0, 1], got {rule.threshold}")
    rate = rule.target_escalation
    if rate is not None and not (isinstance(rate, int | float) and not math.isnan(rate) and 0 <= rate <= 1):
        raise ValueError(f"--cascade-target-escalation{where}: must be a number in [0, 1], got {rate}")
    if rule.k < 1:
        raise ValueError(f"--cascade-k{where}: must be at least 1, got {rule.k}")
    if rule.signal not in SIGNALS:
        raise ValueError(f"--cascade-signal{where}: one of {', '.join(SIGNALS)}, got {rule.signal!r}")
    if rule.signal == "probe" and rule.probe is None:
        raise ValueError(f"--cascade-signal probe{where}: needs a --cascade-config file with a fitted probe")


# -- the calibration file ---------------------------------------------------------------------------

def model_identity(source: str) -> dict:
    """What names a tier's weights: its file's size and sampled sha256 (an HF directory: its first weight file)."""
    from ..model import catalog
    from ..model.load import model_path

    path = Path(model_path(source))
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
        path = files[0] if files else path
    if not path.is_file():
        return {"source": source}
    return {"file": path.name, "size": path.stat().st_size, "sample_sha256": catalog.sample_sha256(path)}


def write_config(path: str, sources: list[str], rule: CascadeRule, report: dict) -> None:
    data = {"version": CONFIG_VERSION, "tiers": [{"source": s, **model_identity(s)} for s in sources],
            "k": rule.k, "signal": rule.signal, "threshold": rule.threshold, "thresholds": rule.thresholds,
            "probe_pool": rule.probe_pool,
            "probe": rule.probe.to_json() if rule.probe is not None else None, "calibration": report}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def shipped_rule(sources: list[str]) -> CascadeRule:
    """The calibration shipped for these tiers' files (cascade_defaults/, e.g. the catalog's Qwen2.5-Coder
    0.5B -> 1.5B, fitted on benchmarks/cascade/dev.jsonl), else the defaults."""
    for path in sorted(SHIPPED.glob("*.json")):
        try:
            return load_config(str(path), sources)  # each tier's file identity decides (not its name)
        except ValueError:
            continue
    return CascadeRule()


def load_config(path: str, sources: list[str]) -> CascadeRule:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--cascade-config {path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != CONFIG_VERSION:
        raise ValueError(f"--cascade-config {path}: not a calibration file of version {CONFIG_VERSION}")
    tiers = data.get("tiers") or []
    if len(tiers) != len(sources):
        raise ValueError(f"--cascade-config {path}: fitted for {len(tiers)} tiers, the cascade has {len(sources)}")
    for i, (recorded, source) in enumerate(zip(tiers, sources, strict=True)):
        mine = model_identity(source)
        if {k: recorded.get(k) for k in mine} != mine:
            raise ValueError(f"--cascade-config {path}: tier {i} was calibrated for {recorded.get('file') or recorded}, "
                             f"not for {source} ({mine.get('file', source)}): calibrate this cascade's models")
    rule = CascadeRule(k=int(data.get("k", DEFAULT_K)), signal=data.get("signal", DEFAULT_SIGNAL),
                       threshold=data.get("threshold", DEFAULT_THRESHOLD), probe_pool=data.get("probe_pool", "prompt"),
                       thresholds=data.get("thresholds") or {})
    rows = (data.get("calibration") or {}).get("per_problem") or []
    rule.dev_confidences = {s: [float(r[s]) for r in rows if isinstance(r.get(s), int | float)] for s in SIGNALS}
    if data.get("probe"):
        rule.probe = LogisticProbe.from_json(data["probe"])
    return rule
