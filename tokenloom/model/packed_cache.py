"""Packed weights on disk: a model loaded once before comes back without packing its weights again.

Packing is most of a fast-path load (the GGUF's blocks laid out for the C kernels, wider formats
quantized to int8, the LM head's int4 scan made from its float32 rows), and the result depends only on
the file, the plan and this code. So after a load packs them, `store` writes every projection's and
the head scan's tensors, with what rebuilds each module (`SplitRowsLinear.packed_state`), into one
safetensors file; a later load with the same key maps it (`load`: the tensors are views of the file's
pages, read as the kernels touch them) and builds the modules from it (`restore`).

The key: the GGUF file's identity and content sample (size, mtime, inode and device, the sha256 of
catalog.sample_sha256's blocks: a file replaced or rewritten is another key), the plan's choices
(weight format, kernels, LM head, the projections on torch's ops), and a digest of this package's
source (model/*.py and csrc/: a change to how anything is packed is another key; nothing to bump by
hand). An entry whose file does not parse, whose manifest does not match or whose tensors' CRC-32 do
not is deleted and rebuilt by the load. The cache holds at most `TOKENLOOM_PACKED_CACHE_BYTES`
(default 16 GiB): the least recently used entries go first. Where: `$TOKENLOOM_PACKED_CACHE`, else
`$TOKENLOOM_CACHE_DIR/packed`, else `~/.cache/tokenloom/packed`; `TOKENLOOM_PACKED_CACHE=off` disables it.
Only the served default's path is cached (GGUF, int4 family, float32 residual): it is the one that packs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import zlib
from pathlib import Path

import torch

from . import kernels
from .quant.gemm import kernel_for_shape
from .quant.head import RescoredHead
from .quant.modules import Int4Linear, Int8Linear, SplitRowsLinear

logger = logging.getLogger("tokenloom.load")

CACHE_ENV, BYTES_ENV = "TOKENLOOM_PACKED_CACHE", "TOKENLOOM_PACKED_CACHE_BYTES"
DEFAULT_BYTES = 16 << 30
FORMAT = 1
HEAD = "logits_proj.approx"  # the rescored head's scan, beside the projections' names
_CLASSES = {"Int4Linear": Int4Linear, "Int8Linear": Int8Linear}


def cache_dir() -> Path | None:
    asked = os.environ.get(CACHE_ENV)
    if asked and asked.lower() in ("off", "0", "none"):
        return None
    return Path(asked) if asked else kernels.cache_root() / "packed"


@functools.cache
def code_digest() -> str:
    """sha256 over this package's Python and C sources: what decides how weights are packed."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.c"), *root.rglob("*.h")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(path: str, plan) -> str:
    from .catalog import sample_sha256

    st = os.stat(path)
    what = {"format": FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "device": st.st_dev, "sample": sample_sha256(Path(path)), "code": code_digest(),
            "torch": torch.__version__,  # the torch int4 path's packed layout is torch's own
            "plan": [plan.quantization, plan.residual, plan.projections.name, plan.lm_head.name,
                     [list(x) for x in plan.on_torch]]}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _modules(model) -> dict[str, SplitRowsLinear]:
    found = {name: m for name, m in model.named_modules() if isinstance(m, SplitRowsLinear)
             and not name.startswith("logits_proj")}
    if isinstance(model.logits_proj, RescoredHead):
        found[HEAD] = model.logits_proj.approx
    return found


def _crc(tensors: dict[str, torch.Tensor], manifest: str) -> int:
    """CRC-32 over the manifest's text and every tensor's bytes, in name order."""
    crc = zlib.crc32(manifest.encode())
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().data, crc)
    return crc


