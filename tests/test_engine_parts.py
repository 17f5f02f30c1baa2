"""The engine's parts (engine/builder.py): each build is a self-contained engine, so one process (the
multi-model server) can run several side by side."""

from __future__ import annotations

from tokenloom.sampling_params import SamplingParams


def _run(engine, ids):
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return {r: outs[r].outputs[0].token_ids for r in ids}


def test_two_engines_share_no_state(make_engine):
    a, b = make_engine(), make_engine()
    assert {id(getattr(a.parts, f)) for f in ("kv", "scheduler", "runner", "inputs", "core", "metrics", "heap")}.isdisjoint(
        {id(getattr(b.parts, f)) for f in ("kv", "scheduler", "runner", "inputs", "core", "metrics", "heap")})
    assert a.requests is a.core.requests and a.requests is not b.requests
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a.add_request("r", "Hello there", params)  # the same request id in both: each engine has its own
    b.add_request("r", "Hello there", params)
    b.add_request("s", "Once upon a time", params)
    outs_a, outs_b = {}, {}
    while a.has_unfinished_requests() or b.has_unfinished_requests():  # stepped in turns
        outs_a.update({o.request_id: o for o in a.step() if o.finished})
        outs_b.update({o.request_id: o for o in b.step() if o.finished})
    alone = make_engine()
    alone.add_request("r", "Hello there", params)
    assert outs_a["r"].outputs[0].token_ids == outs_b["r"].outputs[0].token_ids == _run(alone, ["r"])["r"]
    assert (a.num_generation_tokens, b.num_generation_tokens) == (6, 12)  # each counts its own
