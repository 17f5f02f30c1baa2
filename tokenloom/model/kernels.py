"""The project's C kernels (model/csrc/*.c): built at first use, checked, loaded with ctypes.

Each kernel is compiled with the system C compiler into ~/.cache/tokenloom/kernels (TOKENLOOM_CACHE_DIR
overrides), keyed by its source and headers, flags, the CPU's flags, the compiler and the check, then
run once on a small case in a child process before this process loads it: an instruction the CPU
advertises but traps on kills the child, not the server. Any failure (no compiler, a missing CPU flag,
a wrong answer) gives None, logged, and the caller takes its next choice, another kernel or torch's op
(TOKENLOOM_C_KERNELS=0 asks for torch's everywhere). The libraries link against the libgomp torch
already loaded, so they share its OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# Every kernel declares its interface in csrc/kernels.h; warnings on (the tests build them with -Werror).
BASE_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra")


@dataclass(frozen=True)
class KernelSpec:
    name: str  # csrc/<name>.c
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags it needs
    cflags: tuple[str, ...]
    check: str  # Python run in a child with the library's path as argv[1]; must exit 0


def cpu_flags() -> list[str]:
    """The CPU's flags from /proc/cpuinfo. TOKENLOOM_MAX_ISA=avx2 hides AVX-512 and AMX, so an AVX-512
    machine picks the kernels an AVX2-only one would (with ATEN_CPU_CAPABILITY=avx2 and
    ONEDNN_MAX_CPU_ISA=AVX2 for torch's own: benchmarks/peers.sh ISA=avx2)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if os.environ.get("TOKENLOOM_MAX_ISA", "").lower() == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    return sorted(flags)


def cache_dir() -> Path:
    base = os.environ.get("TOKENLOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenloom")
    return Path(base) / "kernels"


@functools.cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def load(spec: KernelSpec) -> ctypes.CDLL | None:
    """Compile (once per source/flags/CPU), check in a child process, load. None (logged) if any step fails
    or TOKENLOOM_C_KERNELS=0 turns them all off (to compare against the torch paths)."""
    if os.environ.get("TOKENLOOM_C_KERNELS", "1") == "0":
        logger.info("%s kernel: off (TOKENLOOM_C_KERNELS=0)", spec.name)
        return None
    flags = cpu_flags()
    missing = spec.cpu_flags - set(flags)
    if missing:
        logger.info("%s kernel: this CPU lacks %s; the next choice is taken", spec.name, " ".join(sorted(missing)))
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        logger.info("%s kernel: no C compiler found; the next choice is taken", spec.name)
        return None
    source = CSRC / f"{spec.name}.c"
    cflags = [*BASE_CFLAGS, *spec.cflags]
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # what the sources include
    # Everything that decides the library and whether it passed: source, flags, CPU, compiler, the check.
    identity = [source.read_bytes(), headers, " ".join(cflags).encode(), " ".join(flags).encode(),
                _compiler_version(cc).encode(), spec.check.encode()]
    key = hashlib.sha256(b"\0".join(identity)).hexdigest()[:16]
    lib_path = cache_dir() / f"{spec.name}-{key}.so"
    checked = lib_path.with_suffix(".checked")
    try:
        if not lib_path.exists():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                tmp_lib = Path(tmp) / lib_path.name
                built = subprocess.run([cc, *cflags, str(source), "-o", str(tmp_lib), "-lm"], check=True,
                                       capture_output=True, text=True, timeout=120)
                if built.stderr.strip():  # warnings: the kernels build clean here (tests/test_kernels.py)
                    logger.warning("%s kernel: the compiler warned: %s", spec.name, built.stderr.strip()[-500:])
                os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never load a half-written file
        if not checked.exists():
            subprocess.run([sys.executable, "-c", spec.check, str(lib_path)], check=True, capture_output=True,
                           text=True, timeout=60)
            checked.touch()
        return ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        logger.warning("%s kernel unavailable (%s %s); the next choice is taken", spec.name, exc, detail[-300:])
        return None
