/* Every C kernel's interface, in one place: each kernel's source includes this header, so the compiler
 * holds every definition to its declaration; decoder_loop.c calls the kernels through pointers of these
 * very types, and so do the checks (csrc/checks/). model/kernels.py reads the declarations below (the
 * function types and the plain prototypes) for the ctypes types of every loaded library's functions:
 * a signature is written here and nowhere else.
 *
 * Shapes: x [rows, k] float32 row-major; weights for n outputs; y [rows, n]. Return 0 on success; the
 * gemms return 1 when a scratch buffer cannot be allocated, write_kv 1 for a slot outside the cache,
 * the attention -1 (out of memory) or -2 (a shape it does not take). */
#ifndef TOKENLOOM_KERNELS_H
#define TOKENLOOM_KERNELS_H

#include <stdint.h>

/* quant_gemm.c (AVX-512: VNNI, BF16) and quant_gemm_avx2.c (AVX2 + FMA): the same three, each in its own layout. */
typedef int int4_gemm_fn(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *scales,
                         const uint16_t *offsets, int64_t n, float *y);
typedef int int5_gemm_fn(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const uint32_t *fifth_bits,
                         const uint16_t *scales, const uint16_t *offsets, int64_t n, float *y);
typedef int int8_gemm_fn(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scales,
                         int64_t n, float *y);
int4_gemm_fn int4_gemm;   /* Q4-style groups of 32: scale and offset per group and column (float16); offsets
                           * NULL: symmetric codes, the offset -8 scale (int4) or -16 scale (int5) */
int5_gemm_fn int5_gemm;   /* the same with a plane of fifth bits (Q5_0; each layout's own, see its source) */
typedef int int4_top_fn(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *scales,
                        const uint16_t *offsets, int64_t n, int64_t keep, int64_t slots, float *top_values,
                        int32_t *top_ids, uint8_t *unordered);
int4_top_fn int4_top;     /* int4_gemm's outputs never stored: per row its `keep` largest (the LM head's greedy
                           * scan). Each of `slots` threads keeps its own lists of the columns it ran, largest
                           * first: top_values / top_ids [slots][rows][keep], which the caller fills with -inf
                           * and -1 (to merge them); unordered [slots][rows] set where a row met a NaN */
int8_gemm_fn int8_gemm;   /* int8, a float32 scale per column */
int8_gemm_fn int8g_gemm;  /* int8, a float32 scale per group of 32 inputs and column (AVX-512: codes in
                           * quads, VNNI over quant_rows.h's int8 activations) */

/* The gemms' row tiles: the next tile's rows when `left` rows remain and a tile holds at most `most`,
 * spreading them evenly over the fewest tiles (9 rows in tiles of 8: 5 + 4, not 8 + 1). A one-row tile
 * waits on the latency of its few accumulator chains: SmolLM2's projections took 6.6 ms at 9 rows as
 * 8 + 1, 6.3 at 10 rows, 5.3 at 9 as 5 + 4. Which tile a row falls in never changes its bits. */
static inline int gemm_tile_rows(int64_t left, int most) {
    const int64_t tiles = (left + most - 1) / most;
    return (int)((left + tiles - 1) / tiles);
}

/* The gemms' share of work a thread takes at a time: this many consecutive column blocks (each `groups`
 * groups of 32 inputs long), so that its weights stream on in one run of about 256 groups, which the
 * prefetchers follow across block boundaries, yet at least 16 shares, so that a thread the OS pauses
 * leaves most of its work to the others. One block a share made each thread hop between blocks and
 * start each cold: Qwen2.5-0.5B's gate/up projection (896 inputs, 28 groups a block) at one row took
 * 350 us in int5 and 290 in int4 on a Zen 3, 235 and 192 in shares of 9 blocks. Long blocks (its down
 * projection's 152 groups) keep one a share: at 32 rows, compute-bound, fewer shares only end less even. */
static inline int64_t gemm_share_blocks(int64_t groups, int64_t blocks) {
    int64_t share = groups < 256 ? 256 / groups : 1;
    if (share > blocks / 16) share = blocks / 16;
    return share > 1 ? share : 1;
}

/* One output value of row list (vals, ids), largest first, `keep` long: taken in when larger than the last
 * (a tie with it is not: the list's values are the row's largest either way). */
static inline void top_insert(float *vals, int32_t *ids, int64_t keep, float v, int32_t id) {
    int64_t j = keep - 1;
    for (; j > 0 && vals[j - 1] < v; j--) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
    }
    vals[j] = v;
    ids[j] = id;
}

/* layer_ops.c */
typedef void rms_norm_fn(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out);
typedef void rope_fn(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos,
                     const float *sin);
typedef int write_kv_fn(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t rows,
                        int64_t width, const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache);
typedef void silu_mul_fn(const float *gate_up, int64_t rows, int64_t inter, float *out);
typedef int lora_add_fn(const float *x, int64_t rows, int64_t k, const int64_t *slot, const uint16_t *a,
                        const uint16_t *b, int64_t rank, int64_t n, float *y);
rms_norm_fn rms_norm_f32;
rope_fn rope_f32;
silu_mul_fn silu_mul_f32;
write_kv_fn write_kv_f32;  /* the cache's element: float */
write_kv_fn write_kv_f16;  /* the cache's element: IEEE half in uint16_t */
/* An int8 cache (KV_SCALE_BYTES below): each (slot, KV head) row is head_dim codes, then its float32 scale. */
typedef int write_kv_q8_fn(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t rows,
                           int64_t kv_heads, int64_t head_dim, const int64_t *slots, int64_t num_slots, void *k_cache,
                           void *v_cache);
write_kv_q8_fn write_kv_q8;
lora_add_fn lora_add_bf16;  /* y[r] += (x[r] A[slot[r]]) B[slot[r]], A and B bfloat16: each row its own adapter */

/* The int8 KV cache's row of one (slot, KV head): head_dim int8 codes, then the row's scale as a float32
 * in KV_SCALE_BYTES bytes (a value is code * scale; scale = max |x| / 127, written with the token). */
#define KV_SCALE_BYTES 4

/* paged_attention.c (AVX2; any head_dim multiple of 32 up to 256) and paged_attention_avx512.c
 * (head_dim a multiple of 64 up to 256, up to 8 query heads per KV head); _f32 over a float cache,
 * _f16 over a half one, _q8 over an int8 one (rows of head_dim + KV_SCALE_BYTES bytes). */
typedef int attention_fn(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                         int64_t max_blocks, const int64_t *context_lens, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out);
attention_fn paged_decode_attention_f32, paged_decode_attention_f16, paged_decode_attention_q8;
attention_fn paged_decode_attention_avx512_f32, paged_decode_attention_avx512_f16, paged_decode_attention_avx512_q8;

/* decoder_loop.c: every layer of a step in one call over the kernels above (its structs in
 * decoder_loop.h; `lora` NULL: no row under an adapter). */
struct DecoderModel;
struct DecoderLayer;
struct LoRAStep;
int decoder_loop(const struct DecoderModel *m, const struct DecoderLayer *layers, const struct LoRAStep *lora,
                 float *x, int64_t rows,
                 const float *cos, const float *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                 const int64_t *context_lens, int64_t block_size);

#endif
