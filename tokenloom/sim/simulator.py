"""Discrete-event simulator: the real `LLMEngine`, scheduler and KV cache, with a cost model as the model.

`SimRunner` stands in for `ModelRunner`: for each planned step it advances a `VirtualClock` by the cost
model's predicted step time and returns one token for every sequence whose step reaches the end of its
known tokens (exactly the rows the real runner samples). Everything else — admission, chunked prefill,
preemption, prefix caching, batching modes, stop conditions, metrics timestamps — is the engine's own code.

`simulate(cost_model, workload)` replays the workload with `tokenloom.bench.replay`, the arrival-injection
loop the real engine runs under too (there on the wall clock; here idle time is skipped by jumping the
virtual clock to the next arrival), so simulated and measured `ReplayResult`s mean the same.
"""

from __future__ import annotations

import random

import torch

from ..bench.replay import ReplayResult, VirtualClock, replay
from ..bench.workload import WorkloadRequest
from ..config import EngineConfig
from ..engine.cost_model import StepFeatures, step_features
from ..engine.llm_engine import LLMEngine
from ..engine.snapshot_recording import SnapshotRecording
from ..model.config import ModelConfig
from ..step import Runner, StepPlan, StepResult, samples
from .cost_model import MODELS, CostModel

SIM_TOKEN_ID = 1000  # an ordinary token every simulated sequence "generates"


class SimRunner(Runner):
    """A runner whose forward is a cost-model prediction on a virtual clock."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock, block_size: int, token_id: int = SIM_TOKEN_ID,
                 seed: int = 0):
        self.cost_model = cost_model
        self.rng = random.Random(seed)  # a measured spread's draws (LinearCostModel.step_time)
        self.clock = clock
        self.block_size = block_size
        self.token_id = token_id
        self.last_forward_time = 0.0
        self.steps: list[tuple[StepFeatures, float]] = []

    def execute(self, plan: StepPlan) -> list[StepResult]:
        if plan.is_empty and not (plan.swap_in or plan.swap_out):
            self.last_forward_time = 0.0
            return []
        feats = step_features(plan.shape, self.block_size)
        dt = self.cost_model.step_time(feats, self.rng)
        self.clock.advance(dt)
        self.last_forward_time = dt
        self.steps.append((feats, dt))
        return [
            StepResult(seq, n, self.token_id if samples(seq, n) else None) for seq, n in plan.scheduled
        ]

    # Disaggregated prefill in the fleet simulator goes through the engine's own export_prefix_kv /
    # import_prefix_kv; there is no K/V here, only its shape's token count (dim 2), which they read.
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return torch.empty((0, 0, len(block_ids) * self.block_size, 0))

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        pass


def build_sim_engine(
    cost_model: CostModel,
    config: EngineConfig | None = None,
    model_config: ModelConfig | None = None,
    tokenizer=None,
    seed: int = 0,
) -> tuple[LLMEngine, VirtualClock]:
    """An `LLMEngine` over a `SimRunner`. The pretended model defaults to the preset's model (roofline
    cost models) or the bundled SmolLM2-135M (calibrated ones); the tokenizer only detokenizes. `seed`:
    the step times' draws, where the cost model has a spread."""
    if tokenizer is None:
        from ..model.loader import bundled_model_path
        from ..model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(bundled_model_path())
    if model_config is None:
        model_config = getattr(cost_model, "model_config", None) or MODELS["smollm2-135m"]
    config = config or EngineConfig()
    clock = VirtualClock()
    runner = SimRunner(cost_model, clock, config.block_size, seed=seed)
    engine = LLMEngine(config, tokenizer=tokenizer, runner=runner, model_config=model_config, clock=clock)
    return engine, clock


def simulate(
    cost_model: CostModel,
    workload: list[WorkloadRequest],
    config: EngineConfig | None = None,
    model_config: ModelConfig | None = None,
    tokenizer=None,
    record_frames: int = 0,
) -> ReplayResult:
    """Run `workload` through the real scheduler and KV cache on a virtual clock. `record_frames` > 0:
    also record up to that many dashboard snapshots (`result.snapshots`, a `SnapshotRecording`), the
    same hook and frames as the lab's, for `tokenloom dashboard-replay`."""
    engine, _ = build_sim_engine(cost_model, config, model_config, tokenizer)
    recording = SnapshotRecording(engine, "simulated", record_frames) if record_frames else None
    result = replay(engine, workload, on_step=recording.capture if recording else None)
    engine.check_kv_invariants()
    if recording is not None:
        recording.finish()
        result.snapshots = recording
    return result
