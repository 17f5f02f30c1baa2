"""Shared helpers for the fleet tests: start a fleet on its own local Ray cluster, find its replicas'
processes, read its per-replica metrics.

Two ways to start one, as an operator would:
- `FleetProcess`: `tokenloom serve --data-parallel-size N` (the front is this process's own HTTP server);
- `ServeRunFleet`: the application `serve run tokenloom.fleet.serve_run:build key=value ...` deploys
  (Ray Serve's HTTP proxy in front of the `FleetIngress` deployment), started by running this file as
  a script: `serve.run(serve_run.build(...))` with the proxy on a free port.
Either one stops with SIGTERM, taking its Ray cluster down with it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest_server import BASE_ARGS, ServerProcess, scrape

KV_BLOCKS = 96  # per replica: 1,536 tokens, below the 2,048-token context, so one request can outgrow it


class FleetProcess(ServerProcess):
    """`tokenloom serve` with a fleet's flags."""

    def __init__(self, args: list[str], replicas: list[str] = ("--data-parallel-size", "2"), **kwargs):
        super().__init__([*replicas, "--num-kv-blocks", str(KV_BLOCKS), *args], startup_timeout=300.0, **kwargs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        super().stop()


class ServeRunFleet(FleetProcess):
    """The same flags, deployed the way `serve run` deploys them (see the module docstring)."""

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), str(self.port), *BASE_ARGS, *args]


def _serve_run(port: int, flags: list[str]) -> None:
    """What `serve run tokenloom.fleet.serve_run:build key=value ...` does, each `--flag value` a
    `flag=value`, with the HTTP proxy on 127.0.0.1:`port` and Ray started as `tokenloom serve -dp N`
    starts it (no dashboard, workers not niced: fleet/app.py says why), until SIGTERM."""
    import ray
    from ray import serve

    from tokenloom.fleet.app import APP_NAME
    from tokenloom.fleet.serve_run import build
    from tokenloom.model.load import usable_cores

    cli_args = dict(zip((flag.removeprefix("--") for flag in flags[::2]), flags[1::2], strict=True))
    ray.init(num_cpus=usable_cores(), include_dashboard=False, _system_config={"worker_niceness": 0})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(cli_args), name=APP_NAME, route_prefix="/")
    signal.signal(signal.SIGTERM, lambda *_: None)  # handled, so that pause() returns
    signal.pause()
    serve.shutdown()
    ray.shutdown()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def replica_pids(fleet: ServerProcess, deployment: str) -> list[int]:
    """The processes of a deployment's replicas ("engine", "ingress", ...) in `fleet`'s Ray cluster
    (its workers descend from the fleet's process; another cluster on the machine is not counted)."""
    out = subprocess.run(["pgrep", "-f", f"ServeReplica:tokenloom:{deployment}"], capture_output=True, text=True,
                         check=False).stdout
    pids = []
    for pid in map(int, out.split()):
        ancestor = pid
        try:
            while ancestor > 1 and ancestor != fleet.proc.pid:
                ancestor = _parent(ancestor)
        except (FileNotFoundError, ProcessLookupError):  # it (or a parent) has just exited
            continue
        if ancestor == fleet.proc.pid:
            pids.append(pid)
    return pids


def replica_totals(url: str, name: str) -> tuple[dict[str, float], float]:
    """A metric's value per replica and the fleet's total line."""
    per, total = {}, None
    for key, value in scrape(url).items():
        base, _, labels = key.partition("{")
        if base != name:
            continue
        m = re.search(r'replica="([^"]+)"', labels)
        if m:
            per[m.group(1)] = value
        else:
            total = value
    return per, total


if __name__ == "__main__":
    _serve_run(int(sys.argv[1]), sys.argv[2:])
