/* Decode attention from the paged KV cache, AVX-512 version for head_dim 64 (SmolLM2, TinyLlama,
 * Llama-3.2-1B) and up to 4 query heads per KV head.
 *
 * One OpenMP task per (run of up to MAX_RUN rows that read one context, KV head): a decode row alone,
 * or a prompt's tokens in one step, or a decode row with its speculative drafts (paged_context.h's
 * context_runs). A task reads each cached K and V row once, holds it in four 16-wide registers and
 * uses it for every query head of the GQA group and every row of the run: a 512-token prefill's
 * attention 9.0 -> 5.5 ms a layer on SmolLM2 (Zen 4), where each row was its own task. The scores are
 * in full, then a softmax, then the weighted sum of V; a fixed summation order, float32 arithmetic,
 * float32 or float16 cache. Each query's operations are the ones it gets in a task of its own, in the
 * same order, so a row's result never depends on its run or the rest of the batch.
 *
 * Built at run time by model/kernels.py with -mavx512f -mf16c.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#include "paged_context.h"

#define HD 64        /* head_dim */
#define MAX_GROUP 4  /* query heads per KV head */
#define MAX_RUN 8    /* rows reading one context (a prompt's tokens, a row's drafts) that share a task */
#define V_CHUNK 6    /* query heads whose weighted sums of V are held in registers at once */

/* Elements [16 i, 16 i + 16) of a cache row as float32 (int8: code * the row's scale, kernels.h's layout). */
static inline __m512 load16_f32(const float *row, int i) { return _mm512_loadu_ps(row + 16 * i); }
static inline __m512 load16_f16(const uint16_t *row, int i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 16 * i)));
}
static inline __m512 load16_q8(const int8_t *row, int i) {
    float scale;
    memcpy(&scale, row + HD, sizeof scale);
    const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * i))));
    return _mm512_mul_ps(codes, _mm512_set1_ps(scale));
}

/* exp(x) for x <= 0, 16 lanes: 2^n * p(r), the Cephes polynomial of simd_avx2.h's exp8 (x clamped at -87,
 * where the scalar tail of the AVX2 kernel returns 0: both below float32's resolution after the sum). */
static inline __m512 exp16_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    const __m512 r2 = _mm512_mul_ps(r, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* The lane sums of four vectors, [sum a0, sum a1, sum a2, sum a3]: 13 shuffles and adds where four
 * _mm512_reduce_add_ps take about 32 (the score loop's cost when every score was reduced alone). */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* per 128-bit lane: s01 = [a0_0 + a0_2, a1_0 + a1_2, a0_1 + a0_3, a1_1 + a1_3], s23 likewise */
    const __m512d s01 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
    const __m512d s23 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
    /* per 128-bit lane: [a0's four, a1's four, a2's four, a3's four] summed */
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(s01, s23)), _mm512_castpd_ps(_mm512_unpackhi_pd(s01, s23)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* sc[0, ctx) -> softmax in place (max, exp, sum, scale, 16 positions at a time). */
static void softmax_row(float *sc, int64_t ctx) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= ctx; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sc + t));
    float m = _mm512_reduce_max_ps(mv);
    for (; t < ctx; t++) m = sc[t] > m ? sc[t] : m;
    __m512 sv = _mm512_setzero_ps();
    const __m512 mb = _mm512_set1_ps(m);
    for (t = 0; t + 16 <= ctx; t += 16) {
        const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mb));
        _mm512_storeu_ps(sc + t, e);
        sv = _mm512_add_ps(sv, e);
    }
    if (t < ctx) {  /* the tail through a mask: the same arithmetic as a full vector */
        const __mmask16 k = (__mmask16)((1u << (ctx - t)) - 1);
        const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), mb));
        _mm512_mask_storeu_ps(sc + t, k, e);
        sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sv));
    for (t = 0; t + 16 <= ctx; t += 16) _mm512_storeu_ps(sc + t, _mm512_mul_ps(_mm512_loadu_ps(sc + t), inv));
    for (; t < ctx; t++) sc[t] *= _mm512_cvtss_f32(inv);
}

/* One task's query heads: where each one's query sits, and how many positions it sees. */
typedef struct {
    const float *q[MAX_RUN * MAX_GROUP];
    int64_t ctx[MAX_RUN * MAX_GROUP];
    int64_t heads, n; /* query heads; the stride of their score rows */
} Queries;

/* q . k_t * scale for one position, its row in four registers: the tail of a context (fewer than four
 * positions left), one reduction a score. */
