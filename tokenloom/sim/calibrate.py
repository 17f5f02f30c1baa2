"""Calibration: measure real step times across batch shapes and fit the simulator's linear cost model.

`StepRecorder` listens to an engine's steps: it pairs each step's `StepFeatures` (from the batch shape
in `StepStats.shape`) with the step's measured wall time (`StepStats.duration`: schedule, inputs,
forward, sampling, detokenization — everything `step()` does, which is what the simulator's clock
must advance by).

`calibrate(engine)` runs a grid of shapes on the real engine: for each (batch, prompt length, output
length), `batch` requests arrive together, so the steps cover prefill chunks of every size the token
budget cuts, steps mixing the last prefill chunk with the first decodes, and decode batches at growing
contexts; one staggered run adds a new prompt every few decode steps (prefill chunks inside decode
batches). The first run is a warm-up and is not recorded. `fit_linear` then fits the model.
"""

from __future__ import annotations

import platform
import random
import time

import torch

from ..bench.workload import random_prompt_ids
from ..engine.cost_model import LinearCostModel, StepFeatures, fit_linear, step_features
from ..engine.llm_engine import LLMEngine
from ..model.plan import plan_line
from ..sampling_params import SamplingParams

# (batch, prompt_len, output_len): decode batches from 1 to 64 at short and long contexts, prefill
# chunks up to the full budget, and their mixes at the prefill/decode boundary.
GRID = [
    (1, 32, 24), (1, 512, 8), (2, 256, 16), (4, 128, 24), (8, 256, 16), (16, 128, 24),
    (24, 128, 16), (32, 64, 24), (48, 96, 16), (64, 32, 24), (64, 64, 12),
]
QUICK_GRID = [(1, 32, 12), (1, 512, 4), (4, 128, 12), (16, 128, 12), (32, 64, 12), (64, 32, 12)]
STAGGERED = (16, 96, 48, 4, 256)  # batch, prompt, output; one extra prompt of 256 tokens every 4 steps


class StepRecorder:
    """Step listener that records (features, measured step seconds) for every non-empty step."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.samples: list[tuple[StepFeatures, float]] = []
        self.enabled = True
        engine.step_listeners.append(self._on_step)

    def _on_step(self, stats, _outputs) -> None:
        if self.enabled and stats.shape.rows:
            self.samples.append((step_features(stats.shape, self.engine.config.block_size), stats.duration))

    def detach(self) -> None:
        self.engine.step_listeners.remove(self._on_step)


def _run_batch(engine: LLMEngine, rng: random.Random, tag: str, batch: int, prompt_len: int, output_len: int,
               extra_every: int = 0, extra_len: int = 0, extra_count: int = 0) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"cal-{tag}-{i}", {"prompt_token_ids": random_prompt_ids(rng, prompt_len)}, params)
    steps = added = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if extra_every and added < extra_count and steps % extra_every == 0:
            ids = random_prompt_ids(rng, extra_len)
            engine.add_request(f"cal-{tag}-x{added}", {"prompt_token_ids": ids}, params)
            added += 1


def calibrate(
    engine: LLMEngine, quick: bool = False, seed: int = 0, log=print, grid: list | None = None
) -> tuple[LinearCostModel, list]:
    """Measure the grid on `engine` and fit; returns the model and the raw (features, seconds) samples."""
    rng = random.Random(seed)
    rec = StepRecorder(engine)
    try:
        rec.enabled = False
        _run_batch(engine, rng, "warmup", 4, 64, 4)
        rec.enabled = True
        grid = grid or (QUICK_GRID if quick else GRID)
        for k, shape in enumerate(grid):
            start = time.perf_counter()
            _run_batch(engine, rng, f"g{k}", *shape)
            log(f"calibrate: batch {shape[0]:3d} prompt {shape[1]:4d} output {shape[2]:3d}: "
                f"{time.perf_counter() - start:6.1f}s, {len(rec.samples)} steps so far")
        if not quick:
            b, p, o, every, extra = STAGGERED
            _run_batch(engine, rng, "stagger", b, p, o, every, extra, 8)
    finally:
        rec.detach()
    source = (f"tokenloom calibrate on {platform.machine()} / {torch.get_num_threads()} torch threads, "
              f"dtype {engine.config.dtype}, quantization {engine.config.quantization or 'none'}, "
              f"{'quick' if quick else 'full'} grid")
    return fit_linear(rec.samples, source=source), rec.samples


def calibration_record(model: LinearCostModel, engine: LLMEngine, quick: bool) -> dict:
    """Extra JSON fields saved beside the coefficients: what was measured, where."""
    cfg = engine.config
    return {
        "engine": {"model": cfg.model or "bundled SmolLM2-135M-Instruct", "dtype": cfg.dtype,
                   "quantization": cfg.quantization or "none", "kv_cache_dtype": cfg.kv_cache_dtype,
                   "max_num_batched_tokens": cfg.max_num_batched_tokens, "block_size": cfg.block_size,
                   "num_threads": torch.get_num_threads()},
        "forward_plan": plan_line(engine.model),
        "grid": QUICK_GRID if quick else [*GRID, STAGGERED],
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "formula": "step_s = intercept + sum(coef[f] * feature f); features in tokenloom/engine/cost_model.py",
    }
