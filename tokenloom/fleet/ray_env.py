"""Ray Serve's housekeeping, paced for a machine whose cores the engines use: by default its controller
loops every 0.1 s and every Serve process exports metrics every 0.1 s, wake-ups that preempt an engine's
threads mid-step. Serve reads these constants when it is imported, so every fleet module that imports Ray
imports this module before it; the cluster `tokenloom serve -dp N` starts inherits them, and an
operator's own setting wins. A plain `tokenloom serve` never imports it (nor Ray). What the pacing and
client.py's gRPC streams buy one replica against plain `serve`: benchmarks/results/fleet-overhead-grpc.md.
"""

import os

SERVE_HOUSEKEEPING = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "2000"}
for _name, _value in SERVE_HOUSEKEEPING.items():
    os.environ.setdefault(_name, _value)
