"""The ideal continuous/static throughput ratio of a workload (pure arithmetic, no engine).

Static batching with batch size B runs consecutive groups of B requests (in admission order), each
for as many decode steps as its longest output. Perfect continuous batching keeps all B slots busy,
so it needs total output tokens / B steps. With equal step costs the throughput ratio is

    ideal = sum over static batches of max(output lengths in the batch) / (total output tokens / B)

Example: outputs [16, 256, 16, 16] with B = 2 -> batches [16, 256], [16, 16] -> 256 + 16 = 272
static steps against 304 / 2 = 152 continuous steps: ideal ratio 272 / 152 = 1.789.
"""

from __future__ import annotations

from collections.abc import Sequence


def static_batches(output_lens: Sequence[int], batch_size: int) -> list[list[int]]:
    if batch_size <= 0:
        raise ValueError(f"batch_size: must be positive (got {batch_size})")
    return [list(output_lens[i : i + batch_size]) for i in range(0, len(output_lens), batch_size)]


def static_batch_steps(output_lens: Sequence[int], batch_size: int) -> int:
    """Decode steps static batching needs: the sum of each batch's longest output."""
    return sum(max(batch) for batch in static_batches(output_lens, batch_size))


def continuous_steps(output_lens: Sequence[int], batch_size: int) -> float:
    """Steps perfectly packed continuous batching needs: total output tokens / B."""
    return sum(output_lens) / batch_size


def ideal_ratio(output_lens: Sequence[int], batch_size: int) -> float:
    if not output_lens:
        raise ValueError("output_lens: must not be empty")
    return static_batch_steps(output_lens, batch_size) / continuous_steps(output_lens, batch_size)
