/* decoder_loop.c's structs: the model's kernels and shapes, a layer's weights, a step's LoRA rows.
 * model/decoder_loop.py mirrors them in ctypes (its _Weight, _Layer, _Model, _LoRAWeight, _LoRAStep) and
 * csrc/checks/decoder_loop.c fills them with stand-in kernels. */
#ifndef TOKENLOOM_DECODER_LOOP_H
#define TOKENLOOM_DECODER_LOOP_H

#include <stdint.h>

#include "kernels.h"

typedef struct {  /* a projection: int4/int5 codes, scales and offsets, or int8 codes and scales; a bias or NULL */
    const void *codes, *fifth, *scales, *offsets;  /* fifth: int5's fifth bits */
    const float *bias;
    int64_t kind;  /* 0: int4; 1: int8, a scale per column; 2: int8, a scale per group of 32 and column; 3: int5 */
} Weight;

typedef struct DecoderLayer {  /* one decoder layer's weights and KV cache (model/decoder_loop.py fills these) */
    const float *input_norm, *post_attention_norm;
    const float *q_norm, *k_norm;  /* [head_dim] each: QK-norm (Qwen3), an RMSNorm over every head of Q and
                                    * of K before RoPE; NULL for layers without it (both or neither) */
    Weight qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} Layer;

typedef struct DecoderModel {  /* the kernels (kernels.h) and the shapes, fixed at load */
    int4_gemm_fn *int4_gemm;
    int5_gemm_fn *int5_gemm;
    int8_gemm_fn *int8_gemm, *int8g_gemm;
    rms_norm_fn *rms_norm;
    rope_fn *rope;
    write_kv_fn *write_kv;
    write_kv_q8_fn *write_kv_q8;  /* non-NULL: an int8 cache, written through it (write_kv unused) */
    silu_mul_fn *silu_mul;
    attention_fn *attention;
    lora_add_fn *lora_add;
    int64_t num_layers, hidden, intermediate, heads, kv_heads, head_dim, cache_slots;
    float eps, scale;
} Model;

typedef struct {  /* one projection's LoRA stacks (bfloat16) for the step's set of adapters; a NULL: none */
    const uint16_t *a, *b;
    int64_t rank;
} LoRAWeight;

typedef struct LoRAStep {  /* the rows under adapters in this step (model/lora.py's LoRABatch fills it) */
    const int64_t *slots;      /* [rows]: each row's adapter in the stacks, -1 for none */
    const LoRAWeight *layers;  /* [num_layers * 4]: qkv, o, gate_up, down */
} LoRAStep;

#endif
