"""KV-cache memory calculator: pre-allocated (max_model_len per sequence) vs paged (block-granular).

Definitions:
- KV bytes per token = 2 (K and V) * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)
  (Llama-3-8B in fp16: 2 * 32 * 8 * 128 * 2 = 131072 B = 128 KiB); int8 is the engine's int8 cache, one
  byte a value and a 4-byte float32 scale per token and KV head (model/kv_quant.py: 67584 B for Llama-3-8B).
- Pre-allocated: every sequence reserves max_model_len token slots.
- Paged: a sequence of L tokens holds ceil(L / block_size) blocks = ceil(L / block_size) * block_size
  slots; internal fragmentation = slots - tokens (unused tail of each last block). A model with
  sliding-window layers (Gemma 3: 5 of every 6 see `window` positions) holds in those layers only the
  blocks the window reaches, min(ceil(L / block_size), ceil((window - 1) / block_size) + 1), as the
  engine does (model/kv_layout.py); paged bytes count both kinds of layers.
- Sequence lengths are drawn (seeded) from --length-dist and clipped to [1, max_model_len]:
  ``fixed:L``, ``uniform:a,b`` (inclusive integers), ``normal:mean,std`` (rounded), ``mixed:short,long``
  (half/half).
- Budget (--memory-gb, GiB = 2**30 bytes): pre-allocated holds floor(budget / (max_model_len * per_token))
  sequences; paged has floor(budget / (block_size * per_token)) blocks of every layer and holds
  floor(budget * num_seqs / paged_bytes_of_the_sample) sequences of the sampled mix.

Model shapes come from a preset name, a HF ``config.json`` or a ``.gguf`` file (read with `gguf`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..model import catalog
from ..model.config import SLIDING

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8": 1, "int8": 1}
GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    name: str = "custom"
    sliding_layers: int = 0  # of num_layers, those that see only the last `sliding_window` positions
    sliding_window: int | None = None
    scale_bytes: int = 0  # per token, KV head and K or V: a quantized cache's scale

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * (self.head_dim * self.dtype_bytes + self.scale_bytes)

    def paged_bytes(self, length: int, block_size: int) -> int:
        """K/V bytes a sequence of `length` tokens holds in blocks of `block_size` (see module docstring)."""
        blocks = math.ceil(length / block_size)
        layer_blocks = (self.num_layers - self.sliding_layers) * blocks
        if self.sliding_layers:
            layer_blocks += self.sliding_layers * min(blocks, math.ceil((self.sliding_window - 1) / block_size) + 1)
        return layer_blocks * block_size * self.layer_bytes_per_token


PRESETS: dict[str, tuple[int, int, int]] = {  # name -> (layers, kv heads, head_dim)
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b": (80, 8, 128),
    "mistral-7b": (32, 8, 128),
    "smollm2-135m": (30, 3, 64),
    "llama-2-7b": (32, 32, 128),
    "qwen2.5-7b": (28, 4, 128),
    "gemma-3-270m": (18, 1, 256),
}
SLIDING_PRESETS: dict[str, tuple[int, int]] = {"gemma-3-270m": (15, 512)}  # name -> (sliding layers, window)


def _sliding(num_layers: int, window, layer_types=None, gemma3: bool = False) -> dict:
    """ModelShape's sliding fields: from per-layer types, or Gemma 3's own pattern (model/architectures)."""
    if gemma3 and not layer_types:
        from ..model.architectures.gemma3 import layer_types_of  # (torch) only for a GGUF's shapes

        layer_types = layer_types_of(num_layers)
    if not window or not layer_types:
        return {}
    return {"sliding_layers": sum(t == SLIDING for t in layer_types), "sliding_window": int(window)}


def shape_from_hf_config(cfg: dict[str, Any], dtype_bytes: int = 2, name: str = "hf") -> ModelShape:
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    layers = int(cfg["num_hidden_layers"])
    sliding = _sliding(layers, cfg.get("sliding_window"), cfg.get("layer_types"),
                       gemma3=str(cfg.get("model_type", "")).startswith("gemma3"))
    return ModelShape(layers, kv_heads, head_dim, dtype_bytes, name, **sliding)


def _gguf_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def shape_from_gguf(path: str, dtype_bytes: int = 2) -> ModelShape:
    from ..model.gguf_file import GGUFFile

    reader = GGUFFile(path)
    arch = _gguf_value(reader, "general.architecture") or "llama"

    def get(key: str) -> Any:
        value = _gguf_value(reader, f"{arch}.{key}")
        return max(value) if isinstance(value, list) else value  # per-layer arrays: take the largest

    layers, heads, width = get("block_count"), get("attention.head_count"), get("embedding_length")
    if layers is None or heads is None:
        raise ValueError(f"{path}: no {arch}.block_count / {arch}.attention.head_count in the GGUF metadata")
    kv_heads = get("attention.head_count_kv") or heads
    head_dim = get("attention.key_length") or int(width) // int(heads)
    sliding = _sliding(int(layers), get("attention.sliding_window"), gemma3=arch == "gemma3")
    return ModelShape(int(layers), int(kv_heads), int(head_dim), dtype_bytes, Path(path).name, **sliding)


def load_model_shape(model: str, dtype: str = "fp16") -> ModelShape:
    """A preset name, a HF config.json (or a directory holding one), or a .gguf file."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: choose from {sorted(DTYPE_BYTES)}")
    return replace(_model_shape(model, DTYPE_BYTES[dtype]), scale_bytes=scale_bytes_of(dtype))


