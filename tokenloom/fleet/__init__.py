"""Past one machine: engine replicas as Ray Serve deployment replicas behind one OpenAI endpoint.

`routing.py` (pure Python) holds the routing policies; everything else here imports Ray, which is an
optional dependency (`pip install tokenloom[ray]`): a single-process `tokenloom serve` never loads it.

Ray Serve's housekeeping is paced here for a machine whose cores the engines use: by default its
controller loops every 0.1 s and every Serve process exports metrics every 0.1 s, wake-ups that preempt
an engine's threads mid-step. Set before Ray Serve is imported (its constants are read then) and inherited
by the cluster `tokenloom serve -dp N` starts; an operator's own setting wins. What the pacing and
client.py's gRPC streams buy one replica against plain `serve`: benchmarks/results/fleet-overhead-grpc.md.
"""

import os

SERVE_HOUSEKEEPING = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "2000"}
for _name, _value in SERVE_HOUSEKEEPING.items():
    os.environ.setdefault(_name, _value)
