"""Scheduling policies: the order in which waiting sequences are admitted, and which running
sequence is preempted first when KV memory runs out.

A policy is a sort key; smaller keys run sooner and are preempted last. Arrival time breaks ties,
so a sequence preempted by recompute (which keeps its arrival time) goes back to the front under FCFS.
"""

from __future__ import annotations

from collections.abc import Callable

from ..step import Sequence

PolicyKey = Callable[[Sequence, float], tuple]


def fcfs_key(seq: Sequence, now: float) -> tuple:
    return (seq.times.arrival,)


def sjf_key(seq: Sequence, now: float) -> tuple:
    """Shortest job first by the predicted output length if given, else by `max_tokens`; a request
    already partly done counts only what it has left."""
    p = seq.params
    expected = p.predicted_output_len or p.max_tokens or 1 << 30
    return (max(expected - seq.num_output_tokens, 0), seq.times.arrival)


def make_priority_key(aging_s: float) -> PolicyKey:
    """Lower `priority` runs sooner (vLLM's convention). Aging: a sequence gains one priority level for
    every `aging_s` seconds it has existed, so a low-priority request cannot starve behind a steady
    stream of high-priority ones."""

    def priority_key(seq: Sequence, now: float) -> tuple:
        age_bonus = (now - seq.times.arrival) / aging_s if aging_s > 0 else 0.0
        return (seq.params.priority - age_bonus, seq.times.arrival)

    return priority_key


def get_policy(name: str, aging_s: float = 10.0) -> PolicyKey:
    policies = {"fcfs": fcfs_key, "sjf": sjf_key, "priority": make_priority_key(aging_s)}
    if name not in policies:
        raise ValueError(f"scheduling_policy must be fcfs, sjf or priority, got {name!r}")
    return policies[name]
