"""`tokenloom bench serve` against a real `tokenloom serve` process: a complete JSON result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest_server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--max-num-seqs", "8"])
    yield srv
    srv.stop()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_against_tokenloom_serve(server, tmp_path, endpoint):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "bench", "serve", "--base-url", server.url,
         "--endpoint", endpoint, "--dataset", "random", "--num-prompts", "6", "--input-len", "24",
         "--output-len", "8", "--request-rate", "20", "--seed", "1", "--slo-ttft-ms", "60000",
         "--slo-tpot-ms", "60000", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 8  # from usage, ignore_eos
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p90_tpot_ms",
                "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms"):
        assert isinstance(result[key], int | float) and result[key] >= 0, key
    assert result["request_goodput"] > 0
    assert len(result["ttfts"]) == 6 and all(t > 0 for t in result["ttfts"])
    assert "Successful requests" in proc.stdout