def scale_bytes_of(dtype: str) -> int:
    """Bytes of scale per token and KV head beside its values (K's and V's each): the int8 cache's."""
    if dtype != "int8":
        return 0
    from ..model.kv_quant import SCALE_BYTES  # (torch) only when asked for the int8 cache

    return SCALE_BYTES


def _model_shape(model: str, nbytes: int) -> ModelShape:
    if model.lower() in PRESETS:
        sliding_layers, window = SLIDING_PRESETS.get(model.lower(), (0, None))
        return ModelShape(*PRESETS[model.lower()], nbytes, model.lower(), sliding_layers, window)
    path = Path(model)
    if not path.exists() and model in catalog.CATALOG:
        path = Path(catalog.resolve(model))  # a catalog model already here (the command pulls it first)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return shape_from_gguf(str(path), nbytes)
    if path.suffix == ".json" and path.is_file():
        return shape_from_hf_config(json.loads(path.read_text()), nbytes, model)
    raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}), a catalog model "
                     f"({', '.join(catalog.CATALOG)}) nor a config.json/.gguf")


def sample_lengths(spec: str, n: int, max_model_len: int, seed: int = 0) -> list[int]:
    """`n` sequence lengths from `spec` (see module docstring), clipped to [1, max_model_len]."""
    rng = random.Random(seed)
    kind, _, rest = spec.partition(":")
    try:
        nums = [float(x) for x in rest.split(",")] if rest else []
        if kind == "fixed" and len(nums) == 1:
            lens = [round(nums[0])] * n
        elif kind == "uniform" and len(nums) == 2 and nums[0] <= nums[1]:
            lens = [rng.randint(int(nums[0]), int(nums[1])) for _ in range(n)]
        elif kind == "normal" and len(nums) == 2 and nums[1] >= 0:
            lens = [round(rng.gauss(nums[0], nums[1])) for _ in range(n)]
        elif kind == "mixed" and len(nums) == 2:
            lens = [int(nums[0])] * (n // 2) + [int(nums[1])] * (n - n // 2)
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"bad --length-dist {spec!r}: use fixed:L, uniform:a,b, normal:mean,std or mixed:short,long"
        ) from None
    return [min(max(1, int(x)), max_model_len) for x in lens]


@dataclass
class KVReport:
    model: str
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    num_seqs: int
    total_tokens: int
    mean_len: float
    preallocated_bytes: int
    paged_bytes: int
    paged_blocks: int
    saving_pct: float  # (preallocated - paged) / preallocated
    fragmentation_slots: int  # paged slots not holding a token
    fragmentation_pct: float  # of paged slots
    memory_gib: float | None = None
    budget_blocks: int | None = None
    concurrent_preallocated: int | None = None
    concurrent_paged: int | None = None


