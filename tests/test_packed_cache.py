"""The packed-weight disk cache (model/packed_cache.py): a second load of a file on the same plan maps
what the first one packed, bit for bit the same model; a damaged entry is found and rebuilt; another
file, plan or code is another key; the cache keeps to its bound; off is off."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from tokenloom.model import packed_cache
from tokenloom.model.loader import ModelSource, bundled_model_path, load_model

FROM_CACHE = "packed: from the disk cache"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "packed"
    monkeypatch.setenv(packed_cache.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A copy of the bundled GGUF this module may touch (its mtime, its bytes)."""
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    shutil.copyfile(bundled_model_path(), path)
    return str(path)


def buffers(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.named_buffers() if not k.startswith(("ropes", "rope"))}


def greedy(model, steps: int = 12) -> list[int]:
    """Greedy tokens through the engine, the model's own plan (decoder loop, head scan) in use."""
    from tokenloom import EngineConfig
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.tokenizer import load_tokenizer
    from tokenloom.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(max_model_len=256, num_kv_blocks=64), model=model,
                       tokenizer=load_tokenizer(bundled_model_path()))
    engine.add_request("a", "The capital of France is", SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done[0].outputs[0].token_ids


def test_a_second_load_maps_what_the_first_packed(cache, gguf):
    cold = load_model(ModelSource.resolve(gguf), quantization="int4")
    if cold.plan.quantization != "int4":
        pytest.skip("the int4 path does not run here")
    assert FROM_CACHE not in cold.plan.line() and len(list(cache.glob("*.safetensors"))) == 1
    warm = load_model(ModelSource.resolve(gguf), quantization="int4")
    assert FROM_CACHE in warm.plan.line(), warm.plan.line()
    a, b = buffers(cold), buffers(warm)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [type(m).__name__ for m in cold.modules()] == [type(m).__name__ for m in warm.modules()]
    assert (warm.decoder_loop is None) == (cold.decoder_loop is None)
    assert warm.plan.line().replace("; " + FROM_CACHE, "") == cold.plan.line()
    assert greedy(warm) == greedy(cold)


def test_an_entry_checked_once_is_mapped_again_unread(cache, gguf, monkeypatch):
    load_model(ModelSource.resolve(gguf), quantization="int4")
    checks = []
    crc = packed_cache._crc
    monkeypatch.setattr(packed_cache, "_crc", lambda *a: checks.append(1) or crc(*a))
    for _ in range(3):
        assert FROM_CACHE in load_model(ModelSource.resolve(gguf), quantization="int4").plan.line()
    assert checks == [1]  # the first of the three read it all; the others found it as it was then


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_entry_is_found_and_rebuilt(cache, gguf, damage, caplog):
    load_model(ModelSource.resolve(gguf), quantization="int4")
    # Mapped once (its CRC checked, so this process maps it again unread while it stays as it was), then
    # written over: the next load checks it again.
    assert FROM_CACHE in load_model(ModelSource.resolve(gguf), quantization="int4").plan.line()
    (entry,) = cache.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[len(data) * 2 // 3] ^= 0x40  # one bit inside a tensor
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = b"not a safetensors file"
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="tokenloom.load"):
        again = load_model(ModelSource.resolve(gguf), quantization="int4")
    assert FROM_CACHE not in again.plan.line() and "damaged" in caplog.text
    assert entry.exists() and entry.read_bytes() != bytes(data)  # written anew by the load that packed
    assert FROM_CACHE in load_model(ModelSource.resolve(gguf), quantization="int4").plan.line()


def test_another_file_plan_or_code_is_another_key(cache, gguf, monkeypatch):
    from tokenloom.config import EngineConfig
    from tokenloom.model.loader import _read_gguf
    from tokenloom.model.plan import plan_forward

    config = _read_gguf(gguf)[0]
    plan = plan_forward(EngineConfig(quantization="int4"), config)
    key = packed_cache.cache_key(gguf, plan)
    stat = os.stat(gguf)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file rewritten (as far as anyone knows)
    assert packed_cache.cache_key(gguf, plan) != key
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert packed_cache.cache_key(gguf, plan) == key
    monkeypatch.setenv("TOKENLOOM_MAX_ISA", "avx2")
    other = plan_forward(EngineConfig(quantization="int4"), config)
    if other.projections.name != plan.projections.name:
        assert packed_cache.cache_key(gguf, other) != key
    monkeypatch.setattr(packed_cache, "code_digest", lambda: "another tree")
    assert packed_cache.cache_key(gguf, plan) != key


def test_the_cache_keeps_to_its_bound_and_off_is_off(cache, gguf, monkeypatch):
    cache.mkdir(parents=True)
    old = cache / "old.safetensors"
    old.write_bytes(b"x" * 1000)
    os.utime(old, (1, 1))  # least recently used
    monkeypatch.setenv(packed_cache.BYTES_ENV, "1")  # room for the newest entry alone
    load_model(ModelSource.resolve(gguf), quantization="int4")
    assert not old.exists() and len(list(cache.glob("*.safetensors"))) == 1
    monkeypatch.setenv(packed_cache.CACHE_ENV, "off")
    shutil.rmtree(cache)
    assert FROM_CACHE not in load_model(ModelSource.resolve(gguf), quantization="int4").plan.line()
    assert not cache.exists()


def test_the_torch_int4_path_is_cached_too_and_a_failed_write_only_logs(cache, gguf, monkeypatch, caplog):
    """TOKENLOOM_C_KERNELS=0: the int4 modules hold torch's packed layout (their `packed` buffer), cached
    and restored as well; a cache that cannot be written leaves the load as it was, with a warning."""
    monkeypatch.setenv("TOKENLOOM_C_KERNELS", "0")
    cold = load_model(ModelSource.resolve(gguf), quantization="int4")
    if cold.plan.quantization != "int4":
        pytest.skip("torch's int4 op does not run here")
    warm = load_model(ModelSource.resolve(gguf), quantization="int4")
    assert FROM_CACHE in warm.plan.line()
    a, b = buffers(cold), buffers(warm)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.setenv(packed_cache.CACHE_ENV, "/proc/no-such-dir")  # not writable
    with caplog.at_level(logging.WARNING, logger="tokenloom.load"):
        model = load_model(ModelSource.resolve(gguf), quantization="int4")
    assert "packed weights not cached" in caplog.text and FROM_CACHE not in model.plan.line()
