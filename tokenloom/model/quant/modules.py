"""The quantized projections, chosen once at load (the loader's `quantize_model`): `Int4Linear` (4- or
5-bit codes with a scale and an offset per group of 32) and `Int8Linear` (per-column or grouped int8),
each on the C kernels it is given (`gemm.QuantGemm`) or torch's own op (`_weight_int4pack_mm_for_cpu`
with bfloat16 activations: scale = d, zero = m + 8d, as the op computes (q - 8) * scale + zero;
`_weight_int8pack_mm`). `dense_prefill` keeps the weights dequantized to bfloat16 too, for long
prefill chunks through oneDNN; a row's kernel then depends on its own sequence's chunk length
(runner.SHORT_CHUNK), never on the rest of the batch."""

from __future__ import annotations

import abc
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .formats import GROUP
from .gemm import QuantGemm, why_not
from .layouts import dequantize_blocks, pack_int4, pack_int8_c_layout, quantize_int8, quantize_int8_grouped

logger = logging.getLogger(__name__)


def onednn_packed(w: torch.Tensor) -> torch.Tensor:
    """`w` in oneDNN's own blocked layout (as torch.compile's freezing does), for long prefill chunks:
    the matmul then stops re-laying out the weight on every call (faster, the same bits:
    benchmarks/forward_levers.py). The plain weight where this torch has no oneDNN."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 128)  # 128: the row count it is tuned for
    except (AttributeError, RuntimeError) as exc:
        logger.info("oneDNN weight packing unavailable (%s); plain weights for long prefill chunks", exc)
        return w


class SplitRowsLinear(nn.Module, metaclass=abc.ABCMeta):
    """A quantized projection: rows [0, decode_like_rows) (decodes and short prompt slices) through the
    quantized kernel (`_quantized`), the rest (long prompt chunks) through `dense`, the weights in
    bfloat16 packed for oneDNN, when it is kept (None: every row quantized); the bias added after."""

    dense: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # float32 (set by quantize_model)

    @abc.abstractmethod
    def _quantized(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The quantized kernel's output for rows `x` (each weight format its own), in `out` where the C
        kernels run."""

    def packed_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What rebuilds this module without packing its weight again (`from_packed_state`; the loader's disk
        cache, model/packed_cache.py): its attributes, and its tensors by name (a buffer that is None
        is left out). Not for a module that keeps a dense copy for long prompts."""
        if self.dense is not None:
            raise ValueError("a module with dense_prefill weights is not cached")
        attrs = {"class": type(self).__name__, "out_features": self.out_features, "in_features": self.in_features,
                 "compute_dtype": str(getattr(self, "compute_dtype", "")).removeprefix("torch.") or None,
                 "kernel": self.kernel.name if self.kernel is not None else None,
                 "buffers": sorted(self._buffers), "grouped": getattr(self, "grouped", False)}
        tensors = {name: t for name, t in self._buffers.items() if t is not None}
        if self.bias is not None:
            tensors["bias"] = self.bias
        return attrs, tensors

    @classmethod
    def from_packed_state(cls, attrs: dict, tensors: dict[str, torch.Tensor], kernel: QuantGemm | None):
        """The module `packed_state` described, on `kernel` (the plan's: a cached module packed for other
        kernels is refused)."""
        if attrs.get("class") != cls.__name__ or attrs.get("kernel") != (kernel.name if kernel is not None else None):
            raise ValueError(f"a cached {attrs.get('class')} for kernels {attrs.get('kernel')!r} does not fit here")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.out_features, module.in_features = attrs["out_features"], attrs["in_features"]
        module.kernel = _fitting(kernel, module)
        if attrs["compute_dtype"]:  # Int4Linear's
            module.compute_dtype = getattr(torch, attrs["compute_dtype"])
        if cls is Int8Linear:
            module.grouped = attrs["grouped"]
        for name in attrs["buffers"]:
            module.register_buffer(name, tensors.get(name))
        module.bias = tensors.get("bias")
        module.dense = None
        return module

    def _long(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dense.dtype)
        if self.dense.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.dense, None, "none", [], "")
        return F.linear(x, self.dense)

    @property
    def rows_independent(self) -> bool:
        """Each output row's bits come from its input row alone, whatever rows share the call (the C
        kernels; not oneDNN's dense bfloat16 path nor torch's int4 op)."""
        return self.dense is None and getattr(self, "kernel", None) is not None

    def forward(self, x: torch.Tensor, decode_like_rows: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a float32 [rows, out_features] buffer the C kernels write into; the result is returned
        either way (a new tensor where another path runs)."""
        rows = x.shape[0]
        d = rows if self.dense is None or decode_like_rows is None else decode_like_rows
        if d >= rows:
            out = self._quantized(x, out)
        elif d == 0:
            out = self._long(x)
        else:
            # Joined in float32: a decode row keeps the bits it has in a step without long chunks.
            out = torch.cat([self._quantized(x[:d]).float(), self._long(x[d:]).float()])
        return _with_bias(out if out.dtype == x.dtype else out.to(x.dtype), self.bias)


