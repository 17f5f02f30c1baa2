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


def _ours(url: str, out) -> list[str]:
    return ["--base-url", url, "--endpoint", "completions", "--dataset", "random", "--input-len", "24",
            "--output-len", "8", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--no-progress", "--out", str(out)]


def _vllms(url: str, out) -> list[str]:
    # As a `vllm bench serve` command line is written, chat endpoint, port and result file in its words.
    port = url.rsplit(":", 1)[1]
    return ["--host", "127.0.0.1", "--port", port, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "8",
            "--goodput", "ttft:60000", "tpot:60000", "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


@pytest.mark.parametrize("spelling", [_ours, _vllms], ids=["ours-completions", "vllm-chat"])
def test_bench_serve_against_tokenloom_serve(server, tmp_path, spelling):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "bench", "serve", *spelling(server.url, out),
         "--num-prompts", "6", "--request-rate", "20", "--seed", "1"],
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
    assert result["endpoint"] == ("chat" if spelling is _vllms else "completions")
