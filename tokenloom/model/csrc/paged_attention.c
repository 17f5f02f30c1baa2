/* Attention straight from the paged KV cache for single queries: a decode token, or a prompt token with
 * its own context length (model/paged_attention.py).
 *
 * One OpenMP task per (run of consecutive rows that read one context, KV head): a prompt's tokens in one
 * step share their sequence's block table, up to MAX_TILE_QUERIES a run; a decode row usually runs
 * alone (rows join a run only where their blocks are the run's: a shared prefix qualifies). The
 * task converts the context's K rows, then its V rows, to float32 a tile of KV_TILE positions at a
 * time, through the block table (no gathered copy of the whole context, no padding to the longest
 * one), and every query head of the GQA group and every row of the run uses each tile while it is in
 * L1: a long prompt's prefill reads the cache once per run instead of once per token and head
 * (attention at 5,000 tokens of context: 1.7-2x faster on AVX2). Each query's arithmetic is exactly
 * what it would be alone — its scores in full, a two-pass softmax, then the weighted sum of V, each
 * in one fixed order — so a row's result never depends on the run or the batch it came in. The cache
 * is float32 or float16 (as llama.cpp keeps it); the arithmetic is float32 throughout, AVX2 + FMA
 * (+ F16C) intrinsics with a fixed summation order (no -ffast-math), exp as Cephes' polynomial on 8
 * lanes (simd_avx2.h, ~1 ulp).
 *
 * Built at run time by model/kernels.py with `-O3 -mavx2 -mfma -mf16c -fopenmp`. It links against
 * whichever libgomp the process already has loaded (torch's), so it shares torch's thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

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

/* The cache holds float32, float16 or int8 rows (kernels.h's KV_SCALE_BYTES: codes, then the row's scale);
 * the arithmetic reads float32 tiles: 8 elements from i of a row of head_dim (F16C converts 8 at a time,
 * int8 codes become code * scale, one float32 product each). */
static inline void store8_f32(float *dst, const float *row, int64_t i, int64_t head_dim) {
    (void)head_dim;
    _mm256_storeu_ps(dst, _mm256_loadu_ps(row + i));
}
static inline void store8_f16(float *dst, const uint16_t *row, int64_t i, int64_t head_dim) {
    (void)head_dim;
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + i))));
}
static inline void store8_q8(float *dst, const int8_t *row, int64_t i, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
    _mm256_storeu_ps(dst, _mm256_mul_ps(codes, _mm256_set1_ps(scale)));
}

/* Positions converted to float32 at a time (8 KB at head_dim 64: they stay in L1 while every query of
 * a task uses them; the 32 KB at head_dim 256 fill it), and the prompt tokens of one sequence that
 * share a task. */
#define KV_TILE 32
#define MAX_TILE_QUERIES 8
#define MAX_HEAD_DIM 256

/* scores[t] = scale * q . k_t for t in [from, to) (from a multiple of 4), k_t the float32 row t - origin
 * of `tile`; four positions at a time so four independent FMA chains hide the FMA latency. The same
 * operations in the same order whatever `from` and `to` are, as long as `to` is the query's context
 * or a multiple of 4: the bits of a score never depend on the tiling. */
static void tile_scores(const float *q, const float *tile, int64_t origin, int64_t from, int64_t to,
                        int64_t head_dim, float scale, float *scores) {
    int64_t t = from;
    for (; t + 4 <= to; t += 4) {
        const float *k0 = tile + (t - origin) * head_dim, *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 8) {
            const __m256 qv = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
        }
        _mm_storeu_ps(scores + t, _mm_mul_ps(hsum8x4(a0, a1, a2, a3), _mm_set1_ps(scale)));
    }
    for (; t < to; t++) {
        const float *kt = tile + (t - origin) * head_dim;
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kt + i), a);
        scores[t] = hsum8(a) * scale;
    }
}

/* tile_scores for two queries at once, each K load serving both (the loads, not the FMAs, bound the
 * single-query loop): the quads both have, then each query's own rest alone. Same bits as two calls. */
