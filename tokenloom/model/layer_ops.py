"""The small operations inside a decoder layer (RMSNorm, RoPE, the KV-cache write, the MLP's SiLU and
product), behind one interface chosen once at load, as decode attention is:

- `TorchLayerOps`: torch ops, the float32 reference path (token-exact against transformers).
- `CLayerOps`: csrc/layer_ops.c, one C call each for float32 activations. At batch 1 a step runs ~150
  of these ops and torch spends several times a C call's time dispatching each. The plan
  (model/plan.py) takes them only for a float32 residual stream over a float32, float16 or int8 KV
  cache (model/kv_quant.py); a call they were not written for (another dtype, strides) is an error,
  never a quiet torch op. GeGLU
  (`gelu_tanh_mul`) has no C version: torch's, for both.

Every op works row by row: a row's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import kernels, kv_quant


def fitting(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """`out` if it is a contiguous `shape` tensor of `dtype`, else None (then the op makes its own). Never
    resized to fit: it may be a view of a buffer the model's layers share (decoder.PassBuffers)."""
    fits = out is not None and out.shape == shape and out.dtype == dtype and out.is_contiguous()
    return out if fits else None


class TorchLayerOps:
    name = "torch"
    lora_dtype: torch.dtype | None = None  # LoRA stacks' dtype lora_add takes (None: the adapters' own)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's own kernel: the same operations in fewer calls
            return F.rms_norm(x, weight.shape, weight, eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim], cos/sin [T, 1, head_dim]: x·cos + rotate_half(x)·sin, element for element
        as Hugging Face does. May rotate `x` in place (it is this step's fresh projection output)."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, 2 * inter] (gate, then up) -> silu(gate) * up, [T, inter], into `out` when given."""
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return torch.mul(F.silu(gate), up, out=fitting(out, up.shape, up.dtype))

    def gelu_tanh_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, 2 * inter] (gate, then up) -> gelu_tanh(gate) * up (GeGLU), [T, inter], into `out` when given."""
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return torch.mul(F.gelu(gate, approximate="tanh"), up, out=fitting(out, up.shape, up.dtype))

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into the caches' rows `slots`, cast to the cache's dtype (an int8
        cache: quantized, each row with its scale: model/kv_quant.py)."""
        cast = kv_quant.quantize if k_cache.dtype == torch.int8 else (lambda x: x.to(k_cache.dtype))
        k_cache.index_copy_(0, slots, cast(k))
        v_cache.index_copy_(0, slots, cast(v))

    def lora_add(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        """y[r] += (x[r] a[slots[r]]) b[slots[r]] row by row in place, if this implementation takes these
        tensors (False: the caller's batched products do it; model/lora.py)."""
        return False


TORCH_OPS = TorchLayerOps()


class CLayerOps(TorchLayerOps):
    name = "c"
    lora_dtype = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL):
        """`lib`: csrc/layer_ops.c as kernels.load gives it (its functions typed from csrc/kernels.h)."""
        self._rms_norm, self._rope, self._silu_mul = lib.rms_norm_f32, lib.rope_f32, lib.silu_mul_f32
        self._lora_add = lib.lora_add_bf16
        self._write = {torch.float32: lib.write_kv_f32, torch.float16: lib.write_kv_f16}
        self._write_q8 = lib.write_kv_q8  # an int8 cache: rows of codes and their scale (model/kv_quant.py)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if (x.dtype != torch.float32 or x.dim() != 2 or weight.dtype != torch.float32
                or weight.shape != (x.shape[1],) or not weight.is_contiguous()):
            _unfit("rms_norm", x, "float32 [rows, dim] with a contiguous float32 weight [dim]")
        x = x.contiguous()
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, heads, head_dim = x.shape
        if (x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim
                or any(t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != rows * head_dim
                       for t in (cos, sin))):
            _unfit("rope", x, "float32 [rows, heads, head_dim] (heads contiguous) and float32 tables")
        self._rope(x.data_ptr(), rows, x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr())
        return x

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or gate_up.shape[1] % 2:
            _unfit("silu_mul", gate_up, "float32 [rows, 2 * inter]")
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = fitting(out, (rows, inter), torch.float32)
        if out is None:
            out = torch.empty(rows, inter, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
        q8 = k_cache.dtype == torch.int8
        fn = self._write_q8 if q8 else self._write.get(k_cache.dtype)
        rows, kv_heads, head_dim = k.shape
        fits = (fn is not None and k.dtype == v.dtype == torch.float32 and k.shape == v.shape
                and slots.dtype == torch.int64 and slots.shape == (rows,)
                and all(t.stride(1) == head_dim and t.stride(2) == 1 for t in (k, v))
                and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
                and k_cache.shape == v_cache.shape
                and k_cache.shape[1:] == (kv_heads, kv_quant.row_elements(k_cache.dtype, head_dim))
                and (not q8 or head_dim % 8 == 0))
        if not fits:
            _unfit("write_kv", k, f"float32 K/V [rows, kv_heads, head_dim] into a float32, float16 or int8 cache "
                   f"(the cache: {k_cache.dtype} {tuple(k_cache.shape)})")
        slots = slots.contiguous()
        shape = (kv_heads, head_dim) if q8 else (kv_heads * head_dim,)
        if fn(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), rows, *shape, slots.data_ptr(),
              k_cache.shape[0], k_cache.data_ptr(), v_cache.data_ptr()):
            raise IndexError(f"KV write: a slot outside the cache's {k_cache.shape[0]} rows")

    def lora_add(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        rows, k = x.shape
        n, rank = y.shape[1], a.shape[2]
        if not (x.dtype == y.dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16 and y.is_contiguous()
                and a.is_contiguous() and b.is_contiguous() and slots.dtype == torch.int64
                and slots.shape == (rows,) and a.shape[1] == k and b.shape[1:] == (rank, n) and rank <= LORA_MAX_RANK):
            return False
        x, slots = x.contiguous(), slots.contiguous()
        if self._lora_add(x.data_ptr(), rows, k, slots.data_ptr(), a.data_ptr(), b.data_ptr(), rank, n, y.data_ptr()):
            raise MemoryError(f"LoRA kernel: no memory to group {rows} rows by adapter")
        return True


LORA_MAX_RANK = 512  # csrc/layer_ops.c's bound on a LoRA stack's rank


def _unfit(op: str, x: torch.Tensor, takes: str) -> None:
    raise ValueError(f"C layer ops: {op} takes {takes}, got {x.dtype} {tuple(x.shape)} strides {x.stride()} "
                     "(the plan chose the C ops for this model: model/plan.py)")


# --- the plan's strategies (model/plan.py asks each in turn, the first that can implement runs) --------


class CLayerOpsStrategy:
    name = CLayerOps.name

    def can_implement(self, needs, cpu: kernels.CPU) -> tuple[bool, str | None]:
        """`needs`: plan.ForwardNeeds (the residual stream's dtype, whether the exact path was asked for)."""
        if needs.exact:
            return False, needs.exact
        if needs.dtype != torch.float32:
            return False, f"a {str(needs.dtype).removeprefix('torch.')} residual stream (the C ops take float32)"
        if needs.kv_dtype not in (torch.float32, torch.float16, torch.int8):
            return False, (f"a {str(needs.kv_dtype).removeprefix('torch.')} KV cache (their KV write takes "
                           "float32, float16 or int8)")
        lib, reason = cpu.library(SPEC)
        return lib is not None, reason

    def build(self, needs, cpu: kernels.CPU) -> CLayerOps:
        return CLayerOps(cpu.library(SPEC)[0])


class TorchLayerOpsStrategy:
    name = TorchLayerOps.name

    def can_implement(self, needs, cpu: kernels.CPU) -> tuple[bool, str | None]:
        return True, None

    def build(self, needs, cpu: kernels.CPU) -> TorchLayerOps:
        return TORCH_OPS


STRATEGIES = (CLayerOpsStrategy(), TorchLayerOpsStrategy())  # in order of preference


SPEC = kernels.KernelSpec("layer_ops", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"),
                         check="layer_ops")  # csrc/checks/layer_ops.c
