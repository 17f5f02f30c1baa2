"""Batch-slot assignment for the slot timeline, computed from the recorded steps.

A request takes the lowest free slot the first time it is scheduled and keeps it until it finishes
(a preempted request keeps its slot, shown idle). With `hold_until_batch_end` (static and dynamic
batching) a finished request's slot stays idle -- the padding of a static batch -- until every
request holding a slot has finished, then all slots are free for the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .recorder import StepRecord


@dataclass
class SlotTimeline:
    num_slots: int
    owners: list[list[str | None]]  # [step][slot]: the request holding the slot, None when free
    active: list[list[bool]]  # [step][slot]: the holder computed in this step (False + owner = idle)
    slot_of: dict[str, int]

    def idle_slot_steps(self) -> int:
        """Slot-steps held by a request that did not compute (padding in static batching)."""
        return sum(
            o is not None and not a
            for row_o, row_a in zip(self.owners, self.active, strict=True)
            for o, a in zip(row_o, row_a, strict=True)
        )


def assign_slots(steps: list[StepRecord], hold_until_batch_end: bool) -> SlotTimeline:
    holders: list[str | None] = []
    done: set[str] = set()
    slot_of: dict[str, int] = {}
    owners, active = [], []
    for step in steps:
        for rid in step.request_ids:
            if rid in slot_of and holders[slot_of[rid]] == rid:
                continue
            free = next((i for i, h in enumerate(holders) if h is None), None)
            if free is None:
                free = len(holders)
                holders.append(None)
            holders[free] = rid
            slot_of[rid] = free
        running = set(step.request_ids)
        owners.append(list(holders))
        active.append([h is not None and h in running for h in holders])
        for rid in step.finished_ids:
            if rid not in slot_of:
                continue
            if hold_until_batch_end:
                done.add(rid)
            else:
                holders[slot_of[rid]] = None
        if hold_until_batch_end and holders and all(h is None or h in done for h in holders):
            holders = [None] * len(holders)
    width = len(holders)
    owners = [row + [None] * (width - len(row)) for row in owners]
    active = [row + [False] * (width - len(row)) for row in active]
    return SlotTimeline(width, owners, active, slot_of)
