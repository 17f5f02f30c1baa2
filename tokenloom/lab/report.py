"""report.md for a lab run set: the command, the table, the continuous/static comparison, the plots."""

from __future__ import annotations

import os

TABLE_HEAD = (
    "| run | mode | policy | B | output tok/s | req/s | mean latency s | p50 latency s | p99 latency s "
    "| mean TTFT s | p50 TTFT s | p99 TTFT s | mean occupancy | steps | mean step ms |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def table(summaries: list[dict]) -> str:
    rows = []
    for s in summaries:
        lat, ttft = s["latency_s"], s["ttft_s"]
        rows.append(
            f"| {s['label']} | {s['mode']} | {s['policy']} | {s['batch_size']} | {s['throughput_tok_s']:.1f} "
            f"| {s['requests_per_s']:.2f} | {lat['mean']:.2f} | {lat['p50']:.2f} | {lat['p99']:.2f} "
            f"| {ttft['mean']:.2f} | {ttft['p50']:.2f} | {ttft['p99']:.2f} | {s['occupancy']:.0%} "
            f"| {s['num_steps']} | {s['mean_step_ms']:.1f} |\n"
        )
    return TABLE_HEAD + "".join(rows)


def comparison(cmps: list[dict]) -> str:
    rows = "".join(
        f"| {c['static']} | **{c['measured_ratio']:.2f}x** | {c['ideal_ratio']:.2f}x "
        f"| {c['fraction_of_ideal']:.0%} | {c['step_count_ratio']:.2f} | {c['step_cost_ratio']:.2f} |\n"
        for c in cmps
    )
    notes = "".join(f"- vs {c['static']}: {c['explanation']}\n" for c in cmps)
    return (
        "## Continuous vs static\n\n"
        "| static run | measured continuous/static throughput | ideal ratio | measured / ideal "
        "| step-count ratio | step-cost ratio (static/continuous) |\n|---|---|---|---|---|---|\n"
        f"{rows}\n"
        "Ideal ratio = sum over static batches of their longest output / (total output tokens / B), i.e. "
        "the ratio of step counts when every step costs the same; measured ratio = step-count ratio x "
        "step-cost ratio. `static` is the engine's static mode, which computes finished members' slots as "
        "padding until the batch ends.\n\n"
        f"{notes}"
    )


def write_report(
    path: str,
    command: str,
    workload: dict,
    summaries: list[dict],
    cmps: list[dict],
    plots: dict[str, str],
    trace_path: str,
    environment: str,
    forward_plan: str = "",
    replay_path: str | None = None,
) -> None:
    def rel(p: str) -> str:
        return os.path.relpath(p, os.path.dirname(path))

    parts = [
        "# Batching lab report\n\n",
        f"Command: `{command}`\n\n",
        f"{environment}\n\n",
        f"Forward path (the engine's start-up line): `{forward_plan or 'not reported by this model'}`\n\n",
        "Workload: " + ", ".join(f"{k} {v}" for k, v in workload.items()) + "\n\n",
        (
            "Every request arrives at t = 0 unless a request rate is given; greedy sampling with ignore_eos, "
            "so each request produces exactly its output length. Occupancy = mean over steps of running "
            "sequences / B. Latency and TTFT are measured from arrival. The runs are interleaved step by "
            "step, each engine timed by its own clock (which runs only during its steps), so every mode "
            "sees the same machine conditions.\n\n"
        ),
        table(summaries),
        "\n",
    ]
    if cmps:
        parts.append(comparison(cmps))
    parts.append("\n## Plots\n\n")
    for key, p in plots.items():
        parts.append(f"![{key}]({rel(p)})\n\n")
    parts.append(
        f"Chrome trace of every step and request: [{rel(trace_path)}]({rel(trace_path)}) "
        "(open in https://ui.perfetto.dev).\n"
    )
    if replay_path:
        parts.append(
            f"\nDashboard replay of every run, step by step: [{rel(replay_path)}]({rel(replay_path)}) "
            f"(`tokenloom dashboard-replay {os.path.dirname(path) or '.'}`, then open the URL it prints).\n"
        )
    with open(path, "w") as f:
        f.write("".join(parts))
