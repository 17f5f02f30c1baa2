"""The engine builder: from an `EngineConfig` (and, in tests and the simulator, objects already built)
to one engine's parts, wired: the model and tokenizer (loaded unless given), the KV cache manager,
scheduler and runner, speculation (and its draft model), LoRA adapters, the input processor, the core,
the output processor, the step metrics, the heap policy and the KV transfer.

Everything an engine holds is in its `EngineParts`: two builds give two engines that share no state,
so one server can build several. What is the process's, not an engine's, is said where it is set:
torch's thread count (`set_num_threads`), the heap (`HeapPolicy`), the garbage collector's frozen
generation (`gc.freeze` here) and armed fault rules (tokenloom/faults.py).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..model.config import ModelConfig
from ..model.kv_layout import KVLayout
from ..model.load import load, set_num_threads, weight_bytes
from ..model.loader import torch_dtype
from ..model.tokenizer import TokenizerWrapper, same_tokenizer
from ..runner import ModelRunner
from ..step import Runner
from .draft_model import DraftModelProposer
from .engine_core import EngineCore
from .heap_policy import HeapPolicy
from .input_processor import InputProcessor
from .kv_cache import KVCacheManager, kv_cache_size
from .kv_transfer import KVTransfer
from .lora_manager import AdapterManager
from .output_processor import OutputProcessor
from .scheduler import Scheduler
from .speculation import SpeculationPolicy
from .stall_free import StallFreeBudget
from .stats import StepMetrics

logger = logging.getLogger("tokenloom.engine")


@dataclass
class EngineParts:
    config: EngineConfig
    clock: Callable[[], float]
    model: torch.nn.Module | None
    tokenizer: TokenizerWrapper
    model_config: ModelConfig
    kv: KVCacheManager
    stall_free: StallFreeBudget | None
    scheduler: Scheduler
    runner: Runner
    speculation: SpeculationPolicy | None
    adapters: AdapterManager | None
    inputs: InputProcessor
    core: EngineCore
    outputs: OutputProcessor
    metrics: StepMetrics
    heap: HeapPolicy
    transfer: KVTransfer


def build_engine(
    config: EngineConfig | None = None,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: TokenizerWrapper | None = None,
    runner: Runner | None = None,
    model_config: ModelConfig | None = None,
    clock: Callable[[], float] = time.monotonic,
    draft_model: torch.nn.Module | None = None,
) -> EngineParts:
    """One engine's parts (the arguments are `LLMEngine`'s)."""
    config = (config or EngineConfig()).validate()
    set_num_threads(config.num_threads)
    if model is None and runner is None:
        model, loaded_tokenizer, _ = load(config.model, config.dtype, config.device, config.quantization,
                                          config.kv_cache_dtype)
        tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError("tokenizer: required when a model or runner object is passed")
    model_config = model_config or model.config
    if config.max_model_len is None:
        config.max_model_len = model_config.max_position_embeddings
    elif config.max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the model's context length "
            f"{model_config.max_position_embeddings}"
        )
    config.validate()

    kv_dtype = None  # the config's dtype, unless asked for or chosen at load
    if config.kv_cache_dtype != "auto":
        kv_dtype = torch_dtype(config.kv_cache_dtype)
    elif model is not None:
        kv_dtype = getattr(model, "kv_cache_dtype", None)
    num_blocks, num_host_blocks, block_bytes = kv_cache_size(config, model_config, kv_dtype)
    layout = KVLayout.of(model_config)
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks,
                        layout.group_windows)
    stall_free = None
    if (config.stall_free_factor or config.scheduling_policy == "slo") and config.batching == "continuous":
        # The slo policy sizes prefill from the TPOT targets; without a factor, from them alone.
        stall_free = StallFreeBudget(config.block_size, config.stall_free_factor or math.inf,
                                     max_tokens=config.max_num_batched_tokens)
    scheduler = Scheduler(config, kv, stall_free)
    runner = runner or ModelRunner(model, num_blocks, config.block_size, num_host_blocks, config.seed, kv_dtype)
    speculation = None
    if config.speculative is not None:
        draft = None
        if config.speculative.method == "draft_model":
            draft = load_draft(config, draft_model, model, tokenizer, model_config, num_blocks)
        speculation = SpeculationPolicy(config.speculative, draft)
    adapters = None
    if config.enable_lora:
        adapters = AdapterManager(model_config, config.max_cpu_loras or max(config.max_loras, 8),
                                  config.max_lora_rank, torch_dtype(config.dtype))
    inputs = InputProcessor(config, model_config, tokenizer, kv, adapters, clock)
    outputs = OutputProcessor()
    metrics = StepMetrics(runner, speculation)
    if stall_free is not None:
        metrics.listeners.append(stall_free.on_step)
    if scheduler.slo is not None:
        metrics.listeners.append(scheduler.slo.on_step)
    heap = HeapPolicy()
    core = EngineCore(config, tokenizer, kv, scheduler, runner, speculation, adapters, outputs, metrics, heap, clock)
    parts = EngineParts(config, clock, model, tokenizer, model_config, kv, stall_free, scheduler, runner, speculation,
                        adapters, inputs, core, outputs, metrics, heap, KVTransfer(kv, runner))
    # What exists now (weights, tokenizer tables, compiled kernels' handles) lives as long as the engine:
    # out of the garbage collector's reach, a collection scans only what steps allocate. Scanning it
    # all made some steps 2-3x slower (a full collection inside the forward: 7 ms of a 5 ms step).
    gc.collect()
    gc.freeze()
    groups = "" if layout.num_groups == 1 else f" (a block: {layout.layers_per_page} layers of one of {layout.num_groups} KV groups)"
    logger.info(
        "engine ready: %d KV blocks of %d tokens%s (%.0f MiB, %s), max_model_len %d, dtype %s",
        num_blocks, config.block_size, groups, num_blocks * block_bytes / 2**20,
        str(kv_dtype or config.dtype).removeprefix("torch."), config.max_model_len, config.dtype,
    )
    return parts


def load_draft(config: EngineConfig, draft_model: torch.nn.Module | None, model: torch.nn.Module | None,
               tokenizer: TokenizerWrapper, model_config: ModelConfig, num_blocks: int) -> DraftModelProposer:
    """The draft model loaded as the target was (dtype, quantization), checked to share its tokenizer
    (its drafts are token ids the target scores), over a KV pool of as many blocks as the target's."""
    source = config.speculative.model
    if draft_model is None:
        if model is None:
            raise ValueError("speculative_config.model: a draft model needs a real target model, not a simulated one")
        try:
            draft_model, draft_tokenizer, _ = load(source, config.dtype, config.device, config.quantization,
                                                   config.kv_cache_dtype)
        except (OSError, ValueError) as exc:
            raise ValueError(f"speculative_config.model: {exc}") from exc
        if not same_tokenizer(draft_tokenizer, tokenizer):
            raise ValueError(f"speculative_config.model: {source!r} has another tokenizer than the model "
                             "it drafts for; a draft model must share the target's vocabulary")
    if draft_model.config.vocab_size != model_config.vocab_size:
        raise ValueError(f"speculative_config.model: its vocabulary has {draft_model.config.vocab_size} ids, the "
                         f"target's {model_config.vocab_size}; a draft model must share the target's vocabulary")
    size_ratio = weight_bytes(draft_model) / max(weight_bytes(model), 1) if model is not None else 1.0
    logger.info("draft model %s: %.2fx the target's weight bytes; %s", source, size_ratio,
                getattr(getattr(draft_model, "plan", None), "line", lambda: "")())
    return DraftModelProposer(draft_model, num_blocks, config.block_size, size_ratio)
