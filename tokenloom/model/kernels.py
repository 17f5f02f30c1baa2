"""The project's C kernels (model/csrc/*.c): built at first use, checked, loaded with ctypes.

Each kernel is compiled with the system C compiler into ~/.cache/tokenloom/kernels (TOKENLOOM_CACHE_DIR
overrides), keyed by its source and headers, flags, the CPU's flags, the compiler and the check, then
checked before this process loads it: its check (csrc/checks/<check>.c, a C program) is built and run
once in a child process on the library, one small case against a direct computation. An instruction
the CPU advertises but traps on kills the child, not the server. Any failure (no compiler, a missing CPU flag,
a wrong answer) gives None, logged, and the caller takes its next choice, another kernel or torch's op
(TOKENLOOM_C_KERNELS=0 asks for torch's everywhere). The libraries link against the libgomp torch
already loaded, so they share its OpenMP thread pool.

Every function's C signature is written once, in csrc/kernels.h: the kernels' sources and the checks
include it (so the compiler holds definitions and calls to it), and `signatures()` reads the same
declarations to give every loaded library's functions their ctypes argument and result types.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CHECKS = CSRC / "checks"
# Every kernel declares its interface in csrc/kernels.h; warnings on (the tests build them with -Werror).
BASE_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra")
CHECK_CFLAGS = ("-O1", "-Wall", "-Wextra", f"-I{CSRC}")  # plain C: a check must not trap where its kernel does not


@dataclass(frozen=True)
class KernelSpec:
    name: str  # csrc/<name>.c
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags it needs
    cflags: tuple[str, ...]
    check: str  # csrc/checks/<check>.c: run in a child with the library's path as argv[1]; must exit 0
    check_flags: tuple[str, ...] = ()  # -D options choosing the check's variant (a layout, an entry point)

    def check_command(self, cc: str, output: Path) -> list[str]:
        """The compiler command that builds this kernel's check program into `output`."""
        return [cc, *CHECK_CFLAGS, *self.check_flags, str(CHECKS / f"{self.check}.c"), "-o", str(output), "-lm", "-ldl"]


# --- the C signatures (csrc/kernels.h) as ctypes types -------------------------------------------------

_C_TYPES = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "float": ctypes.c_float}
_FUNCTION = re.compile(r"(typedef\s+)?(\w+)\s+(\w+)\s*\((.*)\)", re.DOTALL)
_INSTANCES = re.compile(r"(\w+_fn)\s+(\w+(?:\s*,\s*\w+)*)")


def _c_type(decl: str):
    """One C parameter or result type -> its ctypes type (any pointer: c_void_p)."""
    if "*" in decl:
        return ctypes.c_void_p
    words = [w for w in decl.replace("const", " ").split() if w != "struct"]
    name = words[0] if words else decl
    if name not in _C_TYPES:
        raise ValueError(f"csrc/kernels.h: no ctypes type for C type {decl.strip()!r}")
    return _C_TYPES[name]


def _statements(header: str) -> list[str]:
    """The header's top-level declarations: comments, preprocessor lines and inline functions' bodies gone."""
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.DOTALL)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    out, depth = [], 0
    for ch in text:  # a body `{...}` ends its statement (and is dropped)
        depth += ch == "{"
        if depth == 0:
            out.append(ch)
        elif ch == "}" and depth == 1:
            out.append(";")
        depth -= ch == "}"
    return [" ".join(s.split()) for s in "".join(out).split(";") if s.strip()]


@functools.cache
def signatures() -> dict[str, tuple[object, list]]:
    """Every function csrc/kernels.h declares -> (ctypes result type, argument types): from its function
    types (`typedef int int4_gemm_fn(...)` and `int4_gemm_fn int4_gemm, ...;`) and plain prototypes."""
    types: dict[str, tuple[object, list]] = {}
    functions: dict[str, tuple[object, list]] = {}
    for statement in _statements((CSRC / "kernels.h").read_text()):
        if statement.startswith("static "):
            continue  # an inline helper the kernels share
        if match := _FUNCTION.fullmatch(statement):
            typedef, result, name, params = match.groups()
            args = [] if params.strip() in ("", "void") else [_c_type(p) for p in params.split(",")]
            (types if typedef else functions)[name] = (_C_TYPES[result], args)
        elif (match := _INSTANCES.fullmatch(statement)) and match.group(1) in types:
            for name in match.group(2).split(","):
                functions[name.strip()] = types[match.group(1)]
    return functions


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give `lib`'s functions their kernels.h types (the ones it exports; ctypes keeps each on the library)."""
    for name, (result, args) in signatures().items():
        try:
            fn = getattr(lib, name)
        except AttributeError:  # declared for another library
            continue
        fn.restype, fn.argtypes = result, args
    return lib


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


@dataclass(frozen=True)
class CPU:
    """The machine as the forward plan (model/plan.py) sees it: its flags, and whether the C kernels may be
    built here. A test passes a CPU without some flags to read the plan's reasons."""

    flags: frozenset[str]
    c_kernels: bool = True  # TOKENLOOM_C_KERNELS=0: torch's ops everywhere

    @classmethod
    def here(cls) -> CPU:
        return cls(frozenset(cpu_flags()), os.environ.get("TOKENLOOM_C_KERNELS", "1") != "0")

    def library(self, spec: KernelSpec) -> tuple[ctypes.CDLL | None, str | None]:
        """(`spec`'s library, built and checked, None), or (None, why it cannot run here)."""
        if not self.c_kernels:
            return None, "the C kernels are off (TOKENLOOM_C_KERNELS=0)"
        missing = spec.cpu_flags - self.flags
        if missing:
            return None, f"this CPU lacks {' '.join(sorted(missing))}"
        lib = load(spec)
        return (lib, None) if lib is not None else (None, f"csrc/{spec.name}.c did not build or pass its check")


def cache_root() -> Path:
    """tokenloom's cache: `$TOKENLOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenloom`, else ~/.cache/tokenloom."""
    return Path(os.environ.get("TOKENLOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenloom"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


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
    check = b"".join(f.read_bytes() for f in [CHECKS / f"{spec.check}.c", *sorted(CHECKS.glob("*.h"))])
    # Everything that decides the library and whether it passed: source, flags, CPU, compiler, the check.
    identity = [source.read_bytes(), headers, " ".join(cflags).encode(), " ".join(flags).encode(),
                _compiler_version(cc).encode(), check, " ".join(spec.check_flags).encode()]
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
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                program = Path(tmp) / f"check_{spec.name}"
                subprocess.run(spec.check_command(cc, program), check=True, capture_output=True, text=True,
                               timeout=120)
                subprocess.run([str(program), str(lib_path)], check=True, capture_output=True, text=True, timeout=60)
            checked.touch()
        return declare(ctypes.CDLL(str(lib_path)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        logger.warning("%s kernel unavailable (%s %s); the next choice is taken", spec.name, exc, detail[-300:])
        return None
