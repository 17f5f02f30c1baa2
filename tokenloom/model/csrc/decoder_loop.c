/* Every decoder layer of one step in one call, for steps whose rows all take the C kernels (decode
 * tokens and short prompt chunks, each row a single query), in layers of the Llama / Qwen2 shape and
 * Qwen3's (the same with QK-norm): the same kernels, called in the same order on the same values as
 * model/decoder.py's layers do through ctypes, so the same bits. At one row a step runs ~400 small
 * kernels and the Python between them cost about as much as the kernels did (3.2 of 6.9 ms); here it
 * is one call.
 *
 * No SIMD of its own: the kernels come as function pointers from the libraries the model already
 * loaded (quant_gemm*.c, layer_ops.c, paged_attention*.c), each built for this CPU.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_loop.h"
#include "kernels.h"

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* y [rows, n] = x [rows, k] @ w^T (+ bias, added after the product as model/quant/modules.py adds it; then the
 * rows' LoRA adapters, as model/decoder.py adds them after the projection). `proj`: 0 qkv .. 3 down. */
static int gemm(const Model *m, const Weight *w, const float *x, int64_t rows, int64_t k, int64_t n, float *y,
                const LoRAStep *lora, int64_t layer, int proj) {
    int status = w->kind == 3 ? m->int5_gemm(x, rows, k, w->codes, w->fifth, w->scales, w->offsets, n, y)
                 : w->kind == 2 ? m->int8g_gemm(x, rows, k, w->codes, w->scales, n, y)
                 : w->kind == 1 ? m->int8_gemm(x, rows, k, w->codes, w->scales, n, y)
                                : m->int4_gemm(x, rows, k, w->codes, w->scales, w->offsets, n, y);
    if (status == 0 && w->bias)
        for (int64_t r = 0; r < rows; r++) add_into(y + r * n, w->bias, n);
    if (status == 0 && lora) {
        const LoRAWeight *lw = &lora->layers[4 * layer + proj];
        if (lw->a) status = m->lora_add(x, rows, k, lora->slots, lw->a, lw->b, lw->rank, n, y);
    }
    return status;
}

/* x [rows, hidden] float32: the embeddings in, the last layer's residual stream out. cos, sin [rows,
 * head_dim]; slots [rows] where each row's K/V goes; tables [rows, max_blocks] and context_lens [rows]
 * what each row attends to; `lora` the rows' adapters, or NULL. Returns 0; 1: a slot outside the cache
 * (nothing written by the layer that found it); 2: the scratch buffer could not be allocated, or a gemm
 * or a LoRA product failed; 3: the attention failed. */
int decoder_loop(const Model *m, const Layer *layers, const LoRAStep *lora, float *x, int64_t rows, const float *cos, const float *sin,
                 const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                 int64_t block_size) {
    const int64_t q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t widest = 2 * m->intermediate > qkv_size ? 2 * m->intermediate : qkv_size;
    float *scratch = malloc(sizeof(float) *
                            (size_t)(rows * (m->hidden + widest + 2 * q_size + m->intermediate + 2 * kv_size)));
    if (!scratch) return 2;
    float *normed = scratch;                 /* [rows, hidden]: a norm's output, then a projection's */
    float *wide = normed + rows * m->hidden; /* [rows, qkv or 2 * intermediate] */
    float *q = wide + rows * widest;         /* [rows, q_size]: the queries, contiguous for the attention */
    float *attended = q + rows * q_size;     /* [rows, q_size]; QK-norm: first the queries before their norm */
    float *act = attended + rows * q_size;   /* [rows, intermediate] */
    float *k_raw = act + rows * m->intermediate; /* [rows, kv_size] QK-norm: the keys before their norm, */
    float *k = k_raw + rows * kv_size;           /* then after it (contiguous: one norm call for all heads) */
    int status = 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const Layer *L = &layers[l];
        m->rms_norm(x, L->input_norm, rows, m->hidden, m->eps, normed);
        if (gemm(m, &L->qkv, normed, rows, m->hidden, qkv_size, wide, lora, l, 0)) {
            status = 2;
            break;
        }
        const float *keys = wide + q_size; /* the K the cache gets, `key_stride` floats a row */
        int64_t key_stride = qkv_size;
        if (L->q_norm) {
            /* QK-norm as model/decoder.py's _normed_heads does it: every head of Q (then of K) a row of
             * head_dim for one rms_norm call over all the step's heads, then RoPE on the normed heads. The
             * heads are first copied out (rms_norm takes contiguous rows, and writes elsewhere, as in
             * Python); RoPE on Q and K apart gives the bits of one call over both (it is elementwise). */
            for (int64_t r = 0; r < rows; r++) {
                memcpy(attended + r * q_size, wide + r * qkv_size, sizeof(float) * q_size);
                memcpy(k_raw + r * kv_size, wide + r * qkv_size + q_size, sizeof(float) * kv_size);
            }
            m->rms_norm(attended, L->q_norm, rows * m->heads, m->head_dim, m->eps, q);
            m->rms_norm(k_raw, L->k_norm, rows * m->kv_heads, m->head_dim, m->eps, k);
            m->rope(q, rows, q_size, m->heads, m->head_dim, cos, sin);
            m->rope(k, rows, kv_size, m->kv_heads, m->head_dim, cos, sin);
            keys = k, key_stride = kv_size;
        } else {
            m->rope(wide, rows, qkv_size, m->heads + m->kv_heads, m->head_dim, cos, sin);
        }
        const int wrote = m->write_kv_q8
            ? m->write_kv_q8(keys, key_stride, wide + q_size + kv_size, qkv_size, rows, m->kv_heads,
                             m->head_dim, slots, m->cache_slots, L->k_cache, L->v_cache)
            : m->write_kv(keys, key_stride, wide + q_size + kv_size, qkv_size, rows, kv_size, slots,
                          m->cache_slots, L->k_cache, L->v_cache);
        if (wrote) {
            status = 1;
            break;
        }
        if (!L->q_norm)
            for (int64_t r = 0; r < rows; r++) memcpy(q + r * q_size, wide + r * qkv_size, sizeof(float) * q_size);
        if (m->attention(q, L->k_cache, L->v_cache, tables, max_blocks, context_lens, rows, m->heads, m->kv_heads,
                         m->head_dim, block_size, m->scale, attended)) {
            status = 3;
            break;
        }
        if (gemm(m, &L->o, attended, rows, q_size, m->hidden, normed, lora, l, 1)) {
            status = 2;
            break;
        }
        add_into(x, normed, rows * m->hidden);
        m->rms_norm(x, L->post_attention_norm, rows, m->hidden, m->eps, normed);
        if (gemm(m, &L->gate_up, normed, rows, m->hidden, 2 * m->intermediate, wide, lora, l, 2)) {
            status = 2;
            break;
        }
        m->silu_mul(wide, rows, m->intermediate, act);
        if (gemm(m, &L->down, act, rows, m->intermediate, m->hidden, normed, lora, l, 3)) {
            status = 2;
            break;
        }
        add_into(x, normed, rows * m->hidden);
    }
    free(scratch);
    return status;
}
