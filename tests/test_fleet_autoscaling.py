"""Ray Serve's autoscaling of the engine deployment (`--autoscaling-config`): a second replica under load,
back to one after it. Its own module, so no other fleet runs beside it."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from conftest_fleet import FleetProcess, replica_pids
from conftest_server import wait_for

pytestmark = pytest.mark.slow


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after():
    config = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 2,
              "upscale_delay_s": 1, "downscale_delay_s": 5, "look_back_period_s": 2, "metrics_interval_s": 0.5}
    srv = FleetProcess([], replicas=["--autoscaling-config", json.dumps(config)])
    try:
        assert wait_for(lambda: len(replica_pids(srv, "engine")) == 1, 60), replica_pids(srv, "engine")
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(httpx.post, f"{srv.url}/v1/completions", json=body, timeout=300)
                       for _ in range(12)]
            scaled_up = wait_for(lambda: len(replica_pids(srv, "engine")) == 2, 120)
            codes = [f.result().status_code for f in futures]
        assert scaled_up and codes == [200] * 12
        assert wait_for(lambda: len(replica_pids(srv, "engine")) == 1, 120), replica_pids(srv, "engine")
    finally:
        srv.stop()
