/* Attention straight from the paged KV cache for single queries: a decode token, or a prompt token with
 * its own context length (model/paged_attention.py).
 *
 * For each (sequence, KV head) — one OpenMP task each, so a sequence's result never depends on the
 * others in the batch — the query heads that share that KV head (GQA) read each cached K and V row
 * once, through the block table: no gathered copy of the context, no padding to the longest one.
 * Scores are computed in full, then softmax, then the weighted sum of V (two passes over the context;
 * a decode context is at most a few thousand tokens). The cache is float32 or float16 (as llama.cpp
 * keeps it); the arithmetic is float32 throughout, AVX2 + FMA (+ F16C) intrinsics with
 * a fixed summation order (no -ffast-math), exp as Cephes' polynomial on 8 lanes (simd_avx2.h, ~1 ulp).
 *
 * Built at run time by model/kernels.py with `-O3 -mavx2 -mfma -mf16c -fopenmp`. It links against
 * whichever libgomp the process already has loaded (torch's), so it shares torch's thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_context.h"
#include "simd_avx2.h"

/* exp(x) for x <= 0 (a softmax tail after subtracting the max): 2^n * p(r), Cephes' expf polynomial. */
static inline float exp_nonpos(float x) {
    if (x < -87.0f) return 0.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

/* sc[0, ctx) -> softmax in place, 8 positions at a time (the tail of a context scalar). */
static void softmax_row(float *sc, int64_t ctx) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= ctx; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + t));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; t < ctx; t++) m = sc[t] > m ? sc[t] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= ctx; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mb));
        _mm256_storeu_ps(sc + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum8(sv);
    for (; t < ctx; t++) {
        sc[t] = exp_nonpos(sc[t] - m);
        sum += sc[t];
    }
    const float inv = 1.0f / sum;
    const __m256 iv = _mm256_set1_ps(inv);
    for (t = 0; t + 8 <= ctx; t += 8) _mm256_storeu_ps(sc + t, _mm256_mul_ps(_mm256_loadu_ps(sc + t), iv));
    for (; t < ctx; t++) sc[t] *= inv;
}

/* The cache holds float32 or float16 (F16C converts 8 at a time); everything after the load is float32. */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* One kernel per cache element type T (LOAD8 reads 8 of them as float32):
 * - head_scores: scores[t] = scale * q . k_t for one query head over the whole context; four positions
 *   at a time so four independent FMA chains hide the FMA latency;
 * - head_values: out = sum_t p[t] * v_t for one head, 32 dimensions at a time in four accumulators;
 * - paged_decode_attention: the entry point below, one OpenMP task per (sequence, KV head). */
