"""What runs here, found at start-up by running tiny ops (never assumed from the CPU model), and the
policy that turns it into the format a model loads with (`choose`)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..kernels import cpu_flags  # also what the benchmarks record the CPU flags from
from . import gemm
from .formats import resolve_quantization
from .layouts import dequantize_blocks, q4_1_from_dense
from .modules import Int4Linear, Int8Linear

logger = logging.getLogger(__name__)


@functools.cache
def detect() -> dict:
    """What runs here, found by running tiny ops (never assumed from the CPU model): the C kernels, and
    only where they do not pass, torch's own quantized ops (`torch_quant_ops`: their first calls leave
    memory behind in a process that never calls them again); plus torch's ISA choice and CPU flags."""
    flags = set(cpu_flags())
    found: dict = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }
    kernel = gemm.quant_gemm()
    found["int4_kernel"] = kernel.name if kernel is not None else "torch"
    if kernel is not None:
        found |= kernel_runs(kernel)
        found["int8_c"] = found["int4_c"]  # one library: its check ran the int8 kernels too
    # The C kernels read a quarter of float32's bytes and passed their check: int4 whatever a timing says
    # (a timing taken while the machine is busy can measure them many times slower). Torch's own int4
    # op takes bf16 activations; where bf16 is emulated it can lose to float32, so without the C kernels
    # "auto" takes int4 only where a decode-sized matmul measured faster than float32 here.
    if found.get("int4_c"):
        found["fast_int4"] = True
    else:
        found |= torch_quant_ops()
        found["int4_speedup_b1"] = _int4_speedup(None) if found["int4_bf16"] else 0.0
        found["fast_int4"] = found["int4_speedup_b1"] > 1.2
    return found


@functools.cache
def kernel_runs(kernel: gemm.QuantGemm) -> dict:
    """{"int4_c": does an int4 layer on `kernel` give the right answer in this process} (and
    "int4_c_error" where it raised)."""
    found: dict = {}
    x, _, blocks = _probe_case()
    _probe(found, "int4_c", lambda: Int4Linear(blocks, torch.bfloat16, kernel=kernel)(x), x @ dequantize_blocks(blocks).t())
    return found


@functools.cache
def torch_quant_ops() -> dict:
    """Which of torch's own ops run here and give the right answer: int4 and int8 with bfloat16
    activations, bfloat16 dense."""
    found: dict = {}
    x, w, blocks = _probe_case()
    _probe(found, "int4_bf16", lambda: Int4Linear(blocks, torch.bfloat16)(x.bfloat16()), x @ dequantize_blocks(blocks).t())
    _probe(found, "int8_bf16", lambda: Int8Linear(w, torch.bfloat16)(x.bfloat16()), x @ w.t())
    _probe(found, "bf16_dense", lambda: F.linear(x.bfloat16(), w.bfloat16()), x @ w.t())
    return found


def _probe_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, w, w's Q4_1 blocks) of the detection's tiny matmuls, the same every call."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    w = torch.randn(64, 64, generator=gen) * 0.1
    return x, w, q4_1_from_dense(w)


def _probe(found: dict, name: str, fn, expected: torch.Tensor) -> None:
    """found[name]: does `fn()` run and come within 5% of `expected` (its error as name_error if it raises)."""
    try:
        found[name] = bool(torch.allclose(fn().float(), expected, rtol=0.05, atol=0.05))
    except Exception as exc:  # noqa: BLE001 - op missing in this build, unsupported dtype, ...
        found[name] = False
        found[name + "_error"] = f"{type(exc).__name__}: {exc}"[:200]


def _int4_speedup(kernel: gemm.QuantGemm | None, layers: int = 24) -> float:
    """float32 time / int4 time of a decode row through `layers` MLP-sized weights (1536 x 576), more
    float32 bytes (85 MB) than a CPU cache holds, as in a real forward; best of 5 passes (~0.1 s)."""
    import time

    gen = torch.Generator().manual_seed(1)
    dense = [torch.randn(1536, 576, generator=gen) * 0.05 for _ in range(layers)]
    quant = [Int4Linear(q4_1_from_dense(w), torch.bfloat16, kernel=kernel) for w in dense]
    x = torch.randn(1, 576, generator=gen)

    def best(fn) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best(lambda: [F.linear(x, w) for w in dense])
    return fp32 / max(best(lambda: [layer(x) for layer in quant]), 1e-9)


def choose(quantization: str | None, dtype: str) -> tuple[str, str]:
    """(quantization, dtype) to load with. "auto" -> int4 where int4 with bf16 activations runs and
    measured faster than float32, else none. An explicit int4/int8 that does not run here falls back
    to dense with a warning. `dtype` is the residual stream's: "float32" keeps it in float32 (the C
    kernels take it as is; torch's int4/int8 ops get bfloat16 casts around them), "bfloat16" runs
    everything in bfloat16 (fewest ops, lower quality)."""
    cap = detect()
    if quantization == "auto":
        runs = cap.get("int4_c") or cap["int4_bf16"]
        return ("int4", dtype) if runs and cap["fast_int4"] else ("none", dtype)
    method = resolve_quantization(quantization)
    if method == "none":
        return method, dtype
    if not (cap.get(f"{method}_bf16") or cap.get(f"{method}_c")):
        logger.warning("quantization %s does not run on this CPU/torch (%s); using dense weights", method, cap)
        return "none", dtype
    return method, dtype


# --- the plan's strategies for the projections' kernels (model/plan.py asks each in turn) --------------


class CKernelStrategy:
    """A quant_gemm library: where this CPU has its flags, it builds and passes its check, and an int4
    layer on it gives the right answer in this process."""

    def __init__(self, name: str, spec, kernel):
        self.name, self._spec, self._kernel = name, spec, kernel

    def can_implement(self, needs, cpu) -> tuple[bool, str | None]:
        """`needs`: plan.ForwardNeeds; `cpu`: kernels.CPU."""
        if needs.exact:
            return False, needs.exact
        lib, reason = cpu.library(self._spec)
        if lib is None:
            return False, reason
        runs = kernel_runs(self._kernel())
        return runs["int4_c"], None if runs["int4_c"] else f"an int4 layer on it is wrong here ({runs.get('int4_c_error')})"

    def build(self, needs, cpu) -> gemm.QuantGemm:
        return self._kernel()


class TorchGemmStrategy:
    """torch's own int4 / int8 ops (`choose` has taken the format only where they run)."""

    name = "torch"

    def can_implement(self, needs, cpu) -> tuple[bool, str | None]:
        return True, None

    def build(self, needs, cpu) -> None:
        return None  # the modules' kernel None: torch's op


STRATEGIES = (CKernelStrategy("c-avx512", gemm.SPEC_AVX512, gemm.quant_gemm_avx512),
              CKernelStrategy("c-avx2", gemm.SPEC_AVX2, gemm.quant_gemm_avx2), TorchGemmStrategy())
