"""The engine's periodic status line (engine/metrics.py): its prompt throughput counts prompt tokens as
the steps compute them, so a long prefill shows at its own rate (issue 57: it said `prompt 0.0 tok/s`
until the prompt's first token, then the whole prompt at once)."""

from __future__ import annotations

import logging
import re

from tokenloom import SamplingParams
from tokenloom.engine.metrics import EngineMetrics


def test_a_long_prefill_shows_in_the_prompt_rate(make_engine, caplog):
    engine = make_engine(max_num_batched_tokens=64, enable_chunked_prefill=True)
    metrics = EngineMetrics("tiny", log_interval_s=0.0, log_requests=False)
    engine.add_request("long", list(range(10, 810)), SamplingParams(max_tokens=2, ignore_eos=True))
    rates = []
    with caplog.at_level(logging.INFO, logger="tokenloom"):
        for _ in range(5):  # 5 of the 13 prefill steps: no token yet
            outputs = engine.step()
            assert not any(o.outputs and o.outputs[0].token_ids for o in outputs)
            metrics.on_step(engine, engine.last_step, outputs)
    for record in caplog.records:
        if m := re.search(r"prompt ([\d.]+) tok/s", record.getMessage()):
            rates.append(float(m.group(1)))
    assert len(rates) == 5 and all(r > 0 for r in rates), rates
    while engine.has_unfinished_requests():
        metrics.on_step(engine, engine.last_step, engine.step())
    assert metrics.prompt_tokens._value.get() == 800  # the counter still counts the prompt once