#define DEFINE_ATTENTION(SUFFIX, T, LOAD8)                                                                    \
static void head_scores_##SUFFIX(const float *q, const T *k, const int64_t *offsets, int64_t ctx,           \
                                 int64_t head_dim, float scale, float *scores) {                            \
    int64_t t = 0;                                                                                          \
    for (; t + 4 <= ctx; t += 4) {                                                                          \
        for (int64_t a = t + PREFETCH_AHEAD; a < t + PREFETCH_AHEAD + 4 && a < ctx; a++)                    \
            prefetch_row(k + offsets[a], (size_t)head_dim * sizeof(T));                                     \
        const T *k0 = k + offsets[t], *k1 = k + offsets[t + 1], *k2 = k + offsets[t + 2], *k3 = k + offsets[t + 3]; \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps(); \
        for (int64_t i = 0; i < head_dim; i += 8) {                                                         \
            const __m256 qv = _mm256_loadu_ps(q + i);                                                       \
            a0 = _mm256_fmadd_ps(qv, LOAD8(k0 + i), a0);                                                    \
            a1 = _mm256_fmadd_ps(qv, LOAD8(k1 + i), a1);                                                    \
            a2 = _mm256_fmadd_ps(qv, LOAD8(k2 + i), a2);                                                    \
            a3 = _mm256_fmadd_ps(qv, LOAD8(k3 + i), a3);                                                    \
        }                                                                                                   \
        _mm_storeu_ps(scores + t, _mm_mul_ps(hsum8x4(a0, a1, a2, a3), _mm_set1_ps(scale)));                 \
    }                                                                                                       \
    for (; t < ctx; t++) {                                                                                  \
        const T *kt = k + offsets[t];                                                                       \
        __m256 a = _mm256_setzero_ps();                                                                     \
        for (int64_t i = 0; i < head_dim; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), LOAD8(kt + i), a); \
        scores[t] = hsum8(a) * scale;                                                                        \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
static void head_values_##SUFFIX(const float *p, const T *v, const int64_t *offsets, int64_t ctx,           \
                                 int64_t head_dim, float *out) {                                            \
    for (int64_t d = 0; d < head_dim; d += 32) {                                                            \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps(); \
        for (int64_t t = 0; t < ctx; t++) {                                                                 \
            if (d == 0 && t + PREFETCH_AHEAD < ctx) prefetch_row(v + offsets[t + PREFETCH_AHEAD], (size_t)head_dim * sizeof(T)); \
            const T *vt = v + offsets[t] + d;                                                               \
            const __m256 pt = _mm256_set1_ps(p[t]);                                                         \
            a0 = _mm256_fmadd_ps(pt, LOAD8(vt), a0);                                                        \
            a1 = _mm256_fmadd_ps(pt, LOAD8(vt + 8), a1);                                                    \
            a2 = _mm256_fmadd_ps(pt, LOAD8(vt + 16), a2);                                                   \
            a3 = _mm256_fmadd_ps(pt, LOAD8(vt + 24), a3);                                                   \
        }                                                                                                   \
        _mm256_storeu_ps(out + d, a0);                                                                      \
        _mm256_storeu_ps(out + d + 8, a1);                                                                  \
        _mm256_storeu_ps(out + d + 16, a2);                                                                 \
        _mm256_storeu_ps(out + d + 24, a3);                                                                 \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
int paged_decode_attention_##SUFFIX(const float *q, const T *k, const T *v, const int64_t *tables,          \
                                    int64_t max_blocks, const int64_t *context_lens, int64_t num_seqs,      \
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,              \
                                    int64_t block_size, float scale, float *out) {                          \
    const int64_t group = num_heads / num_kv_heads;                                                         \
    const int64_t slot_stride = num_kv_heads * head_dim;                                                    \
    int failed = 0;                                                                                         \
    _Pragma("omp parallel for schedule(static) reduction(| : failed)")                                      \
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {                                        \
        const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads;                                   \
        const int64_t ctx = context_lens[s];                                                                \
        const int64_t *table = tables + s * max_blocks;                                                     \
        const int64_t n = ctx > 0 ? ctx : 1;                                                                \
        /* one buffer: the context's row offsets (in elements), then one score row per query head */        \
        int64_t stack_buf[STACK_WORDS];                                                                     \
        int64_t *offsets = task_buffer(n, group, stack_buf);                                                \
        if (!offsets) { failed = 1; continue; }                                                             \
        float *scores = (float *)(offsets + n);                                                             \
        context_offsets(table, ctx, block_size, slot_stride, kvh * head_dim, offsets);                      \
        for (int64_t g = 0; g < group; g++) {                                                               \
            const int64_t h = kvh * group + g;                                                              \
            float *sc = scores + g * n;                                                                     \
            head_scores_##SUFFIX(q + (s * num_heads + h) * head_dim, k, offsets, ctx, head_dim, scale, sc); \
            softmax_row(sc, ctx);                                                                           \
            head_values_##SUFFIX(sc, v, offsets, ctx, head_dim, out + (s * num_heads + h) * head_dim);      \
        }                                                                                                   \
        if (offsets != stack_buf) free(offsets);                                                            \
    }                                                                                                       \
    return failed ? -1 : 0;                                                                                 \
}

/* q:      [num_seqs, num_heads, head_dim] float32
 * k, v:   [num_slots, num_kv_heads, head_dim] in the cache's type (one layer; slot = block * block_size + offset)
 * tables: [num_seqs, max_blocks] block ids;  context_lens: [num_seqs]
 * out:    [num_seqs, num_heads, head_dim] float32
 * head_dim must be a multiple of 32 (checked by the caller). Returns 0, or -1 if memory ran out. */
DEFINE_ATTENTION(f32, float, load8_f32)
DEFINE_ATTENTION(f16, uint16_t, load8_f16)
