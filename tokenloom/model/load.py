"""Loading has one home: `load(source, dtype, device)` returns the model, its tokenizer and its config;
`set_num_threads` is the one place torch's thread count is set."""

from __future__ import annotations

import logging
import math
import os

import torch

from .config import ModelConfig
from .decoder import DecoderModel
from .loader import ModelSource, bundled_model_path, forget_vocabulary, load_model, read_gguf_metadata
from .quant import probe
from .tokenizer import TokenizerWrapper, load_tokenizer

logger = logging.getLogger("tokenloom.load")


def model_path(source: str | None) -> str:
    """The GGUF file or HF directory `source` names: a path, or a catalog name once pulled (model/catalog.py;
    a missing path or a hub id is a ModelNotFoundError saying what to pass); None = the bundled
    SmolLM2-135M-Instruct."""
    from .catalog import resolve

    return resolve(source) if source else bundled_model_path()


def load(
    source: str | None = None, dtype: str = "float32", device: str = "cpu", quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[DecoderModel, TokenizerWrapper, ModelConfig]:
    resolved = ModelSource.resolve(model_path(source))
    # The tokenizer first: a GGUF's parsed vocabulary is then dropped before the weights come in, and the
    # whole parsed metadata after (its tables are 35 MB of strings for Qwen2.5's 151k tokens).
    tokenizer = load_tokenizer(resolved.path)
    if resolved.kind == "gguf":
        forget_vocabulary(resolved.path)
    try:
        model = load_model(resolved, dtype=dtype, device=device, quantization=quantization,
                           kv_cache_dtype=kv_cache_dtype)
    finally:
        read_gguf_metadata.cache_clear()
    cap = probe.detect() if quantization not in (None, "none") else None
    logger.info("%s (asked %s%s)", model.plan.line(), quantization or "none",
                f"; torch CPU capability {cap['cpu_capability']}, bf16 {cap['avx512_bf16']}" if cap else "")
    return model, tokenizer, model.config


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a forward reads: parameters and buffers (quantized weights are buffers)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "meta":
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container
    given 1.5 CPUs of a 2-core machine gets 2 threads, one given 1 CPU gets 1). More threads than that
    wait on each other at every parallel region while the OS runs them in turn."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs granted by the cgroup (v2 cpu.max, v1 cfs quota/period); None when unlimited or unknown."""
    try:
        with open(f"{root}/cpu.max") as f:
            quota, period = f.read().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{root}/cpu/cpu.cfs_quota_us") as q, open(f"{root}/cpu/cpu.cfs_period_us") as p:
            quota, period = int(q.read()), int(p.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def default_num_threads() -> int:
    """Serving: the usable cores, one left to the event loop beyond two (docs/architecture.md)."""
    cores = usable_cores()
    return cores - 1 if cores > 2 else cores


def set_num_threads(num_threads: int | None) -> None:
    """torch intra-op threads, per calling thread under OpenMP (None leaves torch's default)."""
    if num_threads:
        torch.set_num_threads(num_threads)