static void tile_scores2(const float *qa, const float *qb, const float *tile, int64_t origin, int64_t from,
                         int64_t to_a, int64_t to_b, int64_t head_dim, float scale, float *sa, float *sb) {
    const int64_t both = to_a < to_b ? to_a : to_b;
    int64_t t = from;
    for (; t + 4 <= both; t += 4) {
        const float *k0 = tile + (t - origin) * head_dim, *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 8) {
            const __m256 qav = _mm256_loadu_ps(qa + i), qbv = _mm256_loadu_ps(qb + i);
            const __m256 x0 = _mm256_loadu_ps(k0 + i), x1 = _mm256_loadu_ps(k1 + i);
            const __m256 x2 = _mm256_loadu_ps(k2 + i), x3 = _mm256_loadu_ps(k3 + i);
            a0 = _mm256_fmadd_ps(qav, x0, a0);
            b0 = _mm256_fmadd_ps(qbv, x0, b0);
            a1 = _mm256_fmadd_ps(qav, x1, a1);
            b1 = _mm256_fmadd_ps(qbv, x1, b1);
            a2 = _mm256_fmadd_ps(qav, x2, a2);
            b2 = _mm256_fmadd_ps(qbv, x2, b2);
            a3 = _mm256_fmadd_ps(qav, x3, a3);
            b3 = _mm256_fmadd_ps(qbv, x3, b3);
        }
        _mm_storeu_ps(sa + t, _mm_mul_ps(hsum8x4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        _mm_storeu_ps(sb + t, _mm_mul_ps(hsum8x4(b0, b1, b2, b3), _mm_set1_ps(scale)));
    }
    tile_scores(qa, tile, origin, t, to_a, head_dim, scale, sa);
    tile_scores(qb, tile, origin, t, to_b, head_dim, scale, sb);
}

/* out += sum over t in [from, to) of p[t] * v_t, v_t the float32 row t - origin of `tile`: each output
 * element one FMA chain in position order, carried in `out` from tile to tile (the same bits as one
 * pass over the whole context). */
static void tile_values(const float *p, const float *tile, int64_t origin, int64_t from, int64_t to,
                        int64_t head_dim, float *out) {
    for (int64_t d = 0; d < head_dim; d += 32) {
        __m256 a0 = _mm256_loadu_ps(out + d), a1 = _mm256_loadu_ps(out + d + 8);
        __m256 a2 = _mm256_loadu_ps(out + d + 16), a3 = _mm256_loadu_ps(out + d + 24);
        for (int64_t t = from; t < to; t++) {
            const float *vt = tile + (t - origin) * head_dim + d;
            const __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt), a0);
            a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8), a1);
            a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 16), a2);
            a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 24), a3);
        }
        _mm256_storeu_ps(out + d, a0);
        _mm256_storeu_ps(out + d + 8, a1);
        _mm256_storeu_ps(out + d + 16, a2);
        _mm256_storeu_ps(out + d + 24, a3);
    }
}

/* tile_values for two queries at once, each V load serving both, over the positions both have; then
 * each one's own rest alone. Same bits as two calls. */
