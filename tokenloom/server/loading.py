"""The engine as `tokenloom serve` loads it, for one server process and for each replica of a fleet:
the model and adapters loaded, metrics and the AsyncLLM around it, and the name it is served under."""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..engine.async_llm import AsyncLLM
from ..engine.llm_engine import LLMEngine
from ..engine.metrics import EngineMetrics
from ..model.load import default_num_threads, model_path, set_num_threads
from ..slo import SLO, SLOPolicy, slo_number, unreachable

# llama.cpp's file-name suffix for the weight format (`.Q4_1`, `.Q4_K_M`, `-F16`): not part of a model's name.
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|[BF]F?16|F32)$", re.IGNORECASE)


def default_served_name(model: str | None, path: str) -> str:
    """One name, as vLLM serves the model under the name it was given: a catalog name as given; a path's
    file or directory name without `.gguf` and its quantization suffix (the bundled model is
    `SmolLM2-135M-Instruct`, `Qwen2.5-0.5B` stays whole). --served-model-name renames."""
    from ..model.catalog import CATALOG

    if model in CATALOG and not os.path.exists(model):
        return model
    return _QUANT_SUFFIX.sub("", Path(path).name.removesuffix(".gguf"))


@dataclass
class ServedEngine:
    async_llm: AsyncLLM
    metrics: EngineMetrics
    names: list[str]  # the served model names
    path: str  # the model's file or directory


def load_served_engine(args: argparse.Namespace, config, lora_modules=()) -> ServedEngine:
    """The engine as `tokenloom serve` runs it (also each replica of a fleet): the model loaded, the
    adapters checked, metrics and the AsyncLLM around it (its thread not started yet)."""
    path = model_path(config.model)
    num_threads = config.num_threads or default_num_threads()
    # The model runs on the engine thread, which sets its own thread count (AsyncLLM). The main thread
    # loads with one: once it owns an OpenMP team of two, the engine thread's team shares the cores with
    # it and a decode step takes twice as long (measured 9.6 vs 19.7 ms at batch 1 on 2 cores).
    config.num_threads = None
    set_num_threads(1)
    engine = LLMEngine(config)
    for lora in lora_modules:  # a bad adapter stops the start, named, rather than failing its first request
        engine.adapters.load(lora)
    if args.record_steps:
        from ..engine.step_log import StepLog

        StepLog(engine, args.record_steps)
    names = args.served_model_name or [default_served_name(config.model, path)]
    metrics = EngineMetrics(names[0], log_interval_s=args.log_interval, log_requests=not args.disable_log_requests)
    async_llm = AsyncLLM(engine, max_queue_len=args.max_queue_len, metrics=metrics, num_threads=num_threads,
                         exit_on_fatal=True, stall_timeout_s=args.engine_stall_timeout)
    return ServedEngine(async_llm, metrics, names, path)



def app_options(args: argparse.Namespace) -> dict:
    """`build_app`'s keyword arguments that come straight from `tokenloom serve`'s flags."""
    from .tenancy import ClientPriorityRange

    return {"api_key": args.api_key, "max_request_body_bytes": args.max_request_body_bytes,
            "shutdown_timeout": args.shutdown_timeout, "metrics_token": args.metrics_token,
            "metrics_open": args.metrics_open, "trust_chat_messages": args.trust_chat_messages,
            "reasoning_parser": args.reasoning_parser,
            "client_priority": ClientPriorityRange(args.min_client_priority, args.max_client_priority),
            "slo_policy": slo_policy_from_args(args)}


def slo_policy_from_args(args: argparse.Namespace) -> SLOPolicy:
    """--slo-ttft-ms / --slo-tpot-ms / --slo-e2e-ms and --slo-classes, checked (ValueError naming the flag)."""
    targets = {f"{k}_ms": slo_number(f"--slo-{k.replace('_', '-')}-ms", v)
               for k in ("ttft", "tpot", "e2e") if (v := getattr(args, f"slo_{k}_ms", None)) is not None}
    default = SLO(**targets)
    path = getattr(args, "slo_classes", None)
    return SLOPolicy.from_file(path, default) if path else SLOPolicy(default)


def warn_unreachable_slos(engine: LLMEngine, policy: SLOPolicy) -> list[str]:
    """Time one engine step (a one-token prompt, decoded once) and log a warning for every target below it:
    no request could ever meet such an SLO. Returns the warnings."""
    if all(slo.empty for _, slo in policy.all_slos()):
        return []
    from ..sampling_params import SamplingParams

    engine.add_request("slo-step-probe", {"prompt_token_ids": [0]},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    step_s = []
    while engine.has_unfinished_requests():
        engine.step()
        step_s.append(engine.last_step.duration)
    warnings = unreachable(policy, min(step_s))
    for text in warnings:
        logging.getLogger("tokenloom.server").warning("SLO %s", text)
    return warnings
