"""PNG plots of a fleet sweep (matplotlib, Agg backend), from its records (`fleet_report.run_record`):
goodput vs request rate per policy, prefix-cache hit rate per policy, TTFT CDF per policy at the highest
rate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _by_policy(records: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["policy"], []).append(r)
    return {p: sorted(rs, key=lambda r: r["request_rate"]) for p, rs in out.items()}


def plot_goodput(records: Sequence[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, rs in _by_policy(records).items():
        rates = [r["request_rate"] for r in rs]
        key = "goodput" if rs[0]["goodput"] is not None else "request_throughput"
        ax.plot(rates, [r[key] for r in rs], marker="o", label=policy)
    top = max(r["request_rate"] for r in records)
    ax.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="offered load")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s within the SLO)" if records[0]["goodput"] is not None else "throughput (req/s)")
    ax.set_title(f"{records[0]['replicas']} simulated replicas: goodput vs load")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hit_rate(records: Sequence[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, rs in _by_policy(records).items():
        ax.plot([r["request_rate"] for r in rs], [r["prefix_hit_rate"] for r in rs], marker="o", label=policy)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_ylim(0, 1)
    ax.set_title("Fleet prefix-cache hit rate per routing policy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_cdf(records: Sequence[dict], path: Path) -> None:
    top = max(r["request_rate"] for r in records)
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, rs in _by_policy(records).items():
        r = next(r for r in rs if r["request_rate"] == top)
        qs = r["ttft_quantiles_ms"]
        ax.plot(qs, [i / (len(qs) - 1) for i in range(len(qs))], label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF at {top:g} req/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(records: Sequence[dict], out_dir: Path, name: str) -> list[Path]:
    paths = []
    for suffix, plot in (("goodput", plot_goodput), ("hit_rate", plot_hit_rate), ("ttft_cdf", plot_ttft_cdf)):
        path = out_dir / f"{name}_{suffix}.png"
        plot(records, path)
        paths.append(path)
    return paths
