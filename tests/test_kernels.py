"""Every C kernel (model/csrc/) builds without a warning and, on a CPU with the flags it needs, builds,
passes its check and loads: a kernel that falls back here is a failing test, not a silent torch path.
Every kernel source includes csrc/kernels.h, so its definitions are held to the declared interface."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tokenloom.model import decoder_loop, kernels, layer_ops, linear, paged_attention

SPECS = [linear.SPEC_AVX512, linear.SPEC_AVX2, layer_ops.SPEC, paged_attention.SPEC, paged_attention.SPEC_AVX512,
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
def test_kernel_builds_checks_and_loads_where_the_cpu_has_its_flags(spec, monkeypatch):
    monkeypatch.delenv("TOKENLOOM_C_KERNELS", raising=False)
    missing = spec.cpu_flags - set(kernels.cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} (the kernel is not for it)")
    assert kernels.load(spec) is not None, f"{spec.name} did not build or pass its check (see the log)"
