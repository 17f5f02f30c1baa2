"""When the engine gives freed heap pages back to the OS.

After a step that ran prompt tokens the heap's free pages go back to the OS: a prefill's activations
are freed into holes glibc keeps resident (measured: +100-170 MB over a serving run on Qwen2.5-0.5B).
A trim takes 0.2-3.4 ms (more when more was freed), so it runs only after a forward at least
1 / TRIM_MAX_SHARE times as long as the last trim took: a long prompt step always, a short one on a
small model only while trims stay cheap. Decode steps free into holes too, more slowly (a server
streaming one request crept by ~0.6 MB/s, measured), so a trim also runs once a TRIM_EVERY_S.

The heap is the process's: `use_one_arena` and a trim act on every engine the process runs.
"""

from __future__ import annotations

import time

from ..model.heap import trim_heap, use_one_arena

TRIM_MAX_SHARE = 0.03
TRIM_EVERY_S = 1.0


class HeapPolicy:
    def __init__(self):
        self.last_trim_s = 0.003  # how long the last heap trim took (TRIM_MAX_SHARE)
        use_one_arena()  # before a server starts the thread that steps this engine: trims then reach its heap
        self.last_trim_at = time.monotonic()

    def after_forward(self, ran_prompt: bool, forward_s: float) -> None:
        """Free heap pages back to the OS after a long enough prompt step, or once a TRIM_EVERY_S."""
        now = time.monotonic()
        if (ran_prompt and forward_s * TRIM_MAX_SHARE >= self.last_trim_s) or now - self.last_trim_at >= TRIM_EVERY_S:
            trim_heap()
            self.last_trim_at = time.monotonic()
            self.last_trim_s = self.last_trim_at - now
