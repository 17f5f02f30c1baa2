"""Cascades' start-up checks, signals and probe (issue 55), without a server; and the CLI's one-line
error for a bad cascade (a real `tokenloom serve` that exits before loading anything)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tokenloom.model.loader import bundled_model_path
from tokenloom.server.cascade_config import (
    CascadeRule,
    build_rule,
    load_config,
    parse_cascades,
    write_config,
)
from tokenloom.server.cascade_signals import LogisticProbe, auroc, threshold_for_rate, token_signals

SMOL = bundled_model_path()
MODELS = {"small": SMOL, "large": SMOL, "other": SMOL}


def flags(**kw) -> argparse.Namespace:
    base = {"cascade_config": None, "cascade_k": None, "cascade_threshold": None, "cascade_signal": None,
            "cascade_target_escalation": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(("text", "says"), [
    ("c=small,nope", "tier 'nope' is not a served model"),
    ("c=small,c", "names itself"),
    ("small=small,large", "already a model's name"),
    ("c=small", "at least two tiers"),
    ("c=small,small", "named twice"),
    ("c", "NAME=SMALL,LARGE"),
    ("c=small,large;depth=3", "is not one of"),
    ("c=small,large;k=many", "k must be a int"),
])
def test_a_bad_cascade_is_refused_naming_the_flag(text, says):
    with pytest.raises(ValueError, match="--cascade") as err:
        parse_cascades([text], MODELS)
    assert says in str(err.value)


def test_cascades_of_cascades_and_cycles_are_refused():
    with pytest.raises(ValueError, match="tier 'b' is a cascade"):
        parse_cascades(["a=small,b", "b=small,large"], MODELS)
    with pytest.raises(ValueError, match="is a cascade"):
        parse_cascades(["a=b,large", "b=a,large"], MODELS)
    with pytest.raises(ValueError, match="two cascades"):
        parse_cascades(["a=small,large", "a=large,small"], MODELS)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, math.nan, math.inf])
def test_a_threshold_outside_0_1_is_refused(threshold):
    spec = parse_cascades(["c=small,large"], MODELS)[0]
    with pytest.raises(ValueError, match=r"--cascade-threshold \(cascade c\): must be a number in \[0, 1\]"):
        build_rule(flags(cascade_threshold=threshold), spec, MODELS)
    spec = parse_cascades([f"c=small,large;threshold={threshold}"], MODELS)[0]
    with pytest.raises(ValueError, match="--cascade-threshold"):
        build_rule(flags(), spec, MODELS)


def test_per_cascade_options_win_over_flags_and_the_rule_reads_0_and_1():
    spec = parse_cascades(["c=small,large;threshold=0.25;k=4;signal=min_top1"], MODELS)[0]
    rule = build_rule(flags(cascade_threshold=0.9, cascade_k=8), spec, MODELS)
    assert (rule.threshold, rule.k, rule.signal) == (0.25, 4, "min_top1")
    assert CascadeRule(threshold=1.0).escalates(1.0) and not CascadeRule(threshold=0.0).escalates(0.0)
    assert CascadeRule(threshold=0.5).escalates(0.49) and not CascadeRule(threshold=0.5).escalates(0.5)
    plain = parse_cascades(["c=small,large"], MODELS)[0]
    with pytest.raises(ValueError, match="--cascade-signal probe .*needs a --cascade-config file"):
        build_rule(flags(cascade_signal="probe"), plain, MODELS)


def test_a_calibration_file_for_other_models_is_refused(tmp_path):
    path = str(tmp_path / "cal.json")
    rule = CascadeRule(k=8, signal="probe", threshold=0.3,
                       probe=LogisticProbe.fit(np.random.default_rng(0).normal(size=(40, 3)), np.arange(40) % 2))
    write_config(path, [SMOL, SMOL], rule, {"note": "test"})
    loaded = load_config(path, [SMOL, SMOL])
    assert (loaded.k, loaded.signal, loaded.threshold) == (8, "probe", 0.3)
    assert np.allclose(loaded.probe.weights, rule.probe.weights)
    other = tmp_path / "other.gguf"
    other.write_bytes(Path(SMOL).read_bytes()[: 1 << 20])
    with pytest.raises(ValueError, match="--cascade-config .*tier 1 was calibrated for .*calibrate this cascade"):
        load_config(path, [SMOL, str(other)])
    with pytest.raises(ValueError, match="fitted for 2 tiers"):
        load_config(path, [SMOL, SMOL, SMOL])
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        load_config(str(tmp_path / "junk.json"), [SMOL, SMOL])
    data = json.loads(Path(path).read_text())
    assert data["tiers"][0]["sample_sha256"] and data["tiers"][0]["size"] > 0


def test_another_signal_of_a_calibration_brings_its_own_threshold(tmp_path):
    path = str(tmp_path / "cal.json")
    write_config(path, [SMOL, SMOL], CascadeRule(signal="p10_top1", threshold=0.55,
                                                 thresholds={"p10_top1": 0.55, "min_top1": 0.31}), {})
    spec = parse_cascades(["c=small,large"], MODELS)[0]
    assert build_rule(flags(cascade_config=path), spec, MODELS).threshold == 0.55
    rule = build_rule(flags(cascade_config=path, cascade_signal="min_top1"), spec, MODELS)
    assert (rule.signal, rule.threshold) == ("min_top1", 0.31)
    rule = build_rule(flags(cascade_config=path, cascade_signal="min_top1", cascade_threshold=0.7), spec, MODELS)
    assert rule.threshold == 0.7
    own = parse_cascades([f"c=small,large;config={path};signal=min_top1"], MODELS)[0]
    assert build_rule(flags(), own, MODELS).threshold == 0.31


def test_a_target_escalation_follows_the_traffic_from_the_calibrations_dev_set(tmp_path):
    path = str(tmp_path / "cal.json")
    dev = [{"task_id": str(i), "p10_top1": i / 99} for i in range(100)]  # the dev set: uniform on [0, 1]
    write_config(path, [SMOL, SMOL], CascadeRule(signal="p10_top1", threshold=0.3), {"per_problem": dev})
    spec = parse_cascades([f"c=small,large;config={path};target_escalation=0.25"], MODELS)[0]
    rule = build_rule(flags(), spec, MODELS)
    assert rule.current_threshold() == pytest.approx(0.25, abs=0.02)  # the dev set's quantile to start
    for _ in range(200):  # the traffic is surer than the dev set: [0.8, 1]
        for c in np.linspace(0.8, 1.0, 9):
            rule.observe(float(c))
    assert 0.8 < rule.current_threshold() < 0.9
    served = np.random.default_rng(0).uniform(0.8, 1.0, size=400)
    assert abs(np.mean([rule.escalates(float(c)) for c in served]) - 0.25) < 0.08
    # without a calibration: the fixed threshold until the window has enough requests
    bare = build_rule(flags(cascade_target_escalation=0.5), parse_cascades(["c=small,large"], MODELS)[0], MODELS)
    assert bare.current_threshold() == bare.threshold
    for c in np.linspace(0, 1, 64):
        bare.observe(float(c))
    assert bare.current_threshold() == pytest.approx(0.5, abs=0.02)
    calibrated = parse_cascades([f"c=small,large;config={path}"], MODELS)[0]
    assert build_rule(flags(cascade_target_escalation=1.0), calibrated, MODELS).escalates(1.0)  # 1: always
    assert not build_rule(flags(cascade_target_escalation=0.0), calibrated, MODELS).escalates(0.0)  # 0: never
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="--cascade-target-escalation .*cascade c.*in \\[0, 1\\]"):
            build_rule(flags(cascade_target_escalation=bad), calibrated, MODELS)


def test_signals_from_logprobs():
    sure = {1: math.log(0.99), 2: math.log(0.01)}
    unsure = {3: math.log(0.4), 4: math.log(0.35)}
    s = token_signals([1, 1, 4], [sure, sure, unsure])
    assert s["min_top1"] == pytest.approx(0.4)
    assert 0.4 < s["p10_top1"] < 0.99
    assert s["mean_logprob"] == pytest.approx((0.99 * 0.99 * 0.35) ** (1 / 3))
    # entropy over the top-N and the rest's mass as one outcome: the sure token's is small
    assert token_signals([1], [sure])["entropy"] > token_signals([3], [unsure])["entropy"]
    assert token_signals([], []) == dict.fromkeys(s, 1.0)


def test_probe_learns_a_separable_label_and_auroc_and_rate_threshold():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 5))
    y = (x[:, 0] + 0.3 * rng.normal(size=200) > 0).astype(float)
    probe = LogisticProbe.fit(x, y)
    p = np.array([probe.p_fail(row) for row in x])
    assert auroc(p, y.astype(bool)) > 0.9
    assert auroc([0.1, 0.2], [True, False]) == 0.0 and auroc([1, 1], [True, True]) is None
    conf = rng.uniform(size=100)
    t = threshold_for_rate(conf, 0.3)
    assert abs((conf < t).mean() - 0.3) <= 0.02
    assert threshold_for_rate(conf, 0) == 0.0 and threshold_for_rate(conf, 1) == 1.0


def test_serve_refuses_a_bad_cascade_at_start_in_one_line():
    done = subprocess.run([sys.executable, "-m", "tokenloom.cli", "serve", f"a={SMOL}", f"b={SMOL}",
                           "--cascade", "c=a,missing", "--port", "0"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "--cascade 'c=a,missing': tier 'missing' is not a served model" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_shipped_calibration_is_used_for_its_own_files_only(tmp_path, monkeypatch):
    from tokenloom.server import cascade_config

    write_config(str(tmp_path / "smol.json"), [SMOL, SMOL], CascadeRule(k=5, signal="min_top1", threshold=0.42), {})
    monkeypatch.setattr(cascade_config, "SHIPPED", tmp_path)
    spec = parse_cascades(["c=small,large"], MODELS)[0]
    rule = build_rule(flags(), spec, MODELS)
    assert (rule.k, rule.signal, rule.threshold) == (5, "min_top1", 0.42)
    assert build_rule(flags(cascade_threshold=0.9), spec, MODELS).threshold == 0.9  # a flag still wins
    other = tmp_path / "other.gguf"
    other.write_bytes(Path(SMOL).read_bytes()[: 1 << 20])
    rule = build_rule(flags(), spec, {**MODELS, "large": str(other)})
    assert (rule.k, rule.signal, rule.threshold) == (CascadeRule().k, CascadeRule().signal, CascadeRule().threshold)


def test_held_output_then_the_rest_with_the_clients_own_logprobs():
    """What a view reads of an answer that stands: the held output, then the same stream's later ones,
    each token's logprobs cut back from the signals' top-N to the client's N (None: none at all)."""
    import asyncio

    from tokenloom.outputs import CompletionOutput, RequestOutput
    from tokenloom.server.cascade import _HeldGroup
    from tokenloom.server.streams import RequestGroup

    lps = [{7: -0.1, 3: -2.0, 9: -3.0}, {4: -0.5, 8: -1.0, 2: -4.0}, {1: -0.2, 5: -2.5, 2: -3.5}]
    ids = [3, 4, 2]  # the chosen tokens: second, first, third of their rows

    def out(n, done=False):
        return RequestOutput("r", None, [0], [CompletionOutput(0, "x" * n, ids[:n], "stop" if done else None,
                                                               logprobs=lps[:n])], finished=done)

    async def rest():
        yield out(3, done=True)

    async def read(client_n):
        group = _HeldGroup(RequestGroup(None, "r"), [out(2)], rest(), client_n)
        return [o async for _, o in group.outputs()]

    none, two = asyncio.run(read(None)), asyncio.run(read(1))
    assert [len(o.outputs[0].token_ids) for o in two] == [2, 3] and two[-1].finished
    assert all(o.outputs[0].logprobs is None for o in none)
    assert two[-1].outputs[0].logprobs == [{7: -0.1, 3: -2.0}, {4: -0.5}, {1: -0.2, 2: -3.5}]


def test_the_shipped_qwen_coder_calibration_loads_for_the_catalog_pair():
    from tokenloom.model import catalog
    from tokenloom.server.cascade_config import SHIPPED, shipped_rule

    pair = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    if not all(catalog.local_path(name) for name in pair):
        pytest.skip("the Qwen2.5-Coder pair is not pulled (tokenloom pull NAME)")
    shipped = json.loads((SHIPPED / "qwen2.5-coder-0.5b-1.5b.json").read_text())
    rule = shipped_rule(pair)
    assert (rule.signal, rule.threshold, rule.k) == (shipped["signal"], shipped["threshold"], shipped["k"])
    assert rule.signal != "probe" or rule.probe is not None
    assert "HumanEval" not in shipped["calibration"]["dev"]
    assert shipped_rule(pair[::-1]).threshold == CascadeRule().threshold  # the other way round: not its tiers
