"""Every C kernel (model/csrc/) and its check (csrc/checks/) builds without a warning and, on a CPU with
the flags it needs, builds, passes its check and loads: a kernel that falls back here is a failing test,
not a silent torch path. Every kernel source and check includes csrc/kernels.h, so definitions and calls
are held to the declared interface, and the ctypes types of every function come from the same header."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from tokenloom.model import decoder_loop, kernels, layer_ops, paged_attention
from tokenloom.model.quant.gemm import SPEC_AVX2, SPEC_AVX512

SPECS = [SPEC_AVX512, SPEC_AVX2, layer_ops.SPEC, paged_attention.SPEC, paged_attention.SPEC_AVX512,
         decoder_loop.SPEC]


def test_every_kernel_source_is_listed_and_includes_the_interface_header():
    sources = {p.stem for p in kernels.CSRC.glob("*.c")}
    assert sources == {spec.name for spec in SPECS}
    for name in sources:
        assert '#include "kernels.h"' in (kernels.CSRC / f"{name}.c").read_text(), name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_compiles_without_warnings(spec, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "no C compiler: the kernels cannot build"
    built = subprocess.run([cc, *kernels.BASE_CFLAGS, "-Werror", *spec.cflags, str(kernels.CSRC / f"{spec.name}.c"),
                            "-o", str(tmp_path / "k.so"), "-lm"], check=False, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_check_compiles_without_warnings(spec, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "no C compiler: the checks cannot build"
    command = spec.check_command(cc, tmp_path / "check")
    built = subprocess.run([command[0], "-Werror", *command[1:]], check=False, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]


def test_every_check_belongs_to_a_spec():
    assert {p.stem for p in kernels.CHECKS.glob("*.c")} == {spec.check for spec in SPECS}


def test_ctypes_signatures_come_from_the_header():
    sigs = kernels.signatures()
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    assert sigs["int4_gemm"] == (ctypes.c_int, [p, i64, i64, p, p, p, i64, p])  # a function type's instance
    assert sigs["int8g_gemm"] == sigs["int8_gemm"] == (ctypes.c_int, [p, i64, i64, p, p, i64, p])
    assert sigs["rms_norm_f32"] == (None, [p, p, i64, i64, ctypes.c_float, p])
    assert sigs["paged_decode_attention_avx512_f16"] == sigs["paged_decode_attention_f32"]  # a list of instances
    assert sigs["decoder_loop"] == (ctypes.c_int, [p, p, p, p, i64, p, p, p, p, i64, p, i64])  # a prototype
    assert sigs["paged_decode_attention_q8"] == sigs["paged_decode_attention_avx512_q8"] == sigs["paged_decode_attention_f32"]
    assert sigs["write_kv_q8"] == (ctypes.c_int, [p, i64, p, i64, i64, i64, i64, p, i64, p, p])
    assert not {name for name in sigs if name.startswith(("gemm_", "top_"))}  # the inline helpers are not functions
    assert len(sigs) == 19


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_builds_checks_and_loads_where_the_cpu_has_its_flags(spec, monkeypatch):
    monkeypatch.delenv("TOKENLOOM_C_KERNELS", raising=False)
    missing = spec.cpu_flags - set(kernels.cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} (the kernel is not for it)")
    assert kernels.load(spec) is not None, f"{spec.name} did not build or pass its check (see the log)"