static inline float one_score(const float *q, __m512 k0, __m512 k1, __m512 k2, __m512 k3, float scale) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), k0);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), k1, a);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 32), k2, a);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), k3, a);
    return _mm512_reduce_add_ps(a) * scale;
}

/* Per cache element type T: the scores of a task's query heads (each K row loaded once, for all of them:
 * four positions at a time, every head whose context holds all four reducing them together, the rest
 * one at a time), then each head's weighted sum of V (V_CHUNK heads' sums in registers at a time).
 * Every head's arithmetic is what it would be in a task of its own, in the same order. */
#define DEFINE_TASK(SUFFIX, T, LOAD16)                                                                        \
static void scores_##SUFFIX(const Queries *qs, int64_t ctx, const T *k, const int64_t *offsets, float scale, \
                            float *scores) {                                                                \
    int64_t t = 0;                                                                                          \
    for (; t + 4 <= ctx; t += 4) {                                                                          \
        __m512 kr[4][HD / 16];                                                                              \
        for (int u = 0; u < 4; u++) {                                                                       \
            if (t + u + PREFETCH_AHEAD < ctx) prefetch_row(k + offsets[t + u + PREFETCH_AHEAD], HD * sizeof(T)); \
            for (int i = 0; i < HD / 16; i++) kr[u][i] = LOAD16(k + offsets[t + u], i);                    \
        }                                                                                                   \
        for (int64_t a = 0; a < qs->heads; a++) {                                                           \
            const float *q = qs->q[a];                                                                      \
            float *sc = scores + a * qs->n + t;                                                             \
            if (t + 4 <= qs->ctx[a]) {                                                                      \
                __m512 s[4];                                                                                \
                for (int u = 0; u < 4; u++) {                                                               \
                    s[u] = _mm512_mul_ps(_mm512_loadu_ps(q), kr[u][0]);                                     \
                    for (int i = 1; i < HD / 16; i++) s[u] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), kr[u][i], s[u]); \
                }                                                                                           \
                _mm_storeu_ps(sc, _mm_mul_ps(sum4(s[0], s[1], s[2], s[3]), _mm_set1_ps(scale)));            \
            } else {                                                                                        \
                for (int u = 0; t + u < qs->ctx[a]; u++) sc[u] = one_score(q, kr[u][0], kr[u][1], kr[u][2], kr[u][3], scale); \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    for (; t < ctx; t++) {                                                                                  \
        const T *kt = k + offsets[t];                                                                       \
        const __m512 k0 = LOAD16(kt, 0), k1 = LOAD16(kt, 1), k2 = LOAD16(kt, 2), k3 = LOAD16(kt, 3);         \
        for (int64_t a = 0; a < qs->heads; a++)                                                             \
            if (t < qs->ctx[a]) scores[a * qs->n + t] = one_score(qs->q[a], k0, k1, k2, k3, scale);         \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
static void values_##SUFFIX(const Queries *qs, const T *v, const int64_t *offsets, const float *scores,     \
                            float *const *out) {                                                            \
    for (int64_t c0 = 0; c0 < qs->heads; c0 += V_CHUNK) {                                                   \
        const int64_t nc = qs->heads - c0 < V_CHUNK ? qs->heads - c0 : V_CHUNK;                             \
        int64_t ctx = 0, ctxs[V_CHUNK];                                                                     \
        for (int c = 0; c < V_CHUNK; c++) {                                                                 \
            ctxs[c] = c < nc ? qs->ctx[c0 + c] : 0;                                                         \
            ctx = ctxs[c] > ctx ? ctxs[c] : ctx;                                                            \
        }                                                                                                   \
        __m512 acc[V_CHUNK][HD / 16];                                                                       \
        for (int c = 0; c < V_CHUNK; c++) /* unrolled: registers, not memory */                             \
            for (int i = 0; i < HD / 16; i++) acc[c][i] = _mm512_setzero_ps();                              \
        for (int64_t t = 0; t < ctx; t++) {                                                                 \
            if (t + PREFETCH_AHEAD < ctx) prefetch_row(v + offsets[t + PREFETCH_AHEAD], HD * sizeof(T));    \
            const T *vt = v + offsets[t];                                                                   \
            const __m512 v0 = LOAD16(vt, 0), v1 = LOAD16(vt, 1), v2 = LOAD16(vt, 2), v3 = LOAD16(vt, 3);     \
            for (int c = 0; c < V_CHUNK; c++) if (t < ctxs[c]) {                                            \
                const __m512 p = _mm512_set1_ps(scores[(c0 + c) * qs->n + t]);                              \
                acc[c][0] = _mm512_fmadd_ps(p, v0, acc[c][0]);                                              \
                acc[c][1] = _mm512_fmadd_ps(p, v1, acc[c][1]);                                              \
                acc[c][2] = _mm512_fmadd_ps(p, v2, acc[c][2]);                                              \
                acc[c][3] = _mm512_fmadd_ps(p, v3, acc[c][3]);                                              \
            }                                                                                               \
        }                                                                                                   \
        for (int c = 0; c < V_CHUNK; c++) if (c < nc) /* unrolled: registers, not memory */                \
            for (int i = 0; i < HD / 16; i++) _mm512_storeu_ps(out[c0 + c] + 16 * i, acc[c][i]);            \
    }                                                                                                       \
}

/* The entry point: one OpenMP task per (run of up to MAX_RUN rows reading one context, KV head). */
#define DEFINE_ATTENTION(SUFFIX, T, PAD)                                                                      \
int paged_decode_attention_avx512_##SUFFIX(const float *q, const void *k_cache, const void *v_cache,       \
                                           const int64_t *tables, int64_t max_blocks,                       \
                                           const int64_t *context_lens, int64_t num_seqs, int64_t num_heads, \
                                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,      \
                                           float scale, float *out) {                                       \
    const int64_t group = num_heads / num_kv_heads;                                                         \
    const int64_t slot_stride = num_kv_heads * (HD + PAD);                                                  \
    if (head_dim != HD || group > MAX_GROUP) return -2;                                                     \
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));                                     \
    if (!starts) return -1;                                                                                 \
    const int64_t num_runs = context_runs(tables, max_blocks, context_lens, num_seqs, block_size, MAX_RUN, starts); \
    int failed = 0;                                                                                         \
    _Pragma("omp parallel for schedule(dynamic) reduction(| : failed)")                                     \
    for (int64_t task = 0; task < num_runs * num_kv_heads; task++) {                                        \
        const int64_t r0 = starts[task / num_kv_heads], rows = starts[task / num_kv_heads + 1] - r0;        \
        const int64_t kvh = task % num_kv_heads;                                                            \
        Queries qs;                                                                                         \
        float *outs[MAX_RUN * MAX_GROUP];                                                                   \
        const int64_t longest = longest_row(context_lens, r0, rows), ctx = context_lens[longest];           \
        qs.heads = rows * group; /* head a: row r0 + a / group, query head kvh * group + a % group */       \
        for (int64_t a = 0; a < qs.heads; a++) {                                                            \
            const int64_t at = ((r0 + a / group) * num_heads + kvh * group + a % group) * HD;               \
            qs.q[a] = q + at;                                                                               \
            outs[a] = out + at;                                                                             \
            qs.ctx[a] = context_lens[r0 + a / group];                                                       \
        }                                                                                                   \
        qs.n = ctx > 0 ? ctx : 1;                                                                           \
        int64_t stack_buf[STACK_WORDS];                                                                     \
        int64_t *offsets = task_buffer(qs.n, qs.heads, stack_buf); /* then a score row per head */         \
        if (!offsets) { failed = 1; continue; }                                                             \
        float *scores = (float *)(offsets + qs.n);                                                          \
        context_offsets(tables + longest * max_blocks, ctx, block_size, slot_stride, kvh * (HD + PAD), offsets);\
        scores_##SUFFIX(&qs, ctx, k_cache, offsets, scale, scores);                                         \
        for (int64_t a = 0; a < qs.heads; a++) softmax_row(scores + a * qs.n, qs.ctx[a]);             \
        values_##SUFFIX(&qs, v_cache, offsets, scores, outs);                                               \
        if (offsets != stack_buf) free(offsets);                                                            \
    }                                                                                                       \
    free(starts);                                                                                           \
    return failed ? -1 : 0;                                                                                 \
}

DEFINE_TASK(f32, float, load16_f32)
DEFINE_TASK(f16, uint16_t, load16_f16)
DEFINE_TASK(q8, int8_t, load16_q8)

/* Arguments as paged_decode_attention_f32/_f16 in paged_attention.c; returns -2 for a shape it does
 * not handle (head_dim != 64 or more than 4 query heads per KV head). */
DEFINE_ATTENTION(f32, float, 0)
DEFINE_ATTENTION(f16, uint16_t, 0)
DEFINE_ATTENTION(q8, int8_t, KV_SCALE_BYTES)
