"""What the dashboard costs the engine: decode step time with the dashboard off, on with no viewer,
and on with 10 viewers reading the stream at its highest rate (10 frames a second).

A real `tokenloom serve` of the bundled model (serving defaults) runs a fixed decode batch: `--streams`
concurrent streaming completions of `--tokens` tokens each (ignore_eos). The step time of a steady
batch is the gap between a stream's tokens, so each round's figure is the median over streams of
(last token - first token) / (tokens - 1).

Three measurements, because two servers differ by more than the effect asked about (up to 8% on a
shared 2-core machine, from where their memory landed):
- **0 viewers, in one process**: the only thing the engine pays with nobody watching is the recorder's
  step listener. The bundled model runs a steady decode batch in this process, the listener attached
  and detached in blocks of steps (ABBA order: contexts grow a token a step, so a plain alternation
  would bill the growth to whichever comes second); its own time is also clocked call by call, and the
  same comparison with nothing attached (a control) shows how far apart two equal settings come out.
- **10 viewers, and viewers coming and going, within one server**: rounds alternate (A B C C B A)
  between no viewer, 10 viewers reading, and viewers connecting, taking one frame and hanging up in a
  loop, on the same server, so drift hits all alike. The viewers are raw sockets that take the bytes and parse nothing,
  like browsers on other machines: on this 2-core machine a Python client parsing frames would bill
  its own CPU to the server.
- **off vs on, across servers**: one server with --disable-dashboard, then one with it, `--cycles`
  times; reported for completeness, with the spread between servers beside it.
The server's own count of the engine-thread time spent building snapshots (/dashboard/stats
`build_ms_total`) is reported too.

    .venv/bin/python benchmarks/dashboard_cost.py [--out benchmarks/results/dashboard_cost.json]

Waits while /work/notes/BENCH_LOCK exists (another benchmark runs), then holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest_server import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lock import holding_lock

PROMPT = "Tell me a long story about a lighthouse keeper."


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
    """`n` dashboard viewers at 10 frames a second: raw sockets that take every byte and parse nothing
    but a count of frames (a browser's parsing happens on the viewer's machine, not the server's)."""

    def __init__(self, port: int, n: int):
        self.stop = threading.Event()
        self.frames = [0] * n
        self.bytes = [0] * n
        self.started = time.perf_counter()
        self.threads = [threading.Thread(target=self._read, args=(port, i), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _read(self, port: int, i: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /dashboard/stream?rate=10 HTTP/1.1\r\nHost: bench\r\n\r\n")
            while not self.stop.is_set():
                data = sock.recv(1 << 20)
                if not data:
                    return
                self.bytes[i] += len(data)
                self.frames[i] += data.count(b"data: ")  # a split across two reads is missed: a count to report

    def close(self) -> tuple[int, int, float]:
        """(frames and bytes read by all viewers, seconds they were connected)."""
        self.stop.set()
        for t in self.threads:
            t.join(30)
        return sum(self.frames), sum(self.bytes), time.perf_counter() - self.started


class Churn:
    """Viewers coming and going in a loop, one after another: each connects, takes its first frame and
    hangs up (the issue's 50 viewers connecting and vanishing, kept up for a whole round)."""

    def __init__(self, port: int):
        self.stop = threading.Event()
        self.count = 0
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._loop, args=(port,), daemon=True)
        self.thread.start()

    def _loop(self, port: int) -> None:
        while not self.stop.is_set():
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"GET /dashboard/stream?rate=10 HTTP/1.1\r\nHost: bench\r\n\r\n")
                seen = b""
                while b"data: " not in seen and (data := sock.recv(1 << 16)):
                    seen = seen[-8:] + data
            self.count += 1

    def close(self) -> int:
        """How many viewers came and went."""
        self.stop.set()
        self.thread.join(30)
        return self.count


def warm_up(url: str, streams: int) -> None:
    round_step_time(url, streams, 16)


def abba(i: int) -> bool:
    """Whether turn `i` is B in the order A B B A A B B A ...: a steady drift (contexts growing by a
    token a step, a server warming) then falls on both settings alike instead of always on B."""
    return i % 4 in (1, 2)


def listener_cost_in_process(streams: int, blocks: int, steps_per_block: int) -> dict:
    """The recorder's step listener with nobody watching: a steady decode batch of the bundled model in
    this process, blocks of steps in ABBA order, B with the listener attached; and the same comparison
    with nothing attached to B (the control: how far apart A and B come out by chance)."""
    from tokenloom.engine.snapshot import EngineRecorder
    from tokenloom.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    engine = LLM(quantization="auto").engine
    params = SamplingParams(max_tokens=4 * blocks * steps_per_block + 64, ignore_eos=True, temperature=0)
    for i in range(streams):
        engine.add_request(f"r{i}", PROMPT, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # past the prompts: only decode steps are compared
    recorder = EngineRecorder(engine)
    engine.step_listeners.remove(recorder.on_step)
    listener_s, timed_steps = 0.0, 0

    def timed_listener(stats, outputs) -> None:
        nonlocal listener_s, timed_steps
        t0 = time.perf_counter()
        recorder.on_step(stats, outputs)
        listener_s += time.perf_counter() - t0
        timed_steps += 1

    def b_over_a(listener) -> tuple[float, dict]:
        step_ms: dict[str, list[float]] = {"A": [], "B": []}
        for block in range(2 * blocks):
            b = abba(block)
            if b and listener is not None:
                engine.step_listeners.append(listener)
            t0 = time.perf_counter()
            for _ in range(steps_per_block):
                engine.step()
            step_ms["B" if b else "A"].append((time.perf_counter() - t0) / steps_per_block * 1000)
            if b and listener is not None:
                engine.step_listeners.remove(listener)
        med = {k: statistics.median(v) for k, v in step_ms.items()}
        return med["B"] / med["A"], {k: round(v, 4) for k, v in med.items()}

    control, control_ms = b_over_a(None)
    ratio, step_ms = b_over_a(timed_listener)
    for i in range(streams):
        engine.abort_request(f"r{i}")
    return {
        "workload": f"{streams} sequences decoding, bundled SmolLM2, serving defaults; {blocks} blocks of "
                    f"{steps_per_block} steps each way, in ABBA order",
        "step_ms_median": {"detached (A)": step_ms["A"], "attached (B)": step_ms["B"]},
        "ratio_attached_vs_detached": round(ratio, 4),
        "control_ratio_detached_vs_detached": round(control, 4),
        "control_step_ms_median": control_ms,
        "listener_us_per_step": round(listener_s / timed_steps * 1e6, 2),
        "listener_share_of_step": round(listener_s / timed_steps / (step_ms["B"] / 1000), 6),
    }


def within_one_server(args) -> dict:
    name = f"{args.viewers}_viewers"
    rounds: dict[str, list[float]] = {"0_viewers": [], name: [], "churn": []}
    frames = nbytes = churned = 0
    watched_s = churn_s = 0.0
    srv = ServerProcess(["--quantization", "auto"])
    try:
        warm_up(srv.url, args.streams)
        # A B C C B A ...: no viewer, `viewers` steady viewers, viewers coming and going in a loop.
        for setting in ["0_viewers", name, "churn", "churn", name, "0_viewers"] * (args.alternations // 2):
            if setting == "0_viewers":
                rounds[setting].append(round_step_time(srv.url, args.streams, args.tokens))
            elif setting == "churn":
                churn = Churn(srv.port)
                rounds[setting].append(round_step_time(srv.url, args.streams, args.tokens))
                churned, churn_s = churned + churn.close(), churn_s + time.perf_counter() - churn.started
            else:
                viewers = Viewers(srv.port, args.viewers)
                time.sleep(1.0)  # every viewer connected and reading
                rounds[setting].append(round_step_time(srv.url, args.streams, args.tokens))
                read, got, seconds = viewers.close()
                frames, nbytes, watched_s = frames + read, nbytes + got, watched_s + seconds
            print(f"{setting}: {rounds[setting][-1]:.3f} ms", flush=True)
        time.sleep(1.0)
        stats = httpx.get(f"{srv.url}/dashboard/stats", timeout=10).json()
    finally:
        srv.stop()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    return {
        "step_ms_rounds": {k: [round(x, 3) for x in v] for k, v in rounds.items()},
        "step_ms_median": {k: round(v, 3) for k, v in med.items()},
        f"ratio_{name}_vs_0": round(med[name] / med["0_viewers"], 4),
        "ratio_churn_vs_0": round(med["churn"] / med["0_viewers"], 4),
        "churn_viewers_per_s": round(churned / churn_s, 1) if churn_s else None,
        "snapshots": stats["snapshots"],
        "snapshot_build_ms_mean": round(stats["build_ms_total"] / stats["snapshots"], 3) if stats["snapshots"] else None,
        "frames_read": frames,
        "frames_per_viewer_per_s": round(frames / args.viewers / watched_s, 2) if watched_s else None,
        "kbytes_per_frame": round(nbytes / frames / 1000, 1) if frames else None,
        "viewers_left_at_end": stats["viewers"],
    }


def across_servers(args) -> dict:
    rounds: dict[str, list[float]] = {"off": [], "on_0_viewers": []}
    for cycle in range(args.cycles):
        for setting, flags in (("off", ["--disable-dashboard"]), ("on_0_viewers", [])):
            srv = ServerProcess(["--quantization", "auto", *flags])
            try:
                warm_up(srv.url, args.streams)
                server_rounds = [round_step_time(srv.url, args.streams, args.tokens) for _ in range(args.rounds)]
            finally:
                srv.stop()
            rounds[setting].append(statistics.median(server_rounds))
            print(f"cycle {cycle}: {setting} {server_rounds}", flush=True)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    every = [x for v in rounds.values() for x in v]
    return {
        "step_ms_per_server": {k: [round(x, 3) for x in v] for k, v in rounds.items()},
        "step_ms_median": {k: round(v, 3) for k, v in med.items()},
        "ratio_on_0_viewers_vs_off": round(med["on_0_viewers"] / med["off"], 4),
        "spread_between_servers": round(max(every) / min(every) - 1, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--viewers", type=int, default=10)
    ap.add_argument("--alternations", type=int, default=8, help="rounds of each setting in one server (even)")
    ap.add_argument("--blocks", type=int, default=20, help="in-process blocks of steps each way")
    ap.add_argument("--steps-per-block", type=int, default=25)
    ap.add_argument("--cycles", type=int, default=2, help="off server then on server, this many times")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per server in the across-servers part")
    ap.add_argument("--out", default="benchmarks/results/dashboard_cost.json")
    args = ap.parse_args()

    with holding_lock():
        in_process = listener_cost_in_process(args.streams, args.blocks, args.steps_per_block)
        print(json.dumps(in_process, indent=2), flush=True)
        one_server = within_one_server(args)
        servers = across_servers(args)
    report = {
        "command": "python benchmarks/dashboard_cost.py " + " ".join(sys.argv[1:]),
        "workload": f"{args.streams} concurrent streaming completions x {args.tokens} tokens, bundled SmolLM2, "
                    "serving defaults; step time = median over streams of the time per output token",
        "targets": "0 viewers < 1% slower, 10 viewers < 3% slower than the dashboard off (issue 25)",
        "no_viewer_listener_in_process": in_process,
        "viewers_within_one_server": one_server,
        "off_vs_on_across_servers": servers,
        "cpu_count": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
