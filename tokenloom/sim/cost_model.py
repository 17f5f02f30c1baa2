"""Step-time cost models for the simulator: what one `LLMEngine.step()` costs, from the batch shape.

`step_features(shape)` describes the batch shape of a planned step (`StepPlan.shape`, `StepStats.shape`):

- ``tokens``: tokens computed (rows through every matmul of the model body);
- ``sampled``: sequences that sample a token (rows through the LM head, the sampler, the detokenizer);
- ``seqs`` / ``prefill_seqs``: sequences in the step / those with a multi-token chunk (per-sequence
  bookkeeping and one attention call per prefill chunk);
- ``decode_kv``: decode sequences × their longest context, rounded up to whole blocks (the decode
  attention reads a padded [decodes, longest context] gather of the cache);
- ``prefill_attn``: query-key pairs of the prefill chunks, sum of chunk length × context;
- ``attn_pairs`` / ``kv_read``: query-key pairs / context tokens read, over all sequences, unpadded;
- ``swap_blocks``: KV blocks copied to or from the host pool.

Two models, both JSON round-trippable (`save_cost_model` / `load_cost_model`):

`LinearCostModel` (``kind: linear``) — step time = intercept + Σ coef·feature, fitted by non-negative
least squares on relative error (`fit_linear`) on measured (features, duration) pairs; `tokenloom calibrate` makes one.

`RooflineCostModel` (``kind: roofline``) — a preset for hardware this machine does not have, from
published peak numbers. Assumptions: the body's matmuls cost 2·params FLOPs a token, the LM head
2·vocab·hidden a sampled row, attention 4·layers·heads·head_dim a query-key pair; every step reads all
weights once plus the KV of every attended context token; step time = overhead + max(FLOPs / (peak ·
mfu), bytes / (bandwidth · mbu)); tensor parallelism over n GPUs scales peak and bandwidth by n with no
communication cost; swaps move KV blocks at ``host_bw`` (PCIe). mfu 0.5, mbu 0.8 and a 3 ms per-step
overhead are typical of a good serving engine, not measurements.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from ..model.config import ModelConfig
from ..step import StepShape, is_decode

LINEAR_FEATURES = ("tokens", "sampled", "seqs", "prefill_seqs", "decode_kv", "prefill_attn")


@dataclass
class StepFeatures:
    tokens: int = 0
    sampled: int = 0
    seqs: int = 0
    prefill_seqs: int = 0
    decode_kv: int = 0
    prefill_attn: int = 0
    attn_pairs: int = 0
    kv_read: int = 0
    swap_blocks: int = 0

    def vector(self, names: tuple[str, ...]) -> list[float]:
        return [float(getattr(self, n)) for n in names]


def step_features(shape: StepShape, block_size: int) -> StepFeatures:
    f = StepFeatures(sampled=shape.num_sampled, swap_blocks=shape.num_swap_blocks)
    decodes, longest = 0, 0
    for n, ctx in shape.rows:
        f.tokens += n
        f.seqs += 1
        f.attn_pairs += n * ctx
        f.kv_read += ctx
        if is_decode(n):
            decodes += 1
            longest = max(longest, ctx)
        else:
            f.prefill_seqs += 1
            f.prefill_attn += n * ctx
    f.decode_kv = decodes * (-(-longest // block_size) * block_size)
    return f


# -- the measured model -----------------------------------------------------------------------------


@dataclass
class LinearCostModel:
    intercept: float
    coef: dict[str, float]
    fit_stats: dict = field(default_factory=dict)  # samples, r2, median/p90 relative error of the fit
    source: str = ""
    # Measured / predicted step time at evenly spaced quantiles (0%, ..., 100%) over the fitted steps, or
    # empty: a served engine's steps vary with what else runs on the machine, and `step_time` draws from
    # that spread (see `with_spread`). Empty: every step takes its prediction.
    spread: list[float] = field(default_factory=list)

    kind = "linear"

    def predict(self, f: StepFeatures) -> float:
        return self.intercept + sum(c * getattr(f, name) for name, c in self.coef.items())

    def step_time(self, f: StepFeatures, rng: random.Random) -> float:
        """One step's time: the prediction scaled by a draw from the measured spread."""
        if not self.spread:
            return self.predict(f)
        return self.predict(f) * float(np.interp(rng.random(), np.linspace(0, 1, len(self.spread)), self.spread))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "intercept": self.intercept, "coef": self.coef,
                "fit_stats": self.fit_stats, "source": self.source, "spread": self.spread}


def with_spread(model: LinearCostModel, samples: list[tuple[StepFeatures, float]],
                quantiles: int = 101) -> LinearCostModel:
    """`model` with the spread of measured / predicted over `samples`, all of them (the fit drops a
    shared machine's hiccups; a served engine's hiccups are part of what its requests wait for)."""
    ratios = np.array([d / model.predict(f) for f, d in samples])
    return dataclasses.replace(model, spread=[float(q) for q in np.quantile(ratios, np.linspace(0, 1, quantiles))])


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares, min |a x - b| with x >= 0 (Lawson & Hanson's active-set method)."""
    _m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=0) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit_linear(
    samples: list[tuple[StepFeatures, float]], names: tuple[str, ...] = LINEAR_FEATURES, source: str = ""
) -> LinearCostModel:
    """Fit intercept + coefficients (all >= 0) to (features, seconds) pairs, minimising *relative* error
    (rows weighted by 1/duration, so 20 ms decode steps count as much as 1 s prefill steps: TPOT and
    TTFT depend on both). Steps off the first fit by more than max(25%, 3x its median error) — a shared
    machine's hiccups — are dropped once and the model refitted."""
    if len(samples) < len(names) + 1:
        raise ValueError(f"samples: need at least {len(names) + 1} steps to fit, got {len(samples)}")
    x = np.array([[1.0, *f.vector(names)] for f, _ in samples])
    y = np.array([d for _, d in samples])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        xw, yw = x[keep] / y[keep, None], np.ones(keep.sum())
        scale = np.abs(xw).max(axis=0)
        scale[scale == 0] = 1.0
        w = nnls(xw / scale, yw) / scale
        rel = np.abs(x @ w - y) / np.maximum(y, 1e-9)
        keep = rel <= max(0.25, 3 * float(np.median(rel)))
    pred = x @ w
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    stats = {
        "samples": len(samples),
        "outliers_dropped": int((~keep).sum()),
        "r2": 1.0 - float(((pred - y) ** 2).sum()) / ss_tot,
        "median_rel_error": float(np.median(rel)),
        "p90_rel_error": float(np.percentile(rel, 90)),
    }
    return LinearCostModel(float(w[0]), {n: float(c) for n, c in zip(names, w[1:], strict=True)}, stats, source)


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
