"""What the dashboard costs the engine: decode step time with the dashboard off, on with no viewer,
and on with 10 viewers reading the stream at its highest rate (10 frames a second).

A real `tokenloom serve` of the bundled model (serving defaults) runs a fixed decode batch: `--streams`
concurrent streaming completions of `--tokens` tokens each (ignore_eos). The step time of a steady
batch is the gap between a stream's tokens, so each round's figure is the median over streams of
(last token - first token) / (tokens - 1). One server at a time (a shared 2-core machine): the
server with --disable-dashboard, then one with the dashboard whose rounds alternate between no viewer
and 10 viewers, the pair repeated `--cycles` times so drift hits each setting alike; medians of the
rounds are compared. The server's own count of the engine-thread time spent building snapshots
(/dashboard/stats `build_ms_total`) is reported beside it.

    .venv/bin/python benchmarks/dashboard_cost.py [--out benchmarks/results/dashboard_cost.json]

Waits while /work/notes/BENCH_LOCK exists (another benchmark runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest_server import ServerProcess

LOCK = Path("/work/notes/BENCH_LOCK")
PROMPT = "Tell me a long story about a lighthouse keeper."


def wait_for_lock() -> None:
    while LOCK.exists():
        print("waiting: another benchmark holds", LOCK, flush=True)
        time.sleep(20)


def one_stream(url: str, tokens: int, out: list) -> None:
    times = []
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    if len(times) > 2:
        out.append((times[-1] - times[0]) / (len(times) - 1))


def round_step_time(url: str, streams: int, tokens: int) -> float:
    """The median over streams of the time per token of a steady decode batch, in ms."""
    per_stream: list[float] = []
    workers = [threading.Thread(target=one_stream, args=(url, tokens, per_stream)) for _ in range(streams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return statistics.median(per_stream) * 1000


class Viewers:
    """`n` dashboard viewers reading every frame at 10 a second (and throwing them away)."""

    def __init__(self, url: str, n: int):
        self.stop = threading.Event()
        self.frames = [0] * n
        self.started = time.perf_counter()
        self.threads = [threading.Thread(target=self._read, args=(url, i), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _read(self, url: str, i: int) -> None:
        with httpx.stream("GET", f"{url}/dashboard/stream", params={"rate": "10"}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.frames[i] += 1
                if self.stop.is_set():
                    return

    def close(self) -> tuple[int, float]:
        """(frames read by all viewers, seconds they were connected)."""
        self.stop.set()
        for t in self.threads:
            t.join(30)
        return sum(self.frames), time.perf_counter() - self.started


def warm_up(url: str, streams: int) -> None:
    round_step_time(url, streams, 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--viewers", type=int, default=10)
    ap.add_argument("--cycles", type=int, default=2, help="off server, then on server, this many times")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per setting per cycle")
    ap.add_argument("--out", default="benchmarks/results/dashboard_cost.json")
    args = ap.parse_args()

    results: dict[str, list[float]] = {"off": [], "on_0_viewers": [], f"on_{args.viewers}_viewers": []}
    build_ms, snapshots, frames, watched_s = 0.0, 0, 0, 0.0
    for cycle in range(args.cycles):
        wait_for_lock()
        srv = ServerProcess(["--quantization", "auto", "--disable-dashboard"])
        try:
            warm_up(srv.url, args.streams)
            for _ in range(args.rounds):
                results["off"].append(round_step_time(srv.url, args.streams, args.tokens))
            print(f"cycle {cycle}: off {results['off'][-args.rounds:]}", flush=True)
        finally:
            srv.stop()
        wait_for_lock()
        srv = ServerProcess(["--quantization", "auto"])
        try:
            warm_up(srv.url, args.streams)
            for _ in range(args.rounds):
                results["on_0_viewers"].append(round_step_time(srv.url, args.streams, args.tokens))
                viewers = Viewers(srv.url, args.viewers)
                time.sleep(1.0)  # every viewer connected and reading
                results[f"on_{args.viewers}_viewers"].append(round_step_time(srv.url, args.streams, args.tokens))
                read, seconds = viewers.close()
                frames, watched_s = frames + read, watched_s + seconds
            stats = httpx.get(f"{srv.url}/dashboard/stats", timeout=10).json()
            build_ms += stats["build_ms_total"]
            snapshots += stats["snapshots"]
            print(f"cycle {cycle}: on, 0 viewers {results['on_0_viewers'][-args.rounds:]}, "
                  f"{args.viewers} viewers {results[f'on_{args.viewers}_viewers'][-args.rounds:]}", flush=True)
        finally:
            srv.stop()

    med = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "command": "python benchmarks/dashboard_cost.py " + " ".join(sys.argv[1:]),
        "workload": f"{args.streams} concurrent streaming completions x {args.tokens} tokens, bundled SmolLM2, "
                    "serving defaults; step time = median over streams of the time per output token",
        "step_ms_rounds": {k: [round(x, 3) for x in v] for k, v in results.items()},
        "step_ms_median": {k: round(v, 3) for k, v in med.items()},
        "ratio_0_viewers_vs_off": round(med["on_0_viewers"] / med["off"], 4),
        f"ratio_{args.viewers}_viewers_vs_off": round(med[f"on_{args.viewers}_viewers"] / med["off"], 4),
        "snapshot_build_ms_mean": round(build_ms / snapshots, 3) if snapshots else None,
        "snapshots": snapshots,
        "frames_read_by_viewers": frames,
        "frames_per_viewer_per_s": round(frames / args.viewers / watched_s, 2) if watched_s else None,
        "snapshot_build_share_of_engine_time_at_10_hz": round(build_ms / snapshots * 10 / 1000, 5) if snapshots else None,
        "targets": "0 viewers < 1% slower, 10 viewers < 3% slower (issue 25)",
        "cpu_count": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