static void tile_values2(const float *pa, const float *pb, const float *tile, int64_t origin, int64_t from,
                         int64_t to_a, int64_t to_b, int64_t head_dim, float *oa, float *ob) {
    const int64_t both = to_a < to_b ? to_a : to_b;
    for (int64_t d = 0; both > from && d < head_dim; d += 32) {
        __m256 a0 = _mm256_loadu_ps(oa + d), a1 = _mm256_loadu_ps(oa + d + 8);
        __m256 a2 = _mm256_loadu_ps(oa + d + 16), a3 = _mm256_loadu_ps(oa + d + 24);
        __m256 b0 = _mm256_loadu_ps(ob + d), b1 = _mm256_loadu_ps(ob + d + 8);
        __m256 b2 = _mm256_loadu_ps(ob + d + 16), b3 = _mm256_loadu_ps(ob + d + 24);
        for (int64_t t = from; t < both; t++) {
            const float *vt = tile + (t - origin) * head_dim + d;
            const __m256 x0 = _mm256_loadu_ps(vt), x1 = _mm256_loadu_ps(vt + 8);
            const __m256 x2 = _mm256_loadu_ps(vt + 16), x3 = _mm256_loadu_ps(vt + 24);
            const __m256 pat = _mm256_set1_ps(pa[t]), pbt = _mm256_set1_ps(pb[t]);
            a0 = _mm256_fmadd_ps(pat, x0, a0);
            b0 = _mm256_fmadd_ps(pbt, x0, b0);
            a1 = _mm256_fmadd_ps(pat, x1, a1);
            b1 = _mm256_fmadd_ps(pbt, x1, b1);
            a2 = _mm256_fmadd_ps(pat, x2, a2);
            b2 = _mm256_fmadd_ps(pbt, x2, b2);
            a3 = _mm256_fmadd_ps(pat, x3, a3);
            b3 = _mm256_fmadd_ps(pbt, x3, b3);
        }
        _mm256_storeu_ps(oa + d, a0);
        _mm256_storeu_ps(oa + d + 8, a1);
        _mm256_storeu_ps(oa + d + 16, a2);
        _mm256_storeu_ps(oa + d + 24, a3);
        _mm256_storeu_ps(ob + d, b0);
        _mm256_storeu_ps(ob + d + 8, b1);
        _mm256_storeu_ps(ob + d + 16, b2);
        _mm256_storeu_ps(ob + d + 24, b3);
    }
    const int64_t rest = both > from ? both : from;
    tile_values(pa, tile, origin, rest, to_a, head_dim, oa);
    tile_values(pb, tile, origin, rest, to_b, head_dim, ob);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Where query head a of a task (row r0 + a / group, head kvh * group + a % group) sits in q and out. */
#define HEAD_AT(a) (((r0 + (a) / group) * num_heads + kvh * group + (a) % group) * head_dim)

/* One kernel per cache element type T: the entry point, one OpenMP task per (run of rows reading one
 * context, KV head). A task converts each K row, then each V row, of the context to float32 once, a
 * tile at a time, and uses it for every query head of the GQA group and every row of the run; each
 * query's arithmetic is what it would be alone (scores, a two-pass softmax, the weighted sum of V),
 * so a row's result depends on nothing else in the batch. */
#define DEFINE_ATTENTION(SUFFIX, T, STORE8, PAD) /* PAD: bytes after a row's head_dim elements */                                                                   \
static void gather_tile_##SUFFIX(const T *cache, const int64_t *offsets, int64_t from, int64_t to,          \
                                 int64_t ctx, int64_t head_dim, float *tile) {                              \
    for (int64_t t = from; t < to; t++) {                                                                   \
        if (t + KV_TILE < ctx) prefetch_row(cache + offsets[t + KV_TILE], (size_t)head_dim * sizeof(T));    \
        for (int64_t i = 0; i < head_dim; i += 8) STORE8(tile + (t - from) * head_dim + i, cache + offsets[t], i, head_dim); \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
int paged_decode_attention_##SUFFIX(const float *q, const void *k_cache, const void *v_cache,              \
                                    const int64_t *tables, int64_t max_blocks, const int64_t *context_lens, \
                                    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,              \
                                    int64_t head_dim, int64_t block_size, float scale, float *out) {        \
    const T *k = k_cache, *v = v_cache;                                                                     \
    if (head_dim > MAX_HEAD_DIM || head_dim % 32) return -2;                                                \
    const int64_t group = num_heads / num_kv_heads;                                                         \
    const int64_t row = head_dim + PAD, slot_stride = num_kv_heads * row;                                 \
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));                                     \
    if (!starts) return -1;                                                                                 \
    const int64_t num_runs = context_runs(tables, max_blocks, context_lens, num_seqs, block_size,             \
                                          MAX_TILE_QUERIES, starts);                                        \
    int failed = 0;                                                                                         \
    _Pragma("omp parallel for schedule(dynamic) reduction(| : failed)")                                     \
    for (int64_t task = 0; task < num_runs * num_kv_heads; task++) {                                        \
        const int64_t r0 = starts[task / num_kv_heads], rows = starts[task / num_kv_heads + 1] - r0;        \
        const int64_t kvh = task % num_kv_heads;                                                            \
        const int64_t longest = longest_row(context_lens, r0, rows), ctx = context_lens[longest];           \
        const int64_t n = ctx > 0 ? ctx : 1;                                                                \
        /* one buffer: the context's row offsets (in elements), then a score row per (row, query head) */   \
        int64_t stack_buf[STACK_WORDS];                                                                     \
        const int64_t heads = rows * group; /* query heads a = j * group + g: row r0 + j, head kvh * group + g */ \
        int64_t *offsets = task_buffer(n, heads, stack_buf);                                                \
        if (!offsets) { failed = 1; continue; }                                                             \
        float *scores = (float *)(offsets + n);                                                             \
        float tile[KV_TILE * MAX_HEAD_DIM];                                                                 \
        context_offsets(tables + longest * max_blocks, ctx, block_size, slot_stride, kvh * row, offsets);     \
        for (int64_t from = 0; from < ctx; from += KV_TILE) {                                               \
            const int64_t to = from + KV_TILE < ctx ? from + KV_TILE : ctx;                                 \
            gather_tile_##SUFFIX(k, offsets, from, to, ctx, head_dim, tile);                                \
            for (int64_t a = 0; a < heads; a += 2) {                                                        \
                const int64_t ea = min64(context_lens[r0 + a / group], to);                                \
                if (a + 1 == heads) {                                                                       \
                    if (ea > from) tile_scores(q + HEAD_AT(a), tile, from, from, ea, head_dim, scale, scores + a * n); \
                    continue;                                                                               \
                }                                                                                           \
                const int64_t eb = min64(context_lens[r0 + (a + 1) / group], to);                          \
                tile_scores2(q + HEAD_AT(a), q + HEAD_AT(a + 1), tile, from, from, ea > from ? ea : from,               \
                             eb > from ? eb : from, head_dim, scale, scores + a * n, scores + (a + 1) * n); \
            }                                                                                               \
        }                                                                                                   \
        for (int64_t a = 0; a < heads; a++) {                                                               \
            softmax_row(scores + a * n, context_lens[r0 + a / group]);                                      \
            memset(out + HEAD_AT(a), 0, sizeof(float) * (size_t)head_dim);                                         \
        }                                                                                                   \
        for (int64_t from = 0; from < ctx; from += KV_TILE) {                                               \
            const int64_t to = from + KV_TILE < ctx ? from + KV_TILE : ctx;                                 \
            gather_tile_##SUFFIX(v, offsets, from, to, ctx, head_dim, tile);                                \
            for (int64_t a = 0; a < heads; a += 2) {                                                        \
                const int64_t ea = min64(context_lens[r0 + a / group], to);                                \
                if (a + 1 == heads) {                                                                       \
                    if (ea > from) tile_values(scores + a * n, tile, from, from, ea, head_dim, out + HEAD_AT(a));  \
                    continue;                                                                               \
                }                                                                                           \
                const int64_t eb = min64(context_lens[r0 + (a + 1) / group], to);                          \
                tile_values2(scores + a * n, scores + (a + 1) * n, tile, from, from, ea > from ? ea : from, \
                             eb > from ? eb : from, head_dim, out + HEAD_AT(a), out + HEAD_AT(a + 1));                    \
            }                                                                                               \
        }                                                                                                   \
        if (offsets != stack_buf) free(offsets);                                                            \
    }                                                                                                       \
    free(starts);                                                                                           \
    return failed ? -1 : 0;                                                                                 \
}

/* q:      [num_seqs, num_heads, head_dim] float32 (num_seqs: rows, one query each)
 * k, v:   [num_slots, num_kv_heads, head_dim] in the cache's type (one layer; slot = block * block_size + offset);
 *         int8: [num_slots, num_kv_heads, head_dim + KV_SCALE_BYTES], each row's codes then its scale
 * tables: [num_seqs, max_blocks] block ids;  context_lens: [num_seqs]
 * out:    [num_seqs, num_heads, head_dim] float32
 * Returns 0; -1 if memory ran out; -2 for a head_dim that is not a multiple of 32 up to MAX_HEAD_DIM. */
DEFINE_ATTENTION(f32, float, store8_f32, 0)
DEFINE_ATTENTION(f16, uint16_t, store8_f16, 0)
DEFINE_ATTENTION(q8, int8_t, store8_q8, KV_SCALE_BYTES)
