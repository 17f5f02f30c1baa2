"""The forward plan decides (model/plan.py): each strategy that cannot serve a model's shapes or dtypes, or
this CPU, leaves its reason in the plan and its start-up line, and the implementation the plan hands the
model is the one the line names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenloom.config import EngineConfig
from tokenloom.model import kernels, layer_ops, paged_attention
from tokenloom.model.config import FULL, SLIDING, ModelConfig
from tokenloom.model.kernels import CPU
from tokenloom.model.plan import (
    EXACT_PATH,
    Choice,
    ForwardNeeds,
    first_that_runs,
    kv_cache_dtype_for,
    plan_forward,
)
from tokenloom.model.quant import probe

HERE = CPU.here()
AVX2_ONLY = CPU(HERE.flags - {f for f in HERE.flags if f.startswith(("avx512", "amx"))})
NO_SIMD = CPU(frozenset())
needs_avx2_lib = pytest.mark.skipif(kernels.load(paged_attention.SPEC) is None or kernels.load(layer_ops.SPEC) is None,
                                    reason="the AVX2 C kernels do not build or run here (logged)")
needs_avx512_lib = pytest.mark.skipif(kernels.load(paged_attention.SPEC_AVX512) is None,
                                      reason="no AVX-512 attention kernel here")
# head_dim 64, two query heads per KV head: what every paged kernel takes.
CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                     num_kv_heads=1, max_position_embeddings=256)


def needs(**changes) -> ForwardNeeds:
    return dataclasses.replace(ForwardNeeds.of(CONFIG, torch.float32, torch.float16), **changes)


def attention(cpu: CPU = HERE, **changes) -> Choice:
    return first_that_runs(paged_attention.STRATEGIES, needs(**changes), cpu)


def reasons(choice: Choice) -> dict[str, str]:
    return dict(choice.refused)


def test_the_built_implementation_is_the_one_named():
    for choice in (attention(), attention(NO_SIMD), attention(head_dim=96), attention(exact=EXACT_PATH),
                   first_that_runs(layer_ops.STRATEGIES, needs(), HERE),
                   first_that_runs(layer_ops.STRATEGIES, needs(dtype=torch.bfloat16), HERE)):
        assert choice.impl.name == choice.name, choice


@needs_avx512_lib
def test_paged_avx512_refuses_other_head_dims_wide_groups_and_cpus_without_avx512():
    assert attention().name == "paged-c-avx512"
    for shape in ({"head_dim": 128}, {"head_dim": 256}, {"num_heads": 8}, {"num_heads": 16, "num_kv_heads": 2},
                  {"num_heads": 12, "num_kv_heads": 2, "head_dim": 128}, {"num_heads": 7, "head_dim": 128}):
        assert attention(**shape).name == "paged-c-avx512", shape  # Qwen3's, Qwen2.5's and Llama's shapes among them
    choice = attention(head_dim=96)
    assert choice.name == "paged-c"
    assert reasons(choice) == {"paged-c-avx512": "head_dim 96 (it takes a multiple of 64 up to 256)"}
    choice = attention(head_dim=32)
    assert reasons(choice) == {"paged-c-avx512": "head_dim 32 (it takes a multiple of 64 up to 256)"}
    choice = attention(num_heads=16)
    assert choice.name == "paged-c"
    assert reasons(choice) == {"paged-c-avx512": "16 query heads per KV head (it takes up to 8)"}
    choice = attention(AVX2_ONLY)
    assert choice.name == "paged-c" and reasons(choice) == {"paged-c-avx512": "this CPU lacks avx512f"}
    choice = attention(AVX2_ONLY, head_dim=128)  # an AVX2-only CPU: the shape it would take, refused for the CPU
    assert choice.name == "paged-c" and reasons(choice) == {"paged-c-avx512": "this CPU lacks avx512f"}
    line = f"attention {attention(head_dim=96)}"
    assert "attention paged-c (not paged-c-avx512: head_dim 96 (it takes a multiple of 64 up to 256))" in line, line


@needs_avx2_lib
def test_paged_refuses_shapes_dtypes_and_cpus_it_cannot_serve():
    cases = {"head_dim 48 (it takes a multiple of 32 up to 256)": attention(head_dim=48),
             "head_dim 512 (it takes a multiple of 32 up to 256)": attention(head_dim=512),
             "bfloat16 queries (it takes float32)": attention(dtype=torch.bfloat16),
             "a bfloat16 KV cache (it reads float32, float16 or int8)": attention(kv_dtype=torch.bfloat16),
             "3 query heads over 2 KV heads (it takes whole groups)": attention(num_heads=3, num_kv_heads=2),
             "this CPU lacks avx2 f16c fma": attention(NO_SIMD),
             "the C kernels are off (TOKENLOOM_C_KERNELS=0)": attention(dataclasses.replace(HERE, c_kernels=False)),
             EXACT_PATH: attention(exact=EXACT_PATH)}
    for reason, choice in cases.items():
        assert choice.name == "torch" and reasons(choice)["paged-c"] == reason, (reason, choice)
    assert isinstance(attention(head_dim=48).impl, paged_attention.TorchDecodeAttention)
    # Strategies refused for one reason share it in the line.
    assert str(attention(exact=EXACT_PATH)) == f"torch (not paged-c-avx512, paged-c: {EXACT_PATH})"


def test_torch_attention_and_layer_ops_serve_anything():
    for strategies in (paged_attention.STRATEGIES, layer_ops.STRATEGIES):
        assert strategies[-1].can_implement(needs(dtype=torch.bfloat16, head_dim=48, exact=EXACT_PATH), NO_SIMD) == (
            True, None)


@needs_avx2_lib
def test_c_layer_ops_refuse_other_residual_dtypes_cpus_without_avx2_and_the_exact_path():
    def ops(cpu: CPU = HERE, **changes) -> Choice:
        return first_that_runs(layer_ops.STRATEGIES, needs(**changes), cpu)

    assert ops().name == "c" and isinstance(ops().impl, layer_ops.CLayerOps)
    for reason, choice in {"a bfloat16 residual stream (the C ops take float32)": ops(dtype=torch.bfloat16),
                           "a bfloat16 KV cache (their KV write takes float32, float16 or int8)": ops(kv_dtype=torch.bfloat16),
                           "this CPU lacks avx2 f16c fma": ops(NO_SIMD), EXACT_PATH: ops(exact=EXACT_PATH)}.items():
        assert choice.name == "torch" and reasons(choice) == {"c": reason}, (reason, choice)
        assert choice.impl is layer_ops.TORCH_OPS


def test_the_kv_cache_dtype_has_one_rule():
    assert kv_cache_dtype_for("int4", "float32") == "float16"
    assert kv_cache_dtype_for("none", "bfloat16") == "bfloat16"
    assert kv_cache_dtype_for("int8", "float32", "float32") == "float32"


def test_plan_forward_decides_before_the_model_is_built_and_says_why_in_its_line():
    exact = plan_forward(EngineConfig(), CONFIG, HERE)
    assert (exact.quantization, exact.residual, exact.kv_cache) == ("none", "float32", "float32")
    assert exact.attention.name == exact.layer_ops.name == "torch"
    assert f"layer ops torch (not c: {EXACT_PATH})" in exact.line()
    fast = plan_forward(EngineConfig(quantization="int8"), CONFIG, NO_SIMD)
    if fast.quantization == "none":
        pytest.skip("int8 does not run here")
    assert fast.kv_cache == "float16"
    line = fast.line()
    assert "attention torch (not paged-c-avx512, paged-c: this CPU lacks avx2 f16c fma)" in line, line
    assert "layer ops torch (not c: this CPU lacks avx2 f16c fma)" in line, line


def projections(cpu: CPU = HERE, **changes) -> Choice:
    return first_that_runs(probe.STRATEGIES, needs(**changes), cpu)


def test_projection_kernels_refuse_cpus_without_their_flags_and_the_exact_path():
    avx2 = projections(AVX2_ONLY)
    if probe.gemm.quant_gemm_avx2() is not None:
        assert avx2.name == "c-avx2" and avx2.impl is probe.gemm.quant_gemm_avx2()
        assert reasons(avx2)["c-avx512"].startswith("this CPU lacks avx512"), avx2
    none = projections(NO_SIMD)
    assert none.name == "torch" and none.impl is None
    assert reasons(none) == {"c-avx512": "this CPU lacks avx2 avx512_bf16 avx512_vnni avx512bw avx512f avx512vl f16c fma",
                             "c-avx2": "this CPU lacks avx2 f16c fma"}
    assert reasons(projections(exact=EXACT_PATH)) == {"c-avx512": EXACT_PATH, "c-avx2": EXACT_PATH}


@needs_avx2_lib
def test_a_load_on_an_avx2_cpu_runs_and_names_the_avx2_kernels(monkeypatch):
    """TOKENLOOM_MAX_ISA=avx2 hides AVX-512 from the plan: each choice falls back, says why in the line,
    and the model runs what the line names."""
    from tokenloom.model.loader import ModelSource, bundled_model_path, load_model
    from tokenloom.model.quant.modules import Int4Linear, Int8Linear

    if probe.gemm.quant_gemm_avx2() is None:
        pytest.skip("no AVX2 int4 kernels here")
    monkeypatch.setenv("TOKENLOOM_MAX_ISA", "avx2")
    model = load_model(ModelSource.resolve(bundled_model_path()), quantization="int4")
    line = model.plan.line()
    assert "weights int4 (c-avx2 kernels; not c-avx512: this CPU lacks avx512" in line, line
    assert "attention paged-c (not paged-c-avx512: this CPU lacks avx512f); layer ops c;" in line, line
    assert "decoder loop c" in line and model.decoder_loop is not None, line
    assert model.decode_attention.name == "paged-c" and model.layer_ops.name == "c"
    assert all(m.kernel is probe.gemm.quant_gemm_avx2() for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)))


def test_a_projection_the_kernels_cannot_take_gets_torch_s_op_and_the_line_says_why():
    from collections import Counter

    from tokenloom.model.loader import quantize_model, random_model
    from tokenloom.model.plan import resolve_plan
    from tokenloom.model.quant.layouts import q4_1_from_dense
    from tokenloom.model.quant.modules import Int4Linear, Int8Linear

    kernel = probe.gemm.quant_gemm()
    if kernel is None or not probe.torch_quant_ops()["int8_bf16"]:
        pytest.skip("needs the C kernels and torch's int8 op here")
    config = dataclasses.replace(CONFIG, num_heads=3, num_kv_heads=1, head_dim=40)  # QKV 200 outputs, o 120 inputs
    with pytest.raises(ValueError, match="200 outputs, not a multiple of 16"):
        Int4Linear(q4_1_from_dense(torch.randn(200, 128)), torch.bfloat16, kernel=kernel)
    with pytest.raises(ValueError, match="200 outputs, not a multiple of 16"):
        Int8Linear(torch.randn(200, 128), torch.bfloat16, kernel=kernel)
    model = quantize_model(random_model(config), "int8", kernel=kernel)  # torch's int4 op cannot take it either
    assert model.layers[0].self_attn.qkv_proj.kernel is None and model.layers[0].mlp.down_proj.kernel is kernel
    planned = plan_forward(EngineConfig(quantization="int8"), config, HERE)
    line = resolve_plan(model, Counter(), planned).line()
    # (between the two, on a CPU without AVX-512, the reason the AVX-512 kernels were not chosen)
    assert f"weights int8 ({kernel.name}, torch kernels; " in line, line
    assert ("torch for qkv: 200 outputs, not a multiple of 16; torch for o: 120 inputs, not a multiple of 32) "
            "(from random weights)") in line, line
    # ... decided by the plan from the shapes alone, which also keeps the decoder loop off for it.
    assert planned.on_torch == (("qkv", "200 outputs, not a multiple of 16"), ("o", "120 inputs, not a multiple of 32"))
    if planned.layer_ops.name == "c" and planned.attention.name.startswith("paged-c"):
        assert "decoder loop off (not c: qkv runs torch's op (200 outputs, not a multiple of 16))" in line, line


def test_a_load_with_the_c_kernels_off_runs_torch_s_ops_and_says_so(monkeypatch):
    """TOKENLOOM_C_KERNELS=0: every C strategy refuses with that reason, in the line, and the model holds
    torch's implementations (the weights' format was chosen before, by what runs here)."""
    from tokenloom.model.loader import ModelSource, bundled_model_path, load_model
    from tokenloom.model.quant.modules import Int4Linear, Int8Linear

    if not probe.torch_quant_ops()["int8_bf16"]:
        pytest.skip("torch's int8 op does not run here")
    monkeypatch.setenv("TOKENLOOM_C_KERNELS", "0")
    model = load_model(ModelSource.resolve(bundled_model_path()), quantization="int8")
    off = "the C kernels are off (TOKENLOOM_C_KERNELS=0)"
    line = model.plan.line()
    assert f"weights int8 (torch kernels; not c-avx512, c-avx2: {off})" in line, line
    assert f"attention torch (not paged-c-avx512, paged-c: {off}); layer ops torch (not c: {off})" in line, line
    assert "decoder loop off (not c: the layer ops are torch's)" in line and model.decoder_loop is None, line
    assert model.layer_ops is layer_ops.TORCH_OPS and model.decode_attention.name == "torch"
    assert all(m.kernel is None for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)))


def after(cpu: CPU = HERE, quantization: str = "int4", config: ModelConfig = CONFIG, **changes) -> ForwardNeeds:
    """The needs of the choices made after attention, layer ops and projections (the head, the loop)."""
    base = dataclasses.replace(ForwardNeeds.of(config, torch.float32, torch.float16, quantization=quantization), **changes)
    before = {"attention": first_that_runs(paged_attention.STRATEGIES, base, cpu),
              "layer_ops": first_that_runs(layer_ops.STRATEGIES, base, cpu),
              "projections": first_that_runs(probe.STRATEGIES, base, cpu)}
    return dataclasses.replace(base, before=before)


def test_the_lm_head_is_int4_rescored_where_its_scan_runs_and_says_why_not_elsewhere():
    from tokenloom.model.quant import head

    def choose(cpu: CPU = HERE, **changes) -> Choice:
        return first_that_runs(head.STRATEGIES, after(cpu, **changes), cpu)

    exact = choose(exact=EXACT_PATH, quantization="none")
    assert exact.name == head.DENSE and reasons(exact) == {head.INT4_RESCORED: EXACT_PATH, head.INT8_RESCORED: EXACT_PATH}
    assert str(choose(quantization="int8")) == "dense (not int4 rescored, int8 rescored: int8 weights keep the dense head)"
    no_kernels = choose(NO_SIMD)
    assert no_kernels.name == head.INT8_RESCORED
    assert reasons(no_kernels) == {head.INT4_RESCORED: "its scan runs on the C kernels, and they do not run here"}
    if probe.gemm.quant_gemm() is not None:
        assert choose().name == head.INT4_RESCORED and not choose().refused
        odd = choose(config=dataclasses.replace(CONFIG, vocab_size=500))
        assert odd.name == head.INT8_RESCORED
        assert reasons(odd) == {head.INT4_RESCORED: "the head's 500 outputs, not a multiple of 16"}


def test_the_decoder_loop_runs_over_the_c_choices_and_says_why_not_otherwise(monkeypatch):
    from tokenloom.model import decoder_loop

    def loop(cpu: CPU = HERE, **changes) -> Choice:
        return first_that_runs(decoder_loop.STRATEGIES, after(cpu, **changes), cpu)

    def why(choice: Choice) -> str:
        assert choice.name == decoder_loop.OFF and choice.impl is None, choice
        return reasons(choice)[decoder_loop.LOOP]

    assert why(loop(exact=EXACT_PATH, quantization="none")) == EXACT_PATH
    # Gemma 3's layers are not the loop's (its QK-norm alone would be: Qwen3's below).
    gemma3 = dataclasses.replace(CONFIG, architecture="gemma3", qk_norm=True, hidden_act="gelu_tanh",
                                 sandwich_norms=True, sliding_window=8, layer_types=(SLIDING, FULL))
    assert why(loop(config=gemma3)) == ("gemma3 layers (GeGLU, sandwich norms, sliding windows) are not the "
                                        "shape it was written and checked for")
    qwen3 = dataclasses.replace(CONFIG, qk_norm=True, architecture="qwen3")
    assert why(loop(NO_SIMD)) == why(loop(NO_SIMD, config=qwen3)) == "the layer ops are torch's"
    if kernels.load(decoder_loop.SPEC) is None or probe.gemm.quant_gemm() is None:
        pytest.skip("the decoder loop's library or the C projections do not run here")
    assert loop().name == decoder_loop.LOOP and callable(loop().impl)
    assert loop(config=qwen3).name == decoder_loop.LOOP  # QK-norm runs in the loop
    assert why(loop(dtype=torch.bfloat16)) == "the layer ops are torch's"  # the C ops take float32 alone
    wide = dataclasses.replace(CONFIG, intermediate_size=200)
    assert why(loop(config=wide)) == "down runs torch's op (200 inputs, not a multiple of 32)"
    load = kernels.load
    monkeypatch.setattr(kernels, "load", lambda spec: None if spec is decoder_loop.SPEC else load(spec))
    assert why(loop()) == "its C library did not build or check"


def test_a_loop_over_a_model_that_is_not_what_the_plan_said_is_an_error():
    from tokenloom.model import decoder_loop
    from tokenloom.model.loader import random_model

    lib = kernels.load(decoder_loop.SPEC)
    if lib is None:
        pytest.skip("the decoder loop's library does not build here")
    with pytest.raises(ValueError, match="not what the plan built it for: the layer ops are torch's"):
        decoder_loop.DecoderLoop(lib, random_model(CONFIG))  # dense weights on torch's ops


def test_an_int4_load_without_the_c_kernels_rescores_the_head_in_int8_and_says_so(monkeypatch):
    from tokenloom.model.loader import ModelSource, bundled_model_path, load_model
    from tokenloom.model.quant import head
    from tokenloom.model.quant.modules import Int8Linear

    monkeypatch.setenv("TOKENLOOM_C_KERNELS", "0")
    model = load_model(ModelSource.resolve(bundled_model_path()), quantization="int4")
    if model.plan.quantization != "int4":
        pytest.skip("int4 does not run here without the C kernels")
    line = model.plan.line()
    assert ("LM head int8 rescored (not int4 rescored: its scan runs on the C kernels, and they do not run here), "
            "top 16 in float32") in line, line
    assert isinstance(model.logits_proj, head.RescoredHead) and isinstance(model.logits_proj.approx, Int8Linear)
