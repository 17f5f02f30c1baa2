"""PNG plots of lab runs (matplotlib, Agg backend): throughput, latency CDFs, occupancy, slot timelines."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from .driver import LabResult

REQUEST_COLOURS = [plt.cm.tab20(i) for i in range(20) if i not in (14, 15)]  # no greys: grey reads as idle
PLOTS = {
    "throughput": "throughput.png",
    "latency_cdf": "latency_cdf.png",
    "occupancy": "occupancy.png",
    "slots": "slot_timeline.png",
}


def plot_throughput(summaries: list[dict], path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [s["label"] for s in summaries]
    values = [s["throughput_tok_s"] for s in summaries]
    bars = ax.bar(labels, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput per batching mode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(results: list[LabResult], path: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for res in results:
        reqs = list(res.requests.values())
        for ax, values in ((axes[0], [r.latency for r in reqs]), (axes[1], [r.ttft for r in reqs])):
            xs = np.sort(values)
            ax.step(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), where="post", label=res.label)
    axes[0].set_xlabel("end-to-end latency (s)")
    axes[1].set_xlabel("time to first token (s)")
    for ax in axes:
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_occupancy(results: list[LabResult], path: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for res in results:
        t = [s.start - res.start for s in res.steps]
        ax.step(t, [s.num_seqs / res.run.batch_size for s in res.steps], where="post", label=res.label, lw=1)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("running seqs / batch size")
    ax.set_title("Batch occupancy over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def slot_image(res: LabResult) -> np.ndarray:
    """[slot, step] codes: 0 free, 1 idle (held by a finished or waiting request), 2+ request colour."""
    n = len(REQUEST_COLOURS)
    order = {rid: i for i, rid in enumerate(sorted(res.slots.slot_of))}
    img = np.zeros((res.slots.num_slots, len(res.steps)), dtype=int)
    for k, (owners, active) in enumerate(zip(res.slots.owners, res.slots.active, strict=True)):
        for slot, (owner, on) in enumerate(zip(owners, active, strict=True)):
            if owner is not None:
                img[slot, k] = 2 + order[owner] % n if on else 1
    return img


def slot_figure(results: list[LabResult]):
    """One panel per run, each over its own whole run: runs differ in length (static takes the most
    steps), and a shared axis would either squeeze the short runs or cut the long ones. Every x axis is
    in the same unit, steps, and says so."""
    colours = ["white", "black", *REQUEST_COLOURS]
    cmap = ListedColormap(colours)
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 1.5 * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results, strict=True):
        img = slot_image(res)
        num_steps = max(len(res.steps), 1)
        ax.imshow(
            img,
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=0,
            vmax=len(colours) - 1,
            extent=(0, num_steps, res.slots.num_slots - 0.5, -0.5),
        )
        ax.set_xlim(0, num_steps)
        ax.set_ylabel("slot")
        ax.set_xlabel("step", fontsize=8, labelpad=1)
        ax.tick_params(axis="x", labelsize=8)
        idle = res.slots.idle_slot_steps()
        ax.set_title(f"{res.label}: {len(res.steps)} steps (x axis: steps 0-{len(res.steps)}), "
                     f"{idle} idle slot-steps (black)", fontsize=9)
    fig.suptitle("Slot timeline: colour = request computing in the slot, black = held idle, white = free")
    fig.tight_layout()
    return fig


def plot_slots(results: list[LabResult], path: str) -> None:
    fig = slot_figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: list[LabResult], summaries: list[dict], out_dir: str) -> dict[str, str]:
    paths = {key: os.path.join(out_dir, name) for key, name in PLOTS.items()}
    plot_throughput(summaries, paths["throughput"])
    plot_latency_cdf(results, paths["latency_cdf"])
    plot_occupancy(results, paths["occupancy"])
    plot_slots(results, paths["slots"])
    return paths
