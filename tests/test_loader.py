"""Model loading: GGUF files written here with each supported tensor type, the Q/K un-permutation,
a Hugging Face safetensors directory, and clear errors for unsupported or broken files."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokenloom.model.decoder import ForwardBatch, ModelConfig
from tokenloom.model.loader import ModelSource, load_model, random_model

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


def hf_state(model) -> dict[str, torch.Tensor]:
    """The random model's weights under Hugging Face Llama names (separate q/k/v, gate/up)."""
    sd, out = model.state_dict(), {}
    q, kv = CFG.num_heads * CFG.dim_per_head, CFG.num_kv_heads * CFG.dim_per_head
    out["model.embed_tokens.weight"] = sd["embed_tokens.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    for i in range(CFG.num_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = sd[p + "self_attn.qkv_proj.weight"].split([q, kv, kv])
        out[hp + "self_attn.q_proj.weight"], out[hp + "self_attn.k_proj.weight"] = wq, wk
        out[hp + "self_attn.v_proj.weight"] = wv
        out[hp + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        gate, up = sd[p + "mlp.gate_up_proj.weight"].chunk(2)
        out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
        out[hp + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
        out[hp + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[hp + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (the loader must undo it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, qtype=gguf.GGMLQuantizationType.F32, arch="llama"):
    hf = {k: v.numpy() for k, v in hf_state(model).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(CFG.num_layers)
    w.add_context_length(CFG.max_position_embeddings)
    w.add_embedding_length(CFG.hidden_size)
    w.add_feed_forward_length(CFG.intermediate_size)
    w.add_head_count(CFG.num_heads)
    w.add_head_count_kv(CFG.num_kv_heads)
    w.add_rope_freq_base(CFG.rope_theta)
    w.add_layer_norm_rms_eps(CFG.rms_norm_eps)

    def add(name, array, quantize=True):
        if quantize and qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(array.astype(np.float32), qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, array.astype(np.float32))

    add("token_embd.weight", hf["model.embed_tokens.weight"])
    add("output_norm.weight", hf["model.norm.weight"], quantize=False)
    for i in range(CFG.num_layers):
        hp, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_q.weight", llama_cpp_permute(hf[hp + "self_attn.q_proj.weight"], CFG.num_heads))
        add(b + "attn_k.weight", llama_cpp_permute(hf[hp + "self_attn.k_proj.weight"], CFG.num_kv_heads))
        add(b + "attn_v.weight", hf[hp + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", hf[hp + "self_attn.o_proj.weight"])
        add(b + "ffn_gate.weight", hf[hp + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", hf[hp + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", hf[hp + "mlp.down_proj.weight"])
        add(b + "attn_norm.weight", hf[hp + "input_layernorm.weight"], quantize=False)
        add(b + "ffn_norm.weight", hf[hp + "post_attention_layernorm.weight"], quantize=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of every position for one sequence in a fresh paged cache of one big block."""
    n = len(tokens)
    cfg = model.config
    dtype = next(model.parameters()).dtype
    shape = (n, cfg.num_kv_heads, cfg.dim_per_head)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
    from tokenloom.model.decoder import PrefillSpan

    batch = ForwardBatch(
        positions=torch.arange(n), slot_mapping=torch.arange(n),
        num_decodes=0,
        decode_like_rows=0,
        decode_block_tables=torch.empty((0, 0), dtype=torch.long),
        decode_context_lens=torch.empty(0, dtype=torch.long),
        block_size=16,
        prefills=[PrefillSpan(0, n, torch.arange(n), None)], logits_indices=torch.arange(n),
    )
    with torch.inference_mode():
        return model(torch.tensor(tokens), batch, caches)[1]


TOKENS = [3, 17, 42, 5, 63, 8, 1, 29]


def test_gguf_f32_round_trip_undoes_the_rope_permutation(tmp_path):
    ref = random_model(CFG, seed=1)
    write_gguf(tmp_path / "m.gguf", ref)
    loaded = load_model(ModelSource("gguf", str(tmp_path / "m.gguf")))
    assert loaded.config.tie_word_embeddings and loaded.config.num_kv_heads == 2
    torch.testing.assert_close(prefill_logits(loaded, TOKENS), prefill_logits(ref, TOKENS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_gguf_quantized_types_dequantize_close_to_the_original(tmp_path, qtype):
    ref = random_model(CFG, seed=2)
    write_gguf(tmp_path / "q.gguf", ref, gguf.GGMLQuantizationType[qtype])
    loaded = load_model(ModelSource("gguf", str(tmp_path / "q.gguf")))
    original = ref.state_dict()["layers.0.mlp.down_proj.weight"]
    got = loaded.state_dict()["layers.0.mlp.down_proj.weight"]
    tolerance = {"Q4_0": 0.03, "Q4_1": 0.02, "Q8_0": 0.002, "F16": 1e-4}[qtype]
    assert (got - original).abs().max() < tolerance


def test_hf_directory_loads_the_same_model(tmp_path):
    ref = random_model(CFG, seed=3)
    save_file(hf_state(ref), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": CFG.vocab_size, "hidden_size": CFG.hidden_size,
        "intermediate_size": CFG.intermediate_size, "num_hidden_layers": CFG.num_layers,
        "num_attention_heads": CFG.num_heads, "num_key_value_heads": CFG.num_kv_heads,
        "max_position_embeddings": CFG.max_position_embeddings, "tie_word_embeddings": True,
    }))
    loaded = load_model(ModelSource.resolve(str(tmp_path)))
    torch.testing.assert_close(prefill_logits(loaded, TOKENS), prefill_logits(ref, TOKENS), rtol=0, atol=0)


def test_bfloat16_load_is_close_to_float32(tmp_path):
    ref = random_model(CFG, seed=4)
    bf = random_model(CFG, seed=4, dtype="bfloat16")
    assert next(bf.parameters()).dtype == torch.bfloat16
    exact, approx = prefill_logits(ref, TOKENS), prefill_logits(bf, TOKENS)
    assert approx.dtype == torch.float32  # logits are always float32 for sampling
    assert (approx - exact).abs().max() < 0.05 * exact.abs().max()


def test_unsupported_architecture_and_bad_files(tmp_path):
    ref = random_model(CFG, seed=5)
    write_gguf(tmp_path / "gpt2.gguf", ref, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(ModelSource("gguf", str(tmp_path / "gpt2.gguf")))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(ModelSource("gguf", str(tmp_path / "junk.gguf")))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported architectures 'bert'"):
        load_model(ModelSource.resolve(str(tmp_path / "hf")))


def test_threads_are_sized_from_the_cgroup_quota(tmp_path, monkeypatch):
    from tokenloom.model import load

    assert load._cgroup_cpu_quota(str(tmp_path)) is None  # no cgroup files: unlimited
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert load._cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert load._cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert load._cgroup_cpu_quota(str(tmp_path)) == 0.5
    monkeypatch.setattr(load.os, "sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    for quota, cores in [(None, 4), (0.5, 1), (1.5, 2), (16.0, 4)]:
        monkeypatch.setattr(load, "_cgroup_cpu_quota", lambda q=quota: q)
        assert load.usable_cores() == cores


# K-quants: bytes per 256 weights, and where their float16 super-block scales sit.
K_QUANT_SCALES = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_stored_rows_read_exactly_what_the_whole_tensor_dequantizes_to(qtype, tmp_path):
    """The embedding and the head's exact rows read from the file: bit-identical to the dense tensor,
    from the array and with `pread` from a file holding it at an offset."""
    from tokenloom.model.gguf_tensors import StoredRows, dequantize

    rng = np.random.default_rng(0)
    values = rng.standard_normal((40, 256)).astype(np.float32)
    if qtype in K_QUANT_SCALES:  # gguf cannot quantize to K-quants: random codes, sane float16 scales
        data = rng.integers(0, 256, (40, K_QUANT_SCALES[qtype][0]), dtype=np.uint8)
        for offset in K_QUANT_SCALES[qtype][1]:
            data[:, offset:offset + 2] = np.full((40, 1), 0.01, np.float16).view(np.uint8)
    else:
        data = values if qtype == "F32" else gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    (tmp_path / "t.bin").write_bytes(b"x" * 96 + np.ascontiguousarray(data).tobytes())
    whole = dequantize(data, qtype, (40, 256))
    idx = torch.tensor([[0, 39, 7, 7, 12], [3, 3, 0, 21, 38]])
    for rows in (StoredRows(data, qtype, (40, 256)), StoredRows(data, qtype, (40, 256), file=(str(tmp_path / "t.bin"), 96))):
        assert torch.equal(rows[idx], whole[idx]) and rows[idx].dtype == torch.float32
        assert rows[torch.tensor([], dtype=torch.long)].shape == (0, 256)
        assert torch.equal(torch.cat(list(rows.chunks(16))), whole)
        with pytest.raises(IndexError):
            rows[torch.tensor([40])]


def test_the_quantized_load_keeps_no_float32_copy_of_the_weights(tmp_path):
    """int4 from a GGUF: the embedding and the head's rescoring rows stay in the file, each projection
    only in its quantized form; the embedding gives the float32 load's rows exactly."""
    from tokenloom.model.gguf_tensors import StoredEmbedding

    write_gguf(tmp_path / "q.gguf", random_model(CFG, seed=4), gguf.GGMLQuantizationType.Q4_1)
    dense = load_model(ModelSource("gguf", str(tmp_path / "q.gguf")))
    quantized = load_model(ModelSource("gguf", str(tmp_path / "q.gguf")), quantization="int4")
    assert isinstance(quantized.embed_tokens, StoredEmbedding) and quantized.lm_head is None
    big = [name for name, t in [*quantized.named_parameters(), *quantized.named_buffers()]
           if t.dtype == torch.float32 and t.numel() >= CFG.hidden_size * CFG.intermediate_size]
    assert big == [], big
    ids = torch.tensor(TOKENS)
    assert torch.equal(quantized.embed(ids), dense.embed(ids))
    assert torch.equal(quantized.logits_proj.weight[ids], dense.embed_tokens.weight[ids])
    assert "from the file's Q4_1 rows" in quantized.plan.line()
    got, want = prefill_logits(quantized, TOKENS), prefill_logits(dense, TOKENS)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gguf_file_reads_what_ggufs_own_reader_reads(tmp_path):
    """model/gguf_file.py against gguf.GGUFReader on every metadata value type, arrays of each, a custom
    alignment and plain and block tensor types; then cut files and bad headers refused, saying why."""
    from tokenloom.model.gguf_file import GGUFFile

    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    T = gguf.GGUFValueType
    for name, value, kind in [("u8", 7, T.UINT8), ("i8", -7, T.INT8), ("u16", 700, T.UINT16), ("i16", -700, T.INT16),
                              ("u32", 70000, T.UINT32), ("i32", -70000, T.INT32), ("u64", 2**40, T.UINT64),
                              ("i64", -(2**40), T.INT64), ("f32", 0.5, T.FLOAT32), ("f64", 1e-300, T.FLOAT64),
                              ("bool", True, T.BOOL), ("str", "héllo ✓", T.STRING)]:
        w.add_key_value(f"t.{name}", value, kind)
    w.add_array("t.strings", ["a", "", "Ġthe", "<|im_end|>", "✓" * 40])
    w.add_array("t.ints", list(range(-5, 1000)))
    w.add_array("t.floats", [0.25, -1.5, 3e30])
    w.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 5, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blocks", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    assert {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")} == {
        k: f.contents() for k, f in ours.fields.items()}
    assert [t.name for t in ours.tensors] == ["plain", "half", "blocks"]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, tuple(int(d) for d in b.shape), b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)

    data = path.read_bytes()
    inside_strings = data.index("Ġthe".encode()) + 2  # in an array of strings, mid-string and at a length
    for cut in (3, 30, inside_strings, inside_strings + 4, len(data) // 3, len(data) - 1):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated"):
            GGUFFile(str(tmp_path / "cut.gguf"))
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 9"):
        GGUFFile(str(tmp_path / "v9.gguf"))
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="no GGUF magic"):
        GGUFFile(str(tmp_path / "magic.gguf"))
