"""LoRA adapters in the PEFT format, and how a step applies many of them at once.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...)
and `adapter_model.safetensors` (or .bin) with, per adapted projection, `...<proj>.lora_A.weight`
[r, in] and `...<proj>.lora_B.weight` [out, r]; the projection then computes W x + s B A x with
s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). Hugging Face's checkpoints name q/k/v and
gate/up separately, tokenloom fuses them (`qkv_proj`, `gate_up_proj`): an adapter's pieces of one fused
projection are stacked into one A [in, r_total] and one block-diagonal B [r_total, out] with the scale
folded in. A step's rows under adapters go through each projection's adapters as two batched products,
(x A) B, the shrink and the expand of Punica's SGMV (`LoRABatch`, over weights `LoRAStacks` stacks once
per set of adapters).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from .config import ModelConfig

# PEFT's module names -> (tokenloom's fused projection, which of its parts)
_TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
            "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: which adapter a request runs under (`lora_int_id` > 0 names it within the engine)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name: must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be a positive integer (got {self.lora_int_id!r})")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path: must be a path to a PEFT adapter directory")


def projection_parts(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Per fused projection: (input size, output size of each part)."""
    q, kv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    return {"qkv": (cfg.hidden_size, [q, kv, kv]), "o": (q, [cfg.hidden_size]),
            "gate_up": (cfg.hidden_size, [cfg.intermediate_size] * 2), "down": (cfg.intermediate_size, [cfg.hidden_size])}


@dataclass(eq=False)  # identity: a step's set of adapters keys its stacked weights
class LoRAWeights:
    """One loaded adapter: per layer, per fused projection, (A [in, r_total], B [r_total, out] * scale)."""

    name: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for ab in layer.values() for t in ab)


def load_adapter(path: str, name: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
                 ) -> LoRAWeights:
    """Read and check a PEFT adapter for a model of `cfg`; ValueError naming what is wrong."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_path):
        raise ValueError(f"lora_path: {path!r} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        with open(config_path) as f:
            meta = json.load(f)
        rank, alpha = int(meta["r"]), float(meta.get("lora_alpha", meta["r"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"lora_path: {config_path} is not a valid adapter config ({exc!r})") from None
    if not 0 < rank <= max_rank:
        raise ValueError(f"lora rank {rank} of {name!r} is above max_lora_rank ({max_rank})" if rank > 0
                         else f"lora rank {rank} of {name!r} must be positive")
    for key in ("use_dora", "fan_in_fan_out"):
        if meta.get(key):
            raise ValueError(f"lora adapter {name!r}: {key} adapters are not supported")
    scale = alpha / math.sqrt(rank) if meta.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path)
    parts = projection_parts(cfg)
    found: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in _TARGETS:
            raise ValueError(f"lora adapter {name!r}: tensor {key!r} adapts something tokenloom cannot "
                             "(only q/k/v/o and gate/up/down projections of the decoder layers)")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise ValueError(f"lora adapter {name!r}: layer {layer} but the model has {cfg.num_layers}")
        found.setdefault((layer, *_TARGETS[m.group(2)][:1], m.group(2)), {})[m.group(3)] = value
    weights = LoRAWeights(name, rank, [{} for _ in range(cfg.num_layers)])
    per_projection: dict[tuple[int, str], list] = {}
    for (layer, proj, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora adapter {name!r}: layer {layer} {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
        part = _TARGETS[module][1]
        n_in, outs = parts[proj]
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, n_in) or b.shape != (outs[part], rank):
            raise ValueError(f"lora adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}; this model needs ({rank}, {n_in}) and ({outs[part]}, {rank}) "
                             "(an adapter of another base model?)")
        per_projection.setdefault((layer, proj), []).append((part, a, b))
    for (layer, proj), pieces in per_projection.items():
        n_in, outs = parts[proj]
        starts = [sum(outs[:i]) for i in range(len(outs))]
        a_all = torch.zeros(n_in, rank * len(pieces), dtype=torch.float32)
        b_all = torch.zeros(rank * len(pieces), sum(outs), dtype=torch.float32)
        for j, (part, a, b) in enumerate(sorted(pieces, key=lambda p: p[0])):
            a_all[:, j * rank : (j + 1) * rank] = a.float().T
            b_all[j * rank : (j + 1) * rank, starts[part] : starts[part] + outs[part]] = b.float().T * scale
        weights.layers[layer][proj] = (a_all.to(dtype).contiguous(), b_all.to(dtype).contiguous())
    if not per_projection:
        raise ValueError(f"lora adapter {name!r}: no LoRA weights in {path}")
    return weights


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(pt):
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the request's error, by name
        raise ValueError(f"lora_path: cannot read the adapter's weights in {path} ({exc!r})") from None
    raise ValueError(f"lora_path: {path} has no adapter_model.safetensors (or .bin)")


def merge_into(model: torch.nn.Module, weights: LoRAWeights) -> None:
    """W += s B A in place, for a dense float model: the reference a request through the adapter must match."""
    for layer, projections in zip(model.layers, weights.layers, strict=True):
        modules = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
                   "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
        for proj, (a, b) in projections.items():
            w = modules[proj].weight
            w.data += (a.double() @ b.double()).T.to(w.dtype)


class LoRAStacks:
    """Per set of adapters that share steps, their weights stacked per projection (A [n, in, r_max],
    B [n, r_max, out], zero-padded where an adapter's rank is smaller or it does not adapt that
    projection: zeros add nothing), so a projection's adapters run as two batched products whatever
    their number. Built lazily, kept for the last `max_sets` sets (a set is stable while its requests run)."""

    def __init__(self, dtype: torch.dtype | None = None, max_sets: int = 2):
        """`dtype`: the stacks' (the layer ops' `lora_dtype`: bfloat16 for the C kernel), None: the adapters'."""
        self.dtype, self.max_sets = dtype, max_sets
        self._sets: dict[tuple, dict] = {}

    def get(self, adapters: tuple[LoRAWeights, ...], layer: int, proj: str):
        cache = self._sets.pop(adapters, None)
        if cache is None:
            cache = {}
            while len(self._sets) >= self.max_sets:
                del self._sets[next(iter(self._sets))]
        self._sets[adapters] = cache  # most recently used last
        key = (layer, proj)
        if key not in cache:
            pieces = [a.layers[layer].get(proj) for a in adapters]
            present = [p for p in pieces if p is not None]
            if not present:
                cache[key] = None
            else:
                n_in, n_out = present[0][0].shape[0], present[0][1].shape[1]
                r_max, dtype = max(p[0].shape[1] for p in present), self.dtype or present[0][0].dtype
                a_all = torch.zeros(len(adapters), n_in, r_max, dtype=dtype)
                b_all = torch.zeros(len(adapters), r_max, n_out, dtype=dtype)
                for i, p in enumerate(pieces):
                    if p is not None:
                        a_all[i, :, : p[0].shape[1]] = p[0]
                        b_all[i, : p[1].shape[0]] = p[1]
                cache[key] = (a_all, b_all)
        return cache[key]


