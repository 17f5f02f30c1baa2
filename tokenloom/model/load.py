"""Loading has one home: `load(source, dtype, device)` returns the model, its tokenizer and its config;
`set_num_threads` is the one place torch's thread count is set."""

from __future__ import annotations

import logging
import os

import torch

from . import linear
from .config import ModelConfig
from .decoder import DecoderModel
from .loader import ModelSource, bundled_model_path, load_model
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
    model = load_model(resolved, dtype=dtype, device=device, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    cap = linear.detect() if quantization not in (None, "none") else None
    logger.info("%s (asked %s%s)", model.plan.line(), quantization or "none",
                f"; torch CPU capability {cap['cpu_capability']}, bf16 {cap['avx512_bf16']}" if cap else "")
    return model, load_tokenizer(resolved.path), model.config


def default_num_threads() -> int:
    """Serving: leave a core to the event loop when there are more than two (see DESIGN.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores - 1 if cores > 2 else cores


def set_num_threads(num_threads: int | None) -> None:
    """torch intra-op threads, per calling thread under OpenMP (None leaves torch's default)."""
    if num_threads:
        torch.set_num_threads(num_threads)