def store(model, path: str, plan) -> Path | None:
    """Write `model`'s packed tensors under the key of (`path`, `plan`); None if the cache is off or the
    write fails (logged: the model is loaded either way)."""
    root = cache_dir()
    if root is None:
        return None
    from safetensors.torch import save_file

    target, tmp = root / f"{cache_key(path, plan)}.safetensors", None
    try:
        tensors: dict[str, torch.Tensor] = {}
        manifest: dict[str, dict] = {}
        for name, module in _modules(model).items():
            attrs, own = module.packed_state()
            manifest[name] = attrs
            tensors.update({f"{name}/{key}": t for key, t in own.items()})
        if isinstance(model.logits_proj, RescoredHead):
            manifest["logits_proj"] = {"top": model.logits_proj.top}
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".partial")
        os.close(fd)
        text = json.dumps(manifest)
        save_file(tensors, tmp, metadata={"manifest": text, "crc32": str(_crc(tensors, text)),
                                          "source": os.path.basename(path)})
        os.replace(tmp, target)
    except Exception as exc:  # noqa: BLE001 - a full disk (SafetensorError), a module it cannot describe: the load stands
        logger.warning("packed weights not cached (%s: %s); the model is loaded all the same", type(exc).__name__, exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return None
    _evict(root, keep=target)
    return target


def load(path: str, plan) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(manifest, tensors mapped from the file) for (`path`, `plan`), or None: not cached, the cache is
    off, or the entry is damaged (then deleted, so this load rebuilds it)."""
    root = cache_dir()
    if root is None:
        return None
    entry = root / f"{cache_key(path, plan)}.safetensors"
    if not entry.exists():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(entry), framework="pt") as f:
            meta = f.metadata() or {}
        manifest, crc = json.loads(meta["manifest"]), int(meta["crc32"])
        tensors = load_file(str(entry))
        if not isinstance(manifest, dict) or (_identity(entry) not in _checked
                                              and _crc(tensors, meta["manifest"]) != crc):
            raise ValueError("its tensors' CRC-32 does not match")
    except Exception as exc:  # noqa: BLE001 - a damaged file can fail in the header, the JSON or the tensors
        logger.warning("packed-weight cache entry %s is damaged (%s: %s): rebuilt", entry.name, type(exc).__name__, exc)
        entry.unlink(missing_ok=True)
        return None
    with contextlib.suppress(OSError):  # another process may have evicted it since: its tensors are mapped
        os.utime(entry)  # recently used: evicted last
        _checked.add(_identity(entry))
    return manifest, tensors


# Entries whose CRC held in this process, as they were then: a model swapped out and back (a multi-model
# server) maps its entry again without reading every page of it; an entry written or touched since is
# another identity, checked again.
_checked: set[tuple] = set()


def _identity(entry: Path) -> tuple:
    st = entry.stat()
    return str(entry), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def restore(model, cached: tuple[dict, dict[str, torch.Tensor]], kernel, head_rows) -> bool:
    """Put the cached modules into `model` (its projections still on the meta device), the head's scan
    rescored against `head_rows` (the float32 head: the file's rows or the embedding). False (and the
    model untouched) if the entry does not fit this model: the caller packs instead."""
    manifest, tensors = cached
    wanted = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    names = set(manifest) - {"logits_proj"}
    if names - {HEAD} != wanted:
        logger.warning("packed-weight cache entry does not match the model's projections: packing again")
        return False
    by_module: dict[str, dict] = {name: {} for name in names}
    for key, t in tensors.items():
        name, _, field = key.rpartition("/")
        by_module.setdefault(name, {})[field] = t
    try:
        built = {name: _CLASSES[manifest[name]["class"]].from_packed_state(
            manifest[name], by_module[name],
            kernel_for_shape(kernel, manifest[name]["out_features"], manifest[name]["in_features"]))
            for name in names}
        top = manifest["logits_proj"]["top"] if HEAD in built else None
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("packed-weight cache entry does not fit (%s): packing again", exc)
        return False
    for name, module in built.items():
        if name == HEAD:
            model.logits_proj = RescoredHead(module, head_rows, top=top)
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    return True


def _evict(root: Path, keep: Path) -> None:
    """The least recently used entries deleted until the cache holds at most its bound (`keep` stays)."""
    try:
        bound = int(os.environ.get(BYTES_ENV, DEFAULT_BYTES))
    except ValueError:
        bound = DEFAULT_BYTES
    for partial in root.glob("*.partial"):  # a write cut short (a killed process) an hour ago or more
        with contextlib.suppress(OSError):
            if partial.stat().st_mtime < time.time() - 3600:
                partial.unlink()
    entries = []
    for p in root.glob("*.safetensors"):
        with contextlib.suppress(OSError):
            st = p.stat()
            entries.append((st.st_mtime_ns, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= bound:
            break
        if p != keep:
            p.unlink(missing_ok=True)
            total -= size

