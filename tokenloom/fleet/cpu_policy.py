"""Ray's own processes give way to the engines on their cores (Linux scheduling policies, no Ray).

Beside its engine replicas a fleet runs a dozen Ray processes: gcs, raylet, agents, Serve's controller,
the board. Every Ray worker's main thread also wakes every 10 ms to check for signals (hard-wired in
Ray's core worker). On a small machine the engines use every core, so each of those wake-ups preempts
an engine thread, and a preempted thread stalls its partner at the next barrier of a parallel kernel.
Measured with one replica of two threads at 32 streams on 2 cores: the engine's threads were
preempted ~800 times a second behind Ray Serve against ~60 in plain `tokenloom serve`, a third of it by
the signal checks of the replica's own main thread, the board and the controller.

SCHED_BATCH (sched(7)) keeps a thread's fair share of the CPU, so nothing of Ray's is starved, but its
wake-ups no longer preempt a running thread: they wait for the scheduler's next tick, where they run
together. So the Ray processes a fleet starts run at SCHED_BATCH; new Ray workers inherit it, and an
engine replica puts its whole process back at SCHED_OTHER. (Its main thread's signal checks are among
those preemptions, but that thread also hands each call to the replica, which should not wait for a
tick.) Both are normal policies at the same nice value, so no privilege is needed either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

logger = logging.getLogger("tokenloom.fleet")


def descendants(pid: int) -> list[int]:
    """The processes started under `pid`, at any depth (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def set_policy(pids: Iterable[int], policy: int) -> int:
    """Every thread of these processes (threads they start later inherit their creator's policy).
    Returns how many threads were set; threads and processes gone meanwhile are skipped."""
    count = 0
    for pid in pids:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in threads:
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                count += 1
            except ProcessLookupError:
                pass
    return count


def ray_gives_way(ray_pids: Iterable[int]) -> None:
    """`tokenloom serve -dp N`, once Ray is up: its processes (and so every worker it starts) at
    SCHED_BATCH. Not allowed (a policy this process may not lower): logged, and the fleet runs as is."""
    try:
        threads = set_policy(ray_pids, os.SCHED_BATCH)
    except (OSError, AttributeError) as exc:  # AttributeError: no sched_setscheduler on this OS
        logger.warning("fleet: Ray's processes keep their CPU policy, so their wake-ups preempt the "
                       "engines (%r)", exc)
        return
    logger.info("fleet: Ray's processes run at SCHED_BATCH (%d threads): their wake-ups wait for the "
                "engines' scheduler tick", threads)


def engine_takes_cores() -> None:
    """An engine replica, at its start: every thread of its process back at SCHED_OTHER, so the
    engine's threads (started from these) and the serving of its calls preempt Ray's housekeeping."""
    try:
        set_policy([os.getpid()], os.SCHED_OTHER)
    except (OSError, AttributeError) as exc:
        logger.warning("engine replica: could not set its threads' CPU policy (%r)", exc)
