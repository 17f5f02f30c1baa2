"""Step-time cost models for the simulator: what one `LLMEngine.step()` costs, from the batch shape
(`StepFeatures`, engine/cost_model.py). Two models, both JSON round-trippable (`save_cost_model` /
`load_cost_model`):

`LinearCostModel` (``kind: linear``, engine/cost_model.py) — step time = intercept + Σ coef·feature, fitted
on measured (features, duration) pairs; `tokenloom calibrate` makes one.

`RooflineCostModel` (``kind: roofline``) — a preset for hardware this machine does not have, from
published peak numbers. Assumptions: the body's matmuls cost 2·params FLOPs a token, the LM head
2·vocab·hidden a sampled row, attention 4·layers·heads·head_dim a query-key pair; every step reads all
weights once plus the KV of every attended context token; step time = overhead + max(FLOPs / (peak ·
mfu), bytes / (bandwidth · mbu)); tensor parallelism over n GPUs scales peak and bandwidth by n with no
communication cost; swaps move KV blocks at ``host_bw`` (PCIe). mfu 0.5, mbu 0.8 and a 3 ms per-step
overhead are typical of a good serving engine, not measurements.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..engine.cost_model import LinearCostModel, StepFeatures
from ..model.config import ModelConfig

# -- presets from published numbers ------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16/fp16 FLOP/s
    mem_bw: float  # bytes/s
    memory_bytes: float
    host_bw: float = 25e9  # PCIe, for swap


HARDWARE = {
    "a100": Hardware("A100-SXM4-80GB", 312e12, 2.039e12, 80e9),
    "h100": Hardware("H100-SXM5-80GB", 989e12, 3.35e12, 80e9, 50e9),
    "l4": Hardware("L4-24GB", 121e12, 0.3e12, 24e9),
}

MODELS = {
    "llama-3-8b": ModelConfig(128256, 4096, 14336, 32, 32, 8, 500000.0, 1e-5, 8192, False),
    "llama-3-70b": ModelConfig(128256, 8192, 28672, 80, 64, 8, 500000.0, 1e-5, 8192, False),
    "mistral-7b": ModelConfig(32000, 4096, 14336, 32, 32, 8, 1e6, 1e-5, 32768, False),
    "smollm2-135m": ModelConfig(49152, 576, 1536, 30, 9, 3, 100000.0, 1e-5, 8192, True),
}


def body_params(cfg: ModelConfig) -> int:
    """Weights every token goes through (attention and MLP of all layers; no embedding, no LM head)."""
    hd = cfg.dim_per_head
    attn = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * cfg.hidden_size
    return cfg.num_layers * (attn + 3 * cfg.hidden_size * cfg.intermediate_size)


@dataclass
class RooflineCostModel:
    model: str
    hardware: str
    num_gpus: int = 1
    dtype_bytes: int = 2
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 0.003
    source: str = "preset"

    kind = "roofline"

    @property
    def model_config(self) -> ModelConfig:
        return MODELS[self.model]

    @property
    def weight_bytes(self) -> int:
        cfg = self.model_config
        head = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        return (body_params(cfg) + head) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_per_head * self.dtype_bytes

    def kv_memory_bytes(self, utilization: float = 0.9) -> int:
        """KV budget: this share of the GPUs' memory, minus the weights."""
        hw = HARDWARE[self.hardware]
        free = hw.memory_bytes * self.num_gpus * utilization - self.weight_bytes
        if free <= 0:
            raise ValueError(f"preset: {self.model} does not fit on {self.num_gpus} x {hw.name}")
        return int(free)

    def step_time(self, f: StepFeatures, _rng: random.Random) -> float:
        return self.predict(f)

    def predict(self, f: StepFeatures) -> float:
        cfg, hw = self.model_config, HARDWARE[self.hardware]
        flops = (
            2 * body_params(cfg) * f.tokens
            + 2 * cfg.vocab_size * cfg.hidden_size * f.sampled
            + 4 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * f.attn_pairs
        )
        nbytes = self.weight_bytes + self.kv_bytes_per_token * f.kv_read
        compute = flops / (hw.peak_flops * self.num_gpus * self.mfu)
        memory = nbytes / (hw.mem_bw * self.num_gpus * self.mbu)
        block_bytes = self.kv_bytes_per_token * 16
        return self.overhead_s + max(compute, memory) + f.swap_blocks * block_bytes / hw.host_bw

    def to_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


def preset(name: str) -> RooflineCostModel:
    """``MODEL@GPU`` or ``MODEL@GPUxN`` (tensor parallel over N GPUs), e.g. ``llama-3-8b@h100``."""
    model, _, gpu = name.lower().partition("@")
    gpu, _, count = gpu.partition("x")
    if model not in MODELS or gpu not in HARDWARE or (count and not count.isdigit()):
        raise ValueError(
            f"preset: {name!r} is not MODEL@GPU[xN] with MODEL in {', '.join(MODELS)} "
            f"and GPU in {', '.join(HARDWARE)}"
        )
    return RooflineCostModel(model, gpu, int(count or 1))


PRESETS = tuple(f"{m}@{g}" for m in MODELS for g in HARDWARE)

CostModel = LinearCostModel | RooflineCostModel


def cost_model_from_dict(d: dict) -> CostModel:
    kind = d.get("kind")
    if kind == "linear":
        return LinearCostModel(float(d["intercept"]), {k: float(v) for k, v in d["coef"].items()},
                               d.get("fit_stats", {}), d.get("source", ""), [float(q) for q in d.get("spread", [])])
    if kind == "roofline":
        names = {f.name for f in fields(RooflineCostModel)}
        return RooflineCostModel(**{k: v for k, v in d.items() if k in names})
    raise ValueError(f"cost model: unknown kind {kind!r} (expected linear or roofline)")


def save_cost_model(model: CostModel, path: str | Path, extra: dict | None = None) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**model.to_dict(), **(extra or {})}, indent=2) + "\n")


def load_cost_model(path: str | Path) -> CostModel:
    return cost_model_from_dict(json.loads(Path(path).read_text()))
