"""`tokenloom calibrate-cascade` end to end on the bundled SmolLM2 (both tiers, the exact float32 path, a
few problems of the shipped dev set): it writes a file `--cascade-config` loads for those tiers and
refuses for others, with every signal's AUROC in the report; and the checker tells a passing answer from
a failing one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenloom.model.loader import bundled_model_path
from tokenloom.server.cascade_calibrate import load_problems, passes
from tokenloom.server.cascade_config import load_config
from tokenloom.server.cascade_signals import SIGNALS

SMOL = bundled_model_path()
DEV = "benchmarks/cascade/dev.jsonl"


def test_checker_runs_the_asserts():
    problem = load_problems(DEV, 1)[0]  # sum_multiples(n) below n of 5 or 7
    assert passes(problem, "    return sum(i for i in range(n) if i % 5 == 0 or i % 7 == 0)\n")
    assert not passes(problem, "    return 0\n")
    assert not passes(problem, "    while True: pass\n", timeout=1.0)
    assert len(load_problems(DEV)) >= 100 and all("HumanEval" not in p["task_id"] for p in load_problems(DEV))


@pytest.mark.slow
def test_calibrate_writes_a_file_serve_loads(tmp_path):
    out = tmp_path / "cal.json"
    done = subprocess.run([sys.executable, "-m", "tokenloom.cli", "calibrate-cascade", SMOL, SMOL, "--dev", DEV,
                           "--out", str(out), "--limit", "6", "--max-tokens", "24", "--k", "8",
                           "--quantization", "none", "--target-escalation", "0.5"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    report = data["calibration"]
    assert report["problems"] == 6 and set(report["auroc_small_fails"]) == set(SIGNALS)
    assert all(a is None or 0 <= a <= 1 for a in report["auroc_small_fails"].values())
    assert data["k"] == 8 and 0 <= data["threshold"] <= 1 and data["signal"] in SIGNALS
    rule = load_config(str(out), [SMOL, SMOL])
    assert (rule.k, rule.signal, rule.threshold) == (8, data["signal"], data["threshold"])
    with pytest.raises(ValueError, match="calibrate this cascade's models"):
        load_config(str(out), [SMOL, "qwen2.5-coder-0.5b"])
