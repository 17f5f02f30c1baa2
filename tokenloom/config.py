"""Every engine knob in one dataclass, with vLLM's names and defaults that work out of the box.

`EngineConfig.validate()` rejects impossible combinations with a ValueError naming the field, so a
bad command line fails at start-up instead of deep inside a step.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Literal, get_args, get_origin, get_type_hints

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
KV_CACHE_DTYPES: tuple[str, ...] = (*DTYPES, "int8")  # what --kv-cache-dtype takes besides "auto"
# The `quantization` names -> the weight format each loads ("auto": the fastest that runs here, chosen at
# load): defined once, for the flags here and for the loader (model/quant/formats.py).
QUANTIZATION_NAMES = {"none": "none", "int4": "int4", "q4": "int4", "q4_1": "int4", "int8": "int8", "q8": "int8"}
QUANTIZATIONS = ("none", "auto", *(name for name in QUANTIZATION_NAMES if name != "none"))
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # 1 GiB: ~46k tokens of SmolLM2-135M KV in float32

# The fields that decide how a forward runs: which weights in which format, the residual and KV cache
# dtypes, where and on how many threads. The lab and `calibrate` take exactly these from `serve`'s flags,
# so what they measure is a path a server runs.
FORWARD_PATH_FIELDS = ("model", "dtype", "quantization", "kv_cache_dtype", "device", "num_threads")
# What `tokenloom serve` runs unless told otherwise; EngineConfig's own defaults are the exact float32
# path (the offline `LLM`). The forward part is shared with the lab and `calibrate`; stall-free batching
# is a scheduling choice of the server's.
SERVING_FORWARD_DEFAULTS = {"quantization": "auto"}
SERVING_DEFAULTS = {**SERVING_FORWARD_DEFAULTS, "stall_free_factor": 1.5}


# A row of 1 + k tokens must stay below runner.SHORT_CHUNK (16), so its tokens take the decode rows'
# kernels (int4) and not the long-prompt ones (dense bf16): the same arithmetic as without drafts.
MAX_SPECULATIVE_TOKENS = 14


@dataclass
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys (tokenloom adds `adaptive`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # a draft model (method "draft_model")
    adaptive: bool = True  # False: always propose every draft found (vLLM's behaviour), for measurements

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the command line's JSON text, the offline `LLM`'s dict, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not JSON ({exc.msg})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: must be a JSON object")  # noqa: TRY004 - a config error, by name
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        value = dict(value)
        if "model" in value and "method" not in value:
            value["method"] = "draft_model"
        return cls(**value).validate()

    def validate(self) -> SpeculativeConfig:
        def fail(key: str, why: str) -> None:
            raise ValueError(f"speculative_config.{key}: {why} (got {getattr(self, key)!r})")

        if self.method not in ("ngram", "draft_model"):
            fail("method", "must be 'ngram' or 'draft_model'")
        for key, lo, hi in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                            ("prompt_lookup_max", 1, 64), ("prompt_lookup_min", 1, 64)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                fail(key, f"must be an integer in [{lo}, {hi}]")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            fail("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.adaptive, bool):
            fail("adaptive", "must be true or false")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model.strip()):
            fail("model", "method 'draft_model' needs the draft model: a GGUF file, an HF directory or a catalog name")
        if self.method == "ngram" and self.model is not None:
            fail("model", "a draft model goes with method 'draft_model' (prompt lookup has none)")
        return self


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file, HF directory, or None for the bundled SmolLM2-135M-Instruct
    dtype: Dtype = "float32"  # the residual stream (and dense weights)
    # Weights: None/"none" dense in `dtype`; "int4" weight-only 4-bit from the GGUF's Q4_1 blocks; "int8";
    # "auto" = the fastest that runs here and passed the quality check (int4 with float32 residual).
    quantization: str | None = None
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None = all cores

    # KV cache
    # "auto": float16 on the quantized fast path (half the bytes decode attention reads, as llama.cpp
    # keeps its cache), else `dtype`: the float32 reference path stays exact.
    # "int8": codes with a float32 scale per token and KV head (model/kv_quant.py), about half float16's bytes.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    num_kv_blocks: int | None = None  # overrides the count derived from kv_cache_memory_bytes
    enable_prefix_caching: bool = True
    swap_space: float = 1.0  # GiB of host memory for swapped-out KV blocks
    preemption_mode: Literal["recompute", "swap"] = "recompute"

    # Scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None = the model's context length
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = a prefill may take the whole remaining budget
    # Stall-free batching (Sarathi-Serve): while sequences decode, a step carrying prefill tokens is sized
    # from measured step costs to take at most this many times the step without them (engine/stall_free.py).
    # 0 = off (the library default: fixed budgets); `tokenloom serve` uses 1.5. Continuous batching only.
    stall_free_factor: float = 0.0
    # "slo": least slack to the requests' SLOs first, prefill sized from the tightest TPOT (engine/slo_policy.py)
    scheduling_policy: Literal["fcfs", "sjf", "priority", "slo"] = "fcfs"
    priority_aging_s: float = 10.0  # a waiting request gains one priority level per this many seconds
    slo_shed: bool = False  # with the slo policy: refuse (429) requests predicted to miss their TTFT by far
    # "vtc": a fair share per tenant (the request's `user`): lowest virtual token counter first (engine/fairness.py)
    fairness: Literal["none", "vtc"] = "none"
    batching: Literal["continuous", "dynamic", "static"] = "continuous"
    max_wait_ms: float = 50.0  # dynamic batching: how long the first waiting request may wait for company

    # Speculative decoding: vLLM's JSON (or a dict), e.g. {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2}; None = off (engine/speculation.py).
    speculative_config: str | dict | None = None

    # LoRA adapters (vLLM's names): requests may run under adapters (model/lora.py) when enabled;
    # at most max_loras distinct ones in a step, max_cpu_loras kept loaded (None = max(max_loras, 8)).
    enable_lora: bool = False
    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed `speculative_config` (a `SpeculativeConfig`), or None."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def draft_model(self) -> str | None:
        """The speculative config's draft model (a path or catalog name), or None."""
        spec = self.speculative
        return spec.model if spec is not None else None

    def validate(self) -> EngineConfig:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        choices = {
            "dtype": DTYPES,
            "kv_cache_dtype": ("auto", *KV_CACHE_DTYPES),
            "quantization": (None, *QUANTIZATIONS),
            "preemption_mode": ("recompute", "swap"),
            "scheduling_policy": ("fcfs", "sjf", "priority", "slo"),
            "batching": ("continuous", "dynamic", "static"),
            "fairness": ("none", "vtc"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {', '.join(map(str, allowed))}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            if int(getattr(self, name)) <= 0:
                fail(name, "must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            fail("num_kv_blocks", "must be at least 2")
        if self.max_model_len is not None and self.max_model_len <= 0:
            fail("max_model_len", "must be positive")
        for name in ("max_loras", "max_lora_rank"):
            if isinstance(getattr(self, name), bool) or int(getattr(self, name)) <= 0:
                fail(name, "must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            fail("max_cpu_loras", f"must be >= max_loras ({self.max_loras})")
        if self.swap_space < 0:
            fail("swap_space", "must be >= 0")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            fail("swap_space", "preemption_mode=swap needs swap_space > 0")
        if self.max_wait_ms < 0:
            fail("max_wait_ms", "must be >= 0")
        if not (self.stall_free_factor == 0 or 1 <= self.stall_free_factor < float("inf")):
            fail("stall_free_factor", "must be 0 (off) or a finite factor >= 1")
        if self.slo_shed and self.scheduling_policy != "slo":
            fail("slo_shed", "shedding predicts from the slo policy's measurements: needs --scheduling-policy slo")
        self.speculative  # noqa: B018 -- parsing it raises a ValueError naming the key
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            fail(
                "max_num_batched_tokens",
                f"without chunked prefill it must be >= max_model_len ({self.max_model_len}), "
                "or a long prompt could never be scheduled",
            )
        return self

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


_FLAG_HELP = {
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                          "(vLLM's keys; adaptive by default: see README); default: off",
    "model": "a GGUF file, an HF directory or a catalog name (`tokenloom models`); "
             "default: the bundled SmolLM2-135M-Instruct",
}


def add_engine_args(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Every EngineConfig field (or those in `only`) as --kebab-case option (vLLM's names), with its
    choices. The help shows the parser's default when --help runs (`%(default)s`), so a command's
    set_defaults (serve: auto, 1.5) is what it prints."""
    defaults, hints = EngineConfig(), get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if only is not None and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            continue
        kind = type(default) if default is not None else (
            str if f.name in ("model", "quantization", "speculative_config") else int)
        choices = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else None
        if f.name == "quantization":
            choices = QUANTIZATIONS
        parser.add_argument(flag, type=kind, default=default, choices=choices,
                            help=_FLAG_HELP.get(f.name, "(default: %(default)s)"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def forward_path_from_args(args: argparse.Namespace) -> dict:
    """The FORWARD_PATH_FIELDS of parsed flags (`add_engine_args(parser, only=FORWARD_PATH_FIELDS)`), as
    EngineConfig keyword arguments."""
    return {name: getattr(args, name) for name in FORWARD_PATH_FIELDS}