class LoRABatch:
    """One step's rows under adapters, laid out once for every projection: the rows of adapter i are
    gathered into slot i of a [adapters, G, features] block (G: the largest group; short groups padded
    with a repeat of a row whose result is dropped), multiplied by the stacked A then B in two batched
    products, and added back to their rows (Punica's SGMV shrink and expand, as torch bmm). On the fast
    path the C layer ops take each row with its adapter's slot instead (`slots`; Punica's BGMV, row by
    row), inside the fused decoder loop too."""

    def __init__(self, groups: list[tuple[LoRAWeights, list[int]]], stacks: LoRAStacks, num_rows: int, device=None):
        """`groups`: each adapter and its rows among the step's `num_rows`."""
        self.adapters = tuple(a for a, _ in groups)
        self.stacks = stacks
        width = max(len(rows) for _, rows in groups)
        gather, keep, rows = [], [], []
        slots = [-1] * num_rows
        for i, (_, group) in enumerate(groups):
            gather += group + [group[0]] * (width - len(group))
            keep += range(i * width, i * width + len(group))
            rows += group
            for r in group:
                slots[r] = i
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)  # each row's adapter, -1: none
        self.width = width
        self.gather = torch.tensor(gather, dtype=torch.long, device=device)
        self.keep = torch.tensor(keep, dtype=torch.long, device=device)
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)

    def add(self, ops, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += (x[rows] A) B with each row's own adapter, in place (y: the projection's output):
        the layer ops' row-by-row kernel where it takes these tensors (the C one: the same bits whether
        the decoder loop or the layers run the step), else torch's batched products."""
        stacked = self.stacks.get(self.adapters, layer, proj)
        if stacked is None:
            return
        a, b = stacked
        if ops.lora_add(x, y, self.slots, a, b):
            return
        xs = x.index_select(0, self.gather).to(a.dtype).view(len(self.adapters), self.width, -1)
        delta = torch.bmm(torch.bmm(xs, a), b).view(-1, b.shape[-1])
        y.index_add_(0, self.rows, delta.index_select(0, self.keep).to(y.dtype))
