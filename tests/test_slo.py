"""SLOs (issue 56): where a request's targets come from, bad input as 400s naming the field, the start-up
warning for a target below one step, and the attainment definition."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from test_server_tenancy import error_of, run_app

from tokenloom import SamplingParams
from tokenloom.server.loading import slo_policy_from_args, warn_unreachable_slos
from tokenloom.slo import SLO, SLOPolicy, parse_slo

CLASSES = {"classes": {"interactive": {"ttft_ms": 1000, "tpot_ms": 100}, "batch": {"ttft_ms": 60000}},
           "tenants": {"alice": "interactive", "etl": "batch"}}


def test_sources_in_order_body_class_tenant_default():
    policy = SLOPolicy.from_dict(CLASSES, SLO(ttft_ms=500, tpot_ms=50, e2e_ms=9000))
    assert policy.resolve(None, "alice") == SLO(1000, 100, 9000)
    assert policy.resolve(None, "etl") == SLO(60000, 50, 9000)  # the class's unset TPOT from the default
    assert policy.resolve(None, "nobody") == SLO(500, 50, 9000)
    assert policy.resolve({"ttft_ms": 200}, "etl") == SLO(200, 50, 9000)
    assert policy.resolve({"class": "interactive"}, "etl") == SLO(1000, 100, 9000)
    assert SLOPolicy().resolve(None, None) is None  # no SLO anywhere


@pytest.mark.parametrize("value", [-1, 0, math.nan, math.inf, 1e300, "100", True, None, [1]])
def test_bad_targets_name_the_field(value):
    if value is None:
        assert parse_slo({"ttft_ms": None}) == (SLO(), None)
        return
    with pytest.raises(ValueError, match=r"^slo\.tpot_ms: must be a finite number"):
        parse_slo({"tpot_ms": value})


def test_bad_classes_files_fail_at_start(tmp_path):
    for bad, field in (({"tenants": {"a": "nope"}}, "slo_classes.tenants.a"),
                       ({"classes": {"x": {"ttft_ms": -5}}}, "slo_classes.classes.x.ttft_ms"),
                       ({"default_class": "x"}, "slo_classes.default_class"), ({"other": 1}, "slo_classes")):
        with pytest.raises(ValueError, match=f"^{field}"):
            SLOPolicy.from_dict(bad)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CLASSES))
    args = argparse.Namespace(slo_ttft_ms=800.0, slo_tpot_ms=None, slo_e2e_ms=None, slo_classes=str(path))
    policy = slo_policy_from_args(args)
    assert policy.default == SLO(ttft_ms=800.0) and policy.tenants["etl"] == "batch"
    args.slo_tpot_ms = -1.0
    with pytest.raises(ValueError, match="^--slo-tpot-ms"):
        slo_policy_from_args(args)


def test_attainment_definition():
    slo = SLO(ttft_ms=100, tpot_ms=10)
    assert slo.attained(0.1, 0.01, 5.0) == {"ttft": True, "tpot": True, "both": True}  # <= is met
    assert slo.attained(0.2, None, 5.0) == {"ttft": False, "tpot": True, "both": False}  # 1 token: TPOT 0
    assert slo.attained(None, None, None)["ttft"] is False  # never a token
    assert SLO(e2e_ms=1000).attained(0.5, 0.5, 1.5) == {"ttft": True, "tpot": True, "both": False}


def test_sampling_params_take_an_slo_dict():
    assert SamplingParams(slo={"ttft_ms": 5}).slo == SLO(ttft_ms=5.0)
    with pytest.raises(ValueError, match="^slo.e2e_ms"):
        SamplingParams(slo={"e2e_ms": "soon"})


def test_server_400s_name_the_slo_field(make_engine):
    engine = make_engine()
    policy = SLOPolicy.from_dict(CLASSES)
    bodies = [({"slo": {"ttft_ms": -1}}, "slo.ttft_ms"), ({"slo": {"tpot_ms": "fast"}}, "slo.tpot_ms"),
              ({"slo": {"ttft_ms": 1e308 * 10}}, "slo.ttft_ms"), ({"slo": {"class": "gold"}}, "slo.class"),
              ({"slo": {"speed": 1}}, "slo.speed"), ({"slo": "fast"}, "slo")]

    async def scenario(client, app):
        for extra, field in bodies:
            body = {"prompt": "Hi", "max_tokens": 2, **extra}
            text = json.dumps(body).replace("Infinity", "1e999")  # JSON has no inf: a number that overflows
            r = await client.post("/v1/completions", content=text, headers={"content-type": "application/json"})
            error_of(r, 400, field)
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "user": "alice",
                                                        "slo": {"ttft_ms": 60000}})
        assert r.status_code == 200, r.text
        nan = '{"prompt": "Hi", "max_tokens": 2, "slo": {"ttft_ms": NaN}}'
        r = await client.post("/v1/chat/completions", content=nan.replace('"prompt": "Hi"', '"messages": '
                              '[{"role": "user", "content": "Hi"}]'), headers={"content-type": "application/json"})
        error_of(r, 400, "slo.ttft_ms")

    run_app(engine, scenario, slo_policy=policy)


def test_a_target_below_one_step_warns_at_start(make_engine, caplog):
    engine = make_engine()
    policy = SLOPolicy.from_dict({"classes": {"x": {"tpot_ms": 1e-6}}}, SLO(ttft_ms=60000))
    warnings = warn_unreachable_slos(engine, policy)
    assert len(warnings) == 1 and "class x: tpot_ms" in warnings[0]
    assert "no request can meet it" in caplog.text
    assert not engine.has_unfinished_requests()
    assert warn_unreachable_slos(engine, SLOPolicy()) == []


def test_metrics_and_dashboard_count_attainment(make_engine):
    from tokenloom.engine.metrics import EngineMetrics
    from tokenloom.engine.snapshot import EngineRecorder

    engine = make_engine()
    metrics, recorder = EngineMetrics("tiny", log_requests=False), EngineRecorder(engine)
    engine.add_request("met", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                        slo={"ttft_ms": 3_600_000, "tpot_ms": 3_600_000}))
    engine.add_request("missed", [8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                        slo={"ttft_ms": 1e-6}))
    engine.add_request("none", [8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
        metrics.on_step(engine, engine.last_step, outs)
    text = metrics.render().decode()
    assert 'tokenloom:slo_requests_total{model_name="tiny"} 2.0' in text
    assert 'tokenloom:slo_attained_total{model_name="tiny",slo="ttft"} 1.0' in text
    assert 'tokenloom:slo_attained_total{model_name="tiny",slo="tpot"} 2.0' in text
    assert 'tokenloom:slo_attained_total{model_name="tiny",slo="both"} 1.0' in text
    snap = recorder.build()
    assert {k: snap["slo"][k] for k in ("requests", "ttft", "tpot", "both")} == \
        {"requests": 2, "ttft": 1, "tpot": 2, "both": 1}