def compute_kv(
    shape: ModelShape, lengths: list[int], max_model_len: int, block_size: int, memory_gb: float | None = None
) -> KVReport:
    if block_size <= 0 or max_model_len <= 0 or not lengths:
        raise ValueError("block size, max model len and the number of sequences must be positive")
    per_tok = shape.kv_bytes_per_token
    blocks = sum(math.ceil(length / block_size) for length in lengths)
    tokens = sum(lengths)
    slots = blocks * block_size
    paged = sum(shape.paged_bytes(length, block_size) for length in lengths)
    prealloc = len(lengths) * max_model_len * per_tok
    report = KVReport(
        model=shape.name,
        kv_bytes_per_token=per_tok,
        block_size=block_size,
        max_model_len=max_model_len,
        num_seqs=len(lengths),
        total_tokens=tokens,
        mean_len=tokens / len(lengths),
        preallocated_bytes=prealloc,
        paged_bytes=paged,
        paged_blocks=blocks,
        saving_pct=100.0 * (prealloc - paged) / prealloc,
        fragmentation_slots=slots - tokens,
        fragmentation_pct=100.0 * (slots - tokens) / slots,
    )
    if memory_gb is not None:
        budget = int(memory_gb * GIB)
        report.memory_gib = memory_gb
        report.budget_blocks = budget // (block_size * per_tok)
        report.concurrent_preallocated = budget // (max_model_len * per_tok)
        report.concurrent_paged = budget * len(lengths) // paged
    return report


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def format_report(r: KVReport) -> str:
    rows = [
        ("model", r.model),
        ("KV per token", f"{r.kv_bytes_per_token} B ({_human(r.kv_bytes_per_token)})"),
        (
            "sequences / mean length",
            f"{r.num_seqs} / {r.mean_len:.1f} tokens (max_model_len {r.max_model_len})",
        ),
        ("pre-allocated total", _human(r.preallocated_bytes)),
        ("paged total", f"{_human(r.paged_bytes)} ({r.paged_blocks} blocks of {r.block_size})"),
        ("paged saving", f"{r.saving_pct:.1f} %"),
        ("paged internal fragmentation", f"{r.fragmentation_slots} slots ({r.fragmentation_pct:.2f} %)"),
    ]
    if r.memory_gib is not None:
        rows += [
            (f"budget {r.memory_gib:g} GiB", f"{r.budget_blocks} blocks"),
            ("concurrent seqs, pre-allocated", str(r.concurrent_preallocated)),
            ("concurrent seqs, paged", str(r.concurrent_paged)),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_kv_calc_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kv-calc")
    p.add_argument(
        "--model", default="llama-3-8b",
        help=f"preset ({', '.join(PRESETS)}), catalog name (pulled on first use, as serve does) or config.json/.gguf")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp16")
    p.add_argument(
        "--length-dist",
        default=None,
        help="fixed:L | uniform:a,b | normal:mean,std | mixed:short,long (default uniform:1,MAX_MODEL_LEN)",
    )
    p.add_argument("--memory-gb", type=float, default=None, help="KV budget in GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_kv_calc)
    return p


def cmd_kv_calc(args: argparse.Namespace) -> int:
    if args.model.lower() not in PRESETS and args.model in catalog.CATALOG:
        catalog.pull_missing(args.model)  # as `serve NAME` does: the user asked for that model
    shape = load_model_shape(args.model, args.dtype)
    if args.num_seqs <= 0:
        raise ValueError("--num-seqs must be positive")
    dist = args.length_dist or f"uniform:1,{args.max_model_len}"
    lengths = sample_lengths(dist, args.num_seqs, args.max_model_len, args.seed)
    report = compute_kv(shape, lengths, args.max_model_len, args.block_size, args.memory_gb)
    if args.json:
        print(json.dumps({**asdict(report), "length_dist": dist, "dtype": args.dtype}, indent=2))
    else:
        print(format_report(report))
    return 0
