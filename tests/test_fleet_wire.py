"""What crosses between the ingress and a replica (fleet/wire.py) and the merged /metrics (fleet/metrics.py):
pure Python, no Ray."""

import copy
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tokenloom.engine.async_llm import QueueFullError
from tokenloom.engine.metrics import EngineMetrics
from tokenloom.fleet.metrics import merge_metrics
from tokenloom.fleet.wire import Refusal, apply_delta, output_delta
from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _growing_outputs(steps: list[list[tuple[str, int]]], logprobs: bool) -> list[RequestOutput]:
    """Cumulative outputs of a 2-choice request, each step adding (text, token) to each choice."""
    outs, texts, ids = [], ["", ""], [[], []]
    for i, step in enumerate(steps):
        for c, (text, token) in enumerate(step):
            texts[c] += text
            ids[c].append(token)
        last = i == len(steps) - 1
        choices = [CompletionOutput(c, texts[c], list(ids[c]), "length" if last else None, None,
                                    [{t: -0.5} for t in ids[c]] if logprobs else None) for c in range(2)]
        outs.append(RequestOutput("r", None, [1, 2, 3], choices, finished=last,
                                  metrics=RequestMetrics(arrival_time=float(i))))
    return outs


@given(st.lists(st.lists(st.tuples(st.text(max_size=3), st.integers(0, 50_000)), min_size=2, max_size=2),
                min_size=1, max_size=12), st.booleans())
def test_deltas_rebuild_every_cumulative_output(steps, logprobs):
    outs = _growing_outputs(steps, logprobs)
    rebuilt = outs[0]
    for prev, cur in itertools.pairwise(outs):
        rebuilt = apply_delta(rebuilt, output_delta(prev, cur))
        assert rebuilt == cur
    assert rebuilt == outs[-1]


def test_apply_delta_leaves_the_earlier_output_alone():
    a, b = _growing_outputs([[("x", 1), ("y", 2)], [("z", 3), ("w", 4)]], logprobs=True)
    kept = copy.deepcopy(a)
    apply_delta(a, output_delta(a, b))
    assert a == kept


def test_a_delta_carries_only_the_new_part():
    outs = _growing_outputs([[("ab", 1), ("c", 2)]] * 50, logprobs=False)
    delta = output_delta(outs[48], outs[49])
    assert [len(c.token_ids) for c in delta.choices] == [1, 1] and delta.choices[0].text == "ab"


def test_refusals_come_back_as_the_same_exception():
    for exc in (ValueError("max_tokens: too many"), QueueFullError("full")):
        again = Refusal.of(exc).exception()
        assert type(again) is type(exc) and str(again) == str(exc)


def test_merged_metrics_label_each_replica_and_total_them():
    a, b = EngineMetrics("m"), EngineMetrics("m")
    a.generation_tokens.inc(5)
    b.generation_tokens.inc(7)
    a.kv_usage.set(0.5)
    b.kv_usage.set(0.1)
    a.ttft.observe(0.2)
    b.ttft.observe(3.0)
    merged = merge_metrics({"r1": a.render().decode(), "r2": b.render().decode()}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(merged) for s in fam.samples}
    gen = "tokenloom:generation_tokens_total"
    assert samples[(gen, (("model_name", "m"), ("replica", "r1")))] == 5
    assert samples[(gen, (("model_name", "m"),))] == 12
    assert samples[("tokenloom:kv_cache_usage_perc", (("model_name", "m"),))] == pytest.approx(0.3)  # a mean
    assert samples[("tokenloom:time_to_first_token_seconds_count", (("model_name", "m"),))] == 2
    assert samples[("tokenloom:time_to_first_token_seconds_bucket", (("le", "0.25"), ("model_name", "m")))] == 1
