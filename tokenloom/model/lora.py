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


MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: a few hundred bytes in practice
MAX_HEADER_BYTES = 16 << 20  # a safetensors header (JSON): ~100 bytes per tensor
MAX_ALPHA = 1e6
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def _kind(value) -> str:
    """What a value read from a client-named file is, without quoting it (errors never echo file contents)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number that is not finite" if isinstance(value, float) and not math.isfinite(value) else "a number"
    return {str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(type(value), "another value")


def read_adapter_config(config_path: str, name: str, max_rank: int) -> tuple[int, float, bool]:
    """(rank, lora_alpha, use_rslora) of an adapter_config.json, every field checked (finite, in range,
    of its type); ValueError naming the file and the field."""
    where = f"lora_path: {config_path}"
    try:
        if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
            raise ValueError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes; not an adapter config")
        with open(config_path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"), parse_constant=lambda c: math.nan)
    except OSError as exc:
        raise ValueError(f"{where}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError(f"{where}: is not a valid adapter config (not UTF-8 JSON)") from None
    if not isinstance(meta, dict):  # the client's file, a 400: ValueError
        raise ValueError(f"{where}: is not a valid adapter config (a JSON object is needed, got {_kind(meta)})")  # noqa: TRY004
    rank = meta.get("r")
    if isinstance(rank, float) and math.isfinite(rank) and rank.is_integer():
        rank = int(rank)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"{where}: r: must be an integer (the adapter's rank), got {_kind(rank)}")  # noqa: TRY004
    if not 0 < rank <= max_rank:
        raise ValueError(f"lora rank {rank} of {name!r} is above max_lora_rank ({max_rank}) ({where}: r)" if rank > 0
                         else f"lora rank {rank} of {name!r} must be positive ({where}: r)")
    alpha = meta.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
            math.isfinite(alpha) and 0 < alpha <= MAX_ALPHA):
        raise ValueError(f"{where}: lora_alpha: must be a finite number in (0, {MAX_ALPHA:g}], got {_kind(alpha)}"
                         + (f" {alpha}" if isinstance(alpha, int) and not isinstance(alpha, bool) else ""))
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if meta.get(key) is not None and not isinstance(meta[key], bool):
            raise ValueError(f"{where}: {key}: must be true or false, got {_kind(meta[key])}")
    for key in ("use_dora", "fan_in_fan_out"):
        if meta.get(key):
            raise ValueError(f"lora adapter {name!r}: {key} adapters are not supported ({where}: {key})")
    return rank, float(alpha), bool(meta.get("use_rslora"))


def load_adapter(path: str, name: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
                 ) -> LoRAWeights:
    """Read and check a PEFT adapter for a model of `cfg`; ValueError naming the file and what is wrong.
    Its config is checked first, then the weights file's header (names, dtypes, shapes, offsets against
    the file's size), and only then are the tensors read, each checked finite."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_path):
        raise ValueError(f"lora_path: {path!r} is not a PEFT adapter directory (no adapter_config.json)")
    rank, alpha, rslora = read_adapter_config(config_path, name, max_rank)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    parts = projection_parts(cfg)

    def expected(key: str) -> tuple[int, int]:
        """The shape tensor `key` must have; ValueError if it adapts nothing tokenloom can."""
        m = _KEY.match(key)
        if m is None or m.group(2) not in _TARGETS:  # the file's own name for it is not echoed
            raise ValueError(f"lora adapter {name!r}: a tensor ({len(key)} characters of name) adapts something "
                             "tokenloom cannot (only q/k/v/o and gate/up/down projections of the decoder layers)")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise ValueError(f"lora adapter {name!r}: layer {layer} but the model has {cfg.num_layers}")
        proj, part = _TARGETS[m.group(2)]
        n_in, outs = parts[proj]
        return (rank, n_in) if m.group(3) == "A" else (outs[part], rank)

    tensors = _read_tensors(path, name, expected)
    found: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        found.setdefault((int(m.group(1)), *_TARGETS[m.group(2)][:1], m.group(2)), {})[m.group(3)] = value
    weights = LoRAWeights(name, rank, [{} for _ in range(cfg.num_layers)])
    per_projection: dict[tuple[int, str], list] = {}
    for (layer, proj, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora adapter {name!r}: layer {layer} {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
        per_projection.setdefault((layer, proj), []).append((_TARGETS[module][1], ab["A"], ab["B"]))
    for (layer, proj), pieces in per_projection.items():
        n_in, outs = parts[proj]
        starts = [sum(outs[:i]) for i in range(len(outs))]
        a_all = torch.zeros(n_in, rank * len(pieces), dtype=torch.float32)
        b_all = torch.zeros(rank * len(pieces), sum(outs), dtype=torch.float32)
        for j, (part, a, b) in enumerate(sorted(pieces, key=lambda p: p[0])):
            a_all[:, j * rank : (j + 1) * rank] = a.float().T
            b_all[j * rank : (j + 1) * rank, starts[part] : starts[part] + outs[part]] = b.float().T * scale
        if not (torch.isfinite(a_all).all() and torch.isfinite(b_all).all()):  # B x scale can overflow float32
            raise ValueError(f"lora adapter {name!r}: layer {layer} {proj}: lora_B x lora_alpha / r is not finite "
                             f"in float32 ({config_path}: lora_alpha)")
        weights.layers[layer][proj] = (a_all.to(dtype).contiguous(), b_all.to(dtype).contiguous())
    if not per_projection:
        raise ValueError(f"lora adapter {name!r}: no LoRA weights in {path}")
    return weights


def _label(key: str) -> str:
    """A tensor's name as this grammar spells it (`layers.N.<proj>.lora_A`), not as the file does: the
    file's own prefix is not echoed into an error."""
    m = _KEY.match(key)
    return f"layers.{m.group(1)}.{m.group(2)}.lora_{m.group(3)}" if m is not None else "a tensor"


def _check_tensor(name: str, file: str, key: str, tensor: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"lora adapter {name!r}: {file}: {_label(key)} has shape {tuple(tensor.shape)[:4]}; this model needs "
                         f"{shape} (an adapter of another base model?)")
    if not tensor.is_floating_point():
        raise ValueError(f"lora adapter {name!r}: {file}: {_label(key)} is {tensor.dtype}, not a float tensor")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"lora adapter {name!r}: {file}: {_label(key)} holds NaN or infinite values")
    return tensor


def _safetensors_header(file: str, name: str, expected) -> dict:
    """The header of a .safetensors file, checked against the file's size and the shapes `expected`
    gives before any tensor is read."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"lora_path: {file}: not a safetensors file (its header length is out of range)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"lora_path: {file}: not a safetensors file (its header is not a JSON object)")  # noqa: TRY004
    end_of_data = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = expected(key)
        ok = (isinstance(entry, dict) and entry.get("dtype") in _DTYPE_BYTES and isinstance(entry.get("shape"), list)
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in entry["data_offsets"]))
        if not ok:
            raise ValueError(f"lora_path: {file}: {_label(key)}: its header entry is not a float tensor's "
                             f"(dtype one of {sorted(_DTYPE_BYTES)}, shape, data_offsets)")
        if tuple(entry["shape"]) != shape:
            raise ValueError(f"lora adapter {name!r}: {file}: {_label(key)} has shape {tuple(entry['shape'])[:4]}; this "
                             f"model needs {shape} (an adapter of another base model?)")
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end or end - begin != shape[0] * shape[1] * _DTYPE_BYTES[entry["dtype"]]:
            raise ValueError(f"lora_path: {file}: {_label(key)}: data_offsets do not match its shape and dtype")
        end_of_data = max(end_of_data, end)
    if 8 + n + end_of_data != size:
        raise ValueError(f"lora_path: {file}: {size} bytes but its header describes {8 + n + end_of_data} "
                         "(truncated, or data beyond its tensors)")
    return header


def _read_tensors(path: str, name: str, expected) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st):
        header = _safetensors_header(st, name, expected)
        try:
            from safetensors import safe_open

            with safe_open(st, framework="pt") as f:
                return {k: _check_tensor(name, st, k, f.get_tensor(k), expected(k))
                        for k in header if k != "__metadata__"}
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a corrupt file is the request's error, by name
            raise ValueError(f"lora_path: {st}: cannot read the adapter's weights ({type(exc).__name__})") from None
    if os.path.isfile(pt):
        try:  # mmap: the tensors' shapes are known before their data is read
            loaded = torch.load(pt, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"lora_path: {pt}: cannot read the adapter's weights ({type(exc).__name__})") from None
        if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in loaded.items()):
            raise ValueError(f"lora_path: {pt}: not a state dict of named tensors")
        shapes = {k: expected(k) for k in loaded}
        for k, v in loaded.items():
            if tuple(v.shape) != shapes[k]:
                _check_tensor(name, pt, k, v, shapes[k])
        return {k: _check_tensor(name, pt, k, v, shapes[k]) for k, v in loaded.items()}
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
