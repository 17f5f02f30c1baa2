"""The small operations inside a decoder layer (RMSNorm, RoPE, the KV-cache write, the MLP's SiLU and
product), behind one interface chosen once at load, as decode attention is:

- `TorchLayerOps`: torch ops, the float32 reference path (token-exact against transformers).
- `CLayerOps`: csrc/layer_ops.c, one C call each for float32 activations. At batch 1 a step runs ~150
  of these ops and torch spends 5-10 us dispatching each; the C calls take about 1 us. Falls back to
  the torch op for anything else (other dtypes, strides it was not written for).

Every op works row by row: a row's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import kernels


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
        """k, v [T, kv_heads, head_dim] into the caches' rows `slots`, cast to the cache's dtype."""
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))

    def lora_add(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        """y[r] += (x[r] a[slots[r]]) b[slots[r]] row by row in place, if this implementation takes these
        tensors (False: the caller's batched products do it; model/lora.py)."""
        return False


TORCH_OPS = TorchLayerOps()


class CLayerOps(TorchLayerOps):
    name = "c"
    lora_dtype = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._rms_norm, self._rope, self._silu_mul = lib.rms_norm_f32, lib.rope_f32, lib.silu_mul_f32
        self._rms_norm.argtypes = [p, p, i64, i64, ctypes.c_float, p]
        self._rope.argtypes = [p, i64, i64, i64, i64, p, p]
        self._silu_mul.argtypes = [p, i64, i64, p]
        self._rms_norm.restype = self._rope.restype = self._silu_mul.restype = None
        self._lora_add = lib.lora_add_bf16
        self._lora_add.argtypes = [p, i64, i64, p, p, p, i64, i64, p]
        self._lora_add.restype = ctypes.c_int
        self._write = {torch.float32: lib.write_kv_f32, torch.float16: lib.write_kv_f16}
        for fn in self._write.values():
            fn.argtypes = [p, i64, p, i64, i64, i64, p, i64, p, p]
            fn.restype = ctypes.c_int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if (x.dtype != torch.float32 or x.dim() != 2 or weight.dtype != torch.float32
                or weight.shape != (x.shape[1],) or not weight.is_contiguous()):
            return super().rms_norm(x, weight, eps)
        x = x.contiguous()
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, heads, head_dim = x.shape
        if (x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim
                or any(t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != rows * head_dim
                       for t in (cos, sin))):
            return super().rope(x, cos, sin)
        self._rope(x.data_ptr(), rows, x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr())
        return x

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or gate_up.shape[1] % 2:
            return super().silu_mul(gate_up, out)
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = fitting(out, (rows, inter), torch.float32)
        if out is None:
            out = torch.empty(rows, inter, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
        fn = self._write.get(k_cache.dtype)
        rows, kv_heads, head_dim = k.shape
        fits = (fn is not None and k.dtype == v.dtype == torch.float32 and k.shape == v.shape
                and slots.dtype == torch.int64 and slots.shape == (rows,)
                and all(t.stride(1) == head_dim and t.stride(2) == 1 for t in (k, v))
                and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
                and k_cache.shape == v_cache.shape and k_cache.shape[1:] == (kv_heads, head_dim))
        if not fits:
            return super().write_kv(k, v, slots, k_cache, v_cache)
        slots = slots.contiguous()
        if fn(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), rows, kv_heads * head_dim, slots.data_ptr(),
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


def layer_ops_for(dtype: torch.dtype, want: bool) -> TorchLayerOps:
    """The C ops when asked for, the activations are float32 and the library builds and checks; else torch."""
    if want and dtype == torch.float32:
        lib = kernels.load(SPEC)
        if lib is not None:
            return CLayerOps(lib)
    return TORCH_OPS


# Run in a child before loading (model/kernels.py): one small case of each op against a direct computation.
_CHECK = r"""
import ctypes, math, random, struct, sys
lib = ctypes.CDLL(sys.argv[1])
p, i64 = ctypes.c_void_p, ctypes.c_int64
lib.rms_norm_f32.argtypes = [p, p, i64, i64, ctypes.c_float, p]
lib.rope_f32.argtypes = [p, i64, i64, i64, i64, p, p]
lib.write_kv_f16.argtypes = [p, i64, p, i64, i64, i64, p, i64, p, p]
rng = random.Random(0)
F = lambda v: (ctypes.c_float * len(v))(*v)
R, D = 3, 20
x = [rng.uniform(-2, 2) for _ in range(R * D)]
w = [rng.uniform(0.5, 1.5) for _ in range(D)]
out = (ctypes.c_float * (R * D))()
lib.rms_norm_f32(F(x), F(w), R, D, ctypes.c_float(1e-5), out)
for r in range(R):
    inv = 1 / math.sqrt(sum(v * v for v in x[r * D:(r + 1) * D]) / D + 1e-5)
    for i in range(D):
        assert abs(out[r * D + i] - w[i] * x[r * D + i] * inv) < 1e-5, ("rms_norm", r, i)
HD, H, STRIDE = 20, 2, 50
qk = [struct.unpack("<f", struct.pack("<f", rng.uniform(-1, 1)))[0] for _ in range(R * STRIDE)]  # float32 values
cos = [rng.uniform(-1, 1) for _ in range(R * HD)]
sin = [rng.uniform(-1, 1) for _ in range(R * HD)]
buf = F(qk)
lib.rope_f32(buf, R, STRIDE, H, HD, F(cos), F(sin))
for r in range(R):
    for h in range(H):
        a = r * STRIDE + h * HD
        for i in range(HD):
            rot = -qk[a + i + HD // 2] if i < HD // 2 else qk[a + i - HD // 2]
            assert abs(buf[a + i] - (qk[a + i] * cos[r * HD + i] + rot * sin[r * HD + i])) < 1e-5, ("rope", r, h, i)
for i in range(R * STRIDE):
    if i % STRIDE >= H * HD:
        assert buf[i] == qk[i], "rope wrote outside its heads"
lib.silu_mul_f32.argtypes = [p, i64, i64, p]
gu = [rng.uniform(-30, 30) for _ in range(R * 2 * D)]
out = (ctypes.c_float * (R * D))()
lib.silu_mul_f32(F(gu), R, D, out)
f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]
for r in range(R):
    for i in range(D):
        g, u = f32(gu[r * 2 * D + i]), f32(gu[r * 2 * D + D + i])
        ref = g / (1 + math.exp(-g)) * u
        assert abs(out[r * D + i] - ref) < 1e-5 * (1 + abs(ref)), ("silu_mul", r, i, out[r * D + i], ref)
W, SLOTS = 12, 5
k, v = F([rng.uniform(-3, 3) for _ in range(R * STRIDE)]), F([rng.uniform(-3, 3) for _ in range(R * STRIDE)])
slots = (ctypes.c_int64 * R)(4, 0, 2)
kc, vc = (ctypes.c_uint16 * (SLOTS * W))(), (ctypes.c_uint16 * (SLOTS * W))()
assert lib.write_kv_f16(k, STRIDE, v, STRIDE, R, W, slots, SLOTS, kc, vc) == 0
half = lambda bits: struct.unpack("<e", struct.pack("<H", bits))[0]
for r in range(R):
    for i in range(W):
        assert half(kc[slots[r] * W + i]) == struct.unpack("<e", struct.pack("<e", k[r * STRIDE + i]))[0], ("kv", r, i)
        assert half(vc[slots[r] * W + i]) == struct.unpack("<e", struct.pack("<e", v[r * STRIDE + i]))[0], ("kv", r, i)
assert lib.write_kv_f16(k, STRIDE, v, STRIDE, R, W, (ctypes.c_int64 * R)(0, 5, 1), SLOTS, kc, vc) == 1
lib.lora_add_bf16.argtypes = [p, i64, i64, p, p, p, i64, i64, p]
K, N, RANK, ADAPTERS = 20, 24, 3, 2
bf16_bits = lambda v: struct.unpack("<I", struct.pack("<f", v))[0] >> 16  # truncated: exact as bfloat16
from_bits = lambda h: struct.unpack("<f", struct.pack("<I", h << 16))[0]
x = [rng.uniform(-1, 1) for _ in range(R * K)]
a_bits = [bf16_bits(rng.uniform(-1, 1)) for _ in range(ADAPTERS * K * RANK)]
b_bits = [bf16_bits(rng.uniform(-1, 1)) for _ in range(ADAPTERS * RANK * N)]
a, b = [from_bits(h) for h in a_bits], [from_bits(h) for h in b_bits]
y0 = [rng.uniform(-1, 1) for _ in range(R * N)]
slot = (ctypes.c_int64 * R)(1, -1, 0)
y = F(y0)
A, B = (ctypes.c_uint16 * len(a_bits))(*a_bits), (ctypes.c_uint16 * len(b_bits))(*b_bits)
assert lib.lora_add_bf16(F(x), R, K, slot, A, B, RANK, N, y) == 0
for r in range(R):
    s = slot[r]
    t = [sum(x[r * K + i] * a[(s * K + i) * RANK + j] for i in range(K)) for j in range(RANK)]
    for c in range(N):
        ref = y0[r * N + c] + (sum(t[j] * b[(s * RANK + j) * N + c] for j in range(RANK)) if s >= 0 else 0)
        assert abs(y[r * N + c] - ref) < 1e-4 * (1 + abs(ref)), ("lora_add", r, c, y[r * N + c], ref)
assert lib.lora_add_bf16(F(x), R, K, slot, A, B, 513, N, y) == 1
"""

SPEC = kernels.KernelSpec("layer_ops", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"), _CHECK)