class Int4Linear(SplitRowsLinear):
    def __init__(self, blocks: torch.Tensor, dtype: torch.dtype, dense_prefill: bool = False,
                 kernel: QuantGemm | None = None):
        """`kernel`: the C kernels (quant_gemm()), or None for torch's `_weight_int4pack_mm_for_cpu`.
        `dense_prefill`: also keep the weights dequantized to `dtype` for long prefill chunks."""
        super().__init__()
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * GROUP
        self.kernel = _fitting(kernel, self)
        if self.kernel is not None:
            codes, fifth, scales, offsets = self.kernel.pack_int4(blocks)
            self.register_buffer("codes", codes)
            self.register_buffer("fifth", fifth)  # None: 4-bit codes (int4_gemm), else int5_gemm
            self.register_buffer("scales", scales)
            self.register_buffer("offsets", offsets)  # None: symmetric codes (Q4_0, Q5_0)
            self.compute_dtype = torch.float32
        else:
            if blocks[..., 2:].max() > 15:
                raise ValueError("5-bit codes need the C kernels (torch's int4 op takes 4 bits)")
            packed, sz = pack_int4(blocks, dtype)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", sz)
            self.compute_dtype = dtype
        self.dense = onednn_packed(dequantize_blocks(blocks).to(dtype)) if dense_prefill else None

    def _quantized(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        if self.kernel is not None:
            return self.kernel.int4(x, self.codes, self.scales, self.offsets, self.fifth, out=out)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    @property
    def bits(self) -> int:
        return 5 if getattr(self, "fifth", None) is not None else 4

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel is not None else "torch"
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, "
                f"bits={self.bits}, kernel={kernel}")


def _fitting(kernel: QuantGemm | None, module: SplitRowsLinear) -> QuantGemm | None:
    """`kernel`, where it takes the module's shape; else a ValueError (the caller gives such a weight
    torch's op, `gemm.why_not`), never a quiet torch op."""
    reason = None if kernel is None else why_not(module.out_features, module.in_features)
    if reason is not None:
        raise ValueError(f"{type(module).__name__}: the C kernels cannot take {reason}")
    return kernel


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The projection's bias added in place (the output is this call's own tensor)."""
    return out if bias is None else out.add_(bias.to(out.dtype))


class Int8Linear(SplitRowsLinear):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, kernel: QuantGemm | None = None,
                 grouped: bool = False, dense_prefill: bool = False):
        """`kernel`: the C kernels (quant_gemm()), or None for torch's `_weight_int8pack_mm` (per-column
        scales only). `grouped`: a scale per group of 32 inputs (the projections), else per column (the
        LM head, rescored anyway). `dense_prefill`: also keep `weight` in `dtype` for long prefill chunks."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = _fitting(kernel, self)
        self.grouped = grouped and self.kernel is not None
        q, scale = quantize_int8_grouped(weight) if self.grouped else quantize_int8(weight)
        if self.kernel is not None:
            self.register_buffer("codes", self.kernel.pack_int8g(q) if self.grouped else pack_int8_c_layout(q))
            if self.grouped:  # [N/16, K/32, 16] float32: each column block's 16 scales per group
                scale = scale.reshape(self.out_features // 16, 16, -1).transpose(1, 2)
            self.register_buffer("scales", scale.float().contiguous())
        else:
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(dtype))
        self.dense = onednn_packed(weight.to(dtype)) if dense_prefill else None

    def _quantized(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.int8(x.float(), self.codes, self.scales, out=out)
        dt = self.scales.dtype
        return torch._weight_int8pack_mm(x if x.dtype == dt else x.to(dt), self.qweight, self.scales)

