"""`tokenloom serve`'s fleet flags (engine replicas on Ray Serve), added to the serve command by the
top-level CLI (tokenloom/cli.py), which serves one process (tokenloom/server) unless they ask for a
fleet (`wants_fleet`), and by `serve run tokenloom.fleet.serve_run:build` (serve_run.py)."""

from __future__ import annotations

import argparse
import json
import math

from ..server.cli import positive_int
from .routing import POLICIES

# Ray Serve LLM's default for its stream_batching_interval_ms: a few tokens per streamed item at a
# single stream's speed here, and the first and last output are never held (stream_batching.py).
DEFAULT_STREAM_BATCHING_INTERVAL_MS = 50.0
MAX_STREAM_BATCHING_INTERVAL_MS = 10_000.0  # beyond that a stream is no longer a stream


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    fleet = p.add_argument_group("fleet (Ray Serve; needs `pip install tokenloom[ray]`)")
    fleet.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                       help="engine replicas behind this endpoint, each with its own cores and KV cache, as Ray "
                            "Serve replicas on a local Ray cluster (default 1: one process, no Ray)")
    fleet.add_argument("--data-parallel-backend", choices=("ray",), default=None,
                       help="ray: run through Ray Serve even with one replica (default: Ray from 2 replicas)")
    fleet.add_argument("--routing-policy", choices=POLICIES, default="prefix-aware",
                       help="which replica gets a request: prefix-aware (where its prompt's longest prefix is "
                            "cached, unless that replica is much busier), least-loaded or round-robin")
    fleet.add_argument("--prefill-replicas", type=int, default=0,
                       help="disaggregated prefill: this many more replicas only compute prompts' K/V and hand it "
                            "to the --data-parallel-size decode replicas (default 0: every replica does both)")
    fleet.add_argument("--autoscaling-config", type=_json_object, default=None,
                       help="Ray Serve's autoscaling_config as JSON (e.g. '{\"min_replicas\": 1, "
                            "\"max_replicas\": 2, \"target_ongoing_requests\": 16}'); replaces "
                            "--data-parallel-size's fixed count")
    fleet.add_argument("--stream-batching-interval-ms", type=_stream_batching_interval, metavar="MS",
                       default=DEFAULT_STREAM_BATCHING_INTERVAL_MS,
                       help="a replica streams each request at most once per this many milliseconds, the tokens "
                            "made meanwhile together (Ray costs CPU per streamed item); the first and the last "
                            "output go at once; 0: every engine step (default: "
                            f"{DEFAULT_STREAM_BATCHING_INTERVAL_MS:g}, as Ray Serve LLM's "
                            "stream_batching_interval_ms); one process without a fleet streams every step")


def wants_fleet(args: argparse.Namespace) -> bool:
    """Whether parsed `tokenloom serve` flags ask for a fleet rather than one process."""
    return bool(args.data_parallel_size > 1 or args.data_parallel_backend == "ray" or args.autoscaling_config
                or args.prefill_replicas)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _stream_batching_interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= MAX_STREAM_BATCHING_INTERVAL_MS):
        raise argparse.ArgumentTypeError(
            f"must be a number of milliseconds from 0 to {MAX_STREAM_BATCHING_INTERVAL_MS:g}, got {text}")
    return value
