"""Kept only for `tokenloom.sim.calibrate`'s import of `random_prompt_ids`: workloads live in
`tokenloom.bench.workload` (delete this module once calibrate imports from there)."""

from __future__ import annotations

from ..bench.workload import random_prompt_ids

__all__ = ["random_prompt_ids"]
