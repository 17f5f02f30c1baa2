/* Decode attention from the paged KV cache, AVX-512 version: head_dim a multiple of 64 up to 256
 * (SmolLM2, Llama-3.2-1B and Qwen2.5-0.5B at 64; Qwen3 and Qwen2.5-1.5B at 128; Gemma 3 at 256) and up
 * to 8 query heads per KV head.
 *
 * One OpenMP task per (run of up to MAX_RUN rows that read one context, KV head): a decode row alone,
 * or a prompt's tokens in one step, or a decode row with its speculative drafts (paged_context.h's
 * context_runs). A task reads each cached K and V row from memory once for every query head of the GQA
 * group and every row of the run. The scores take four positions at a time: at head_dim 64 their K rows
 * stay in 16 registers while every head of the task uses them; wider rows do not fit, so up to
 * HEAD_TILE heads use them at once (4 x 4 dot products in 16 accumulators, whatever head_dim is) and the
 * next tile of heads finds the rows in L1. The weighted sums of V take PANEL elements of a row at a
 * time for up to V_CHUNK heads. The scores are in full, then a softmax, then the weighted sum of V; a
 * fixed summation order, float32 arithmetic, float32, float16 or int8 cache. Each query's operations
 * are the ones it gets in a task of its own, in the same order (no tile, panel or head_dim path changes
 * a chain), so a row's result never depends on its run or the rest of the batch.
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

#define MAX_HEAD_DIM 256
#define PANEL 64     /* head_dim elements of a V row per pass: 4 registers a head, so head_dim a multiple of it */
#define MAX_GROUP 8  /* query heads per KV head */
#define MAX_RUN 8    /* rows reading one context (a prompt's tokens, a row's drafts) that share a task */
#define HEAD_TILE 4  /* query heads a quad of K rows serves at once: 4 x 4 accumulators, 4 K and 4 q registers */
#define V_CHUNK 6    /* query heads whose weighted sums of a V panel are held in registers at once */
#define MAX_TILES ((MAX_RUN * MAX_GROUP + HEAD_TILE - 1) / HEAD_TILE)

/* Elements [16 i, 16 i + 16) of a cache row of hd elements as float32 (int8: code * the row's scale,
 * kernels.h's layout: the scale after the codes). */
static inline __m512 load16_f32(const float *row, int64_t i, int64_t hd) {
    (void)hd;
    return _mm512_loadu_ps(row + 16 * i);
}
static inline __m512 load16_f16(const uint16_t *row, int64_t i, int64_t hd) {
    (void)hd;
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 16 * i)));
}
static inline __m512 load16_q8(const int8_t *row, int64_t i, int64_t hd) {
    float scale;
    memcpy(&scale, row + hd, sizeof scale);
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

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* q . k_t * scale for one position of head_dim 64, its row in four registers: one reduction a score
 * (the tail of a context), the chain of quad_scores. */
static inline float one_score64(const float *q, const __m512 *kr, float scale) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), kr[0]);
    for (int i = 1; i < 4; i++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), kr[i], a);
    return _mm512_reduce_add_ps(a) * scale;
}

/* Per cache element type T (PAD: bytes after a row's head_dim elements):
 *
 * quad_scores: the scores of NH (a constant once inlined) query heads a0.. at the four positions t..t+3
 * whose K rows are `rows`: per head and position one chain, q[0:16] * k[0:16] then an FMA for each
 * further 16 elements, in order; a head that sees all four reduces them together (sum4), one that sees
 * fewer reduces each it sees alone (past the context, `rows` repeats its last row: read, never kept).
 * A head's chains and reductions depend on its context and t only, never on the heads beside it.
 *
 * scores: every quad of the context, its K rows loaded once per tile of HEAD_TILE heads (a tile whose
 * heads' contexts all end before the quad skipped); scores64 the same chains and reductions with the
 * rows loaded once for all heads (a prompt's run of 8 rows is 8 tiles or more: reloading and converting
 * each quad per tile cost more than the FMAs it feeds at this width).
 *
 * values: each head's weighted sum of V, V_CHUNK heads and one PANEL of elements in registers at a time,
 * one FMA chain per output element in position order; panel_span the positions from..to, RAGGED (a
 * constant once inlined) where some heads' contexts end inside them. */
#define DEFINE_TASK(SUFFIX, T, LOAD16, PAD)                                                                   \
static inline __attribute__((always_inline)) void quad_scores_##SUFFIX(const int NH, const Queries *qs,    \
        int64_t a0, const T *const *rows, int64_t t, int64_t hd, float scale, float *scores) {             \
    __m512 s[HEAD_TILE][4];                                                                                 \
    {                                                                                                       \
        __m512 k[4];                                                                                        \
        for (int u = 0; u < 4; u++) k[u] = LOAD16(rows[u], 0, hd);                                          \
        for (int a = 0; a < NH; a++) {                                                                      \
            const __m512 qa = _mm512_loadu_ps(qs->q[a0 + a]);                                               \
            for (int u = 0; u < 4; u++) s[a][u] = _mm512_mul_ps(qa, k[u]);                                  \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t i = 1; i < hd / 16; i++) {                                                                 \
        __m512 k[4];                                                                                        \
        for (int u = 0; u < 4; u++) k[u] = LOAD16(rows[u], i, hd);                                          \
        for (int a = 0; a < NH; a++) {                                                                      \
            const __m512 qa = _mm512_loadu_ps(qs->q[a0 + a] + 16 * i);                                      \
            for (int u = 0; u < 4; u++) s[a][u] = _mm512_fmadd_ps(qa, k[u], s[a][u]);                       \
        }                                                                                                   \
    }                                                                                                       \
    for (int a = 0; a < NH; a++) {                                                                          \
        float *sc = scores + (a0 + a) * qs->n + t;                                                          \
        const int64_t seen = qs->ctx[a0 + a] - t;                                                           \
        if (seen >= 4) {                                                                                    \
            _mm_storeu_ps(sc, _mm_mul_ps(sum4(s[a][0], s[a][1], s[a][2], s[a][3]), _mm_set1_ps(scale)));    \
        } else {                                                                                            \
            for (int u = 0; u < 4; u++) /* unrolled: registers, not memory */                               \
                if (u < seen) sc[u] = _mm512_reduce_add_ps(s[a][u]) * scale;                                 \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
static void scores64_##SUFFIX(const Queries *qs, int64_t ctx, const T *k, const int64_t *offsets, float scale, \
                              float *scores) {                                                              \
    const size_t row_bytes = 64 * sizeof(T) + PAD;                                                          \
    int64_t t = 0;                                                                                          \
    for (; t + 4 <= ctx; t += 4) {                                                                          \
        __m512 kr[4][4];                                                                                    \
        for (int u = 0; u < 4; u++) {                                                                       \
            if (t + u + PREFETCH_AHEAD < ctx) prefetch_row(k + offsets[t + u + PREFETCH_AHEAD], row_bytes); \
            for (int i = 0; i < 4; i++) kr[u][i] = LOAD16(k + offsets[t + u], i, 64);                      \
        }                                                                                                   \
        for (int64_t a = 0; a < qs->heads; a++) {                                                           \
            const float *q = qs->q[a];                                                                      \
            float *sc = scores + a * qs->n + t;                                                             \
            if (t + 4 <= qs->ctx[a]) {                                                                      \
                __m512 s[4];                                                                                \
                for (int u = 0; u < 4; u++) {                                                               \
                    s[u] = _mm512_mul_ps(_mm512_loadu_ps(q), kr[u][0]);                                     \
                    for (int i = 1; i < 4; i++) s[u] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), kr[u][i], s[u]); \
                }                                                                                           \
                _mm_storeu_ps(sc, _mm_mul_ps(sum4(s[0], s[1], s[2], s[3]), _mm_set1_ps(scale)));            \
            } else {                                                                                        \
                for (int u = 0; t + u < qs->ctx[a]; u++) sc[u] = one_score64(q, kr[u], scale);              \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    for (; t < ctx; t++) {                                                                                  \
        __m512 kr[4];                                                                                       \
        for (int i = 0; i < 4; i++) kr[i] = LOAD16(k + offsets[t], i, 64);                                  \
        for (int64_t a = 0; a < qs->heads; a++)                                                             \
            if (t < qs->ctx[a]) scores[a * qs->n + t] = one_score64(qs->q[a], kr, scale);                   \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
static void scores_##SUFFIX(const Queries *qs, int64_t ctx, const T *k, const int64_t *offsets, int64_t hd, \
                            float scale, float *scores) {                                                   \
    if (hd == 64) { scores64_##SUFFIX(qs, ctx, k, offsets, scale, scores); return; }                        \
    const size_t row_bytes = (size_t)hd * sizeof(T) + PAD;                                                  \
    int64_t tile_ctx[MAX_TILES]; /* the longest context among each tile's heads */                          \
    for (int64_t a0 = 0; a0 < qs->heads; a0 += HEAD_TILE) {                                                 \
        int64_t longest = 0;                                                                                \
        for (int64_t a = a0; a < min64(a0 + HEAD_TILE, qs->heads); a++) longest = qs->ctx[a] > longest ? qs->ctx[a] : longest; \
        tile_ctx[a0 / HEAD_TILE] = longest;                                                                 \
    }                                                                                                       \
    for (int64_t t = 0; t < ctx; t += 4) {                                                                  \
        const T *rows[4];                                                                                   \
        for (int u = 0; u < 4; u++) {                                                                       \
            if (t + u + PREFETCH_AHEAD < ctx) prefetch_row(k + offsets[t + u + PREFETCH_AHEAD], row_bytes); \
            rows[u] = k + offsets[min64(t + u, ctx - 1)];                                                   \
        }                                                                                                   \
        for (int64_t a0 = 0; a0 < qs->heads; a0 += HEAD_TILE) {                                             \
            if (t >= tile_ctx[a0 / HEAD_TILE]) continue;                                                    \
            switch (min64(HEAD_TILE, qs->heads - a0)) { /* each a copy with its accumulators in registers */ \
            case 4: quad_scores_##SUFFIX(4, qs, a0, rows, t, hd, scale, scores); break;                     \
            case 3: quad_scores_##SUFFIX(3, qs, a0, rows, t, hd, scale, scores); break;                     \
            case 2: quad_scores_##SUFFIX(2, qs, a0, rows, t, hd, scale, scores); break;                     \
            default: quad_scores_##SUFFIX(1, qs, a0, rows, t, hd, scale, scores); break;                    \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
static inline __attribute__((always_inline)) void panel_span_##SUFFIX(const int RAGGED,                    \
        __m512 acc[V_CHUNK][PANEL / 16], const T *vp, int64_t rest, const float *const *sc, const int64_t *ctxs, \
        int64_t nc, const int64_t *offsets, int64_t from, int64_t to, const T *ahead_rows, size_t row_bytes,  \
        int64_t ctx) {                                                                                      \
    for (int64_t t = from; t < to; t++) {                                                                   \
        if (ahead_rows && t + PREFETCH_AHEAD < ctx) prefetch_row(ahead_rows + offsets[t + PREFETCH_AHEAD], row_bytes); \
        const T *vt = vp + offsets[t]; /* the panel; an int8 row's scale `rest` further on */               \
        __m512 x[PANEL / 16];                                                                               \
        for (int i = 0; i < PANEL / 16; i++) x[i] = LOAD16(vt, i, rest);                                    \
        for (int c = 0; c < V_CHUNK; c++) if (c < nc && (!RAGGED || t < ctxs[c])) {                         \
            const __m512 p = _mm512_set1_ps(sc[c][t]);                                                      \
            for (int i = 0; i < PANEL / 16; i++) acc[c][i] = _mm512_fmadd_ps(p, x[i], acc[c][i]);           \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
static void values_##SUFFIX(const Queries *qs, const T *v, const int64_t *offsets, int64_t hd,              \
                            const float *scores, float *const *out) {                                       \
    const size_t row_bytes = (size_t)hd * sizeof(T) + PAD;                                                  \
    for (int64_t c0 = 0; c0 < qs->heads; c0 += V_CHUNK) {                                                   \
        const int64_t nc = min64(qs->heads - c0, V_CHUNK);                                                  \
        int64_t shortest = qs->ctx[c0], longest = 0, ctxs[V_CHUNK];                                          \
        const float *sc[V_CHUNK];                                                                           \
        for (int c = 0; c < V_CHUNK; c++) {                                                                 \
            ctxs[c] = c < nc ? qs->ctx[c0 + c] : 0;                                                         \
            sc[c] = scores + (c0 + min64(c, nc - 1)) * qs->n;                                               \
            longest = ctxs[c] > longest ? ctxs[c] : longest;                                                \
            shortest = c < nc && ctxs[c] < shortest ? ctxs[c] : shortest;                                   \
        }                                                                                                   \
        for (int64_t d0 = 0; d0 < hd; d0 += PANEL) {                                                        \
            /* a chunk's first panel brings each row in whole (a later chunk's heads may see further than   \
             * the first's); its later panels find the rows in L2 */                                        \
            const T *ahead_rows = d0 == 0 ? v : NULL;                                                       \
            __m512 acc[V_CHUNK][PANEL / 16];                                                                \
            for (int c = 0; c < V_CHUNK; c++) /* unrolled: registers, not memory */                         \
                for (int i = 0; i < PANEL / 16; i++) acc[c][i] = _mm512_setzero_ps();                       \
            /* the positions every head of the chunk sees, then each the rest of its own */                 \
            panel_span_##SUFFIX(0, acc, v + d0, hd - d0, sc, ctxs, nc, offsets, 0, shortest, ahead_rows, row_bytes, longest); \
            panel_span_##SUFFIX(1, acc, v + d0, hd - d0, sc, ctxs, nc, offsets, shortest, longest, ahead_rows, row_bytes, longest); \
            for (int c = 0; c < V_CHUNK; c++) if (c < nc) /* unrolled: registers, not memory */            \
                for (int i = 0; i < PANEL / 16; i++) _mm512_storeu_ps(out[c0 + c] + d0 + 16 * i, acc[c][i]); \
        }                                                                                                   \
    }                                                                                                       \
}

/* The entry point: one OpenMP task per (run of up to MAX_RUN rows reading one context, KV head). */
#define DEFINE_ATTENTION(SUFFIX, T, PAD)                                                                      \
int paged_decode_attention_avx512_##SUFFIX(const float *q, const void *k_cache, const void *v_cache,       \
                                           const int64_t *tables, int64_t max_blocks,                       \
                                           const int64_t *context_lens, int64_t num_seqs, int64_t num_heads, \
                                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,      \
                                           float scale, float *out) {                                       \
    if (head_dim <= 0 || head_dim % PANEL || head_dim > MAX_HEAD_DIM || num_kv_heads <= 0                   \
        || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP) return -2;                     \
    const int64_t group = num_heads / num_kv_heads, hd = head_dim;                                          \
    const int64_t slot_stride = num_kv_heads * (hd + PAD);                                                  \
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
            const int64_t at = ((r0 + a / group) * num_heads + kvh * group + a % group) * hd;               \
            qs.q[a] = q + at;                                                                               \
            outs[a] = out + at;                                                                             \
            qs.ctx[a] = context_lens[r0 + a / group];                                                       \
        }                                                                                                   \
        qs.n = ctx > 0 ? ctx : 1;                                                                           \
        int64_t stack_buf[STACK_WORDS];                                                                     \
        int64_t *offsets = task_buffer(qs.n, qs.heads, stack_buf); /* then a score row per head */         \
        if (!offsets) { failed = 1; continue; }                                                             \
        float *scores = (float *)(offsets + qs.n);                                                          \
        context_offsets(tables + longest * max_blocks, ctx, block_size, slot_stride, kvh * (hd + PAD), offsets);\
        scores_##SUFFIX(&qs, ctx, k_cache, offsets, hd, scale, scores);                                     \
        for (int64_t a = 0; a < qs.heads; a++) softmax_row(scores + a * qs.n, qs.ctx[a]);                   \
        values_##SUFFIX(&qs, v_cache, offsets, hd, scores, outs);                                           \
        if (offsets != stack_buf) free(offsets);                                                            \
    }                                                                                                       \
    free(starts);                                                                                           \
    return failed ? -1 : 0;                                                                                 \
}

DEFINE_TASK(f32, float, load16_f32, 0)
DEFINE_TASK(f16, uint16_t, load16_f16, 0)
DEFINE_TASK(q8, int8_t, load16_q8, KV_SCALE_BYTES)

/* Arguments as paged_decode_attention_f32/_f16/_q8 in paged_attention.c; returns -2 for a shape it does
 * not take (head_dim not a multiple of PANEL up to MAX_HEAD_DIM, more than MAX_GROUP query heads per KV
 * head, or heads that do not make whole groups). */
DEFINE_ATTENTION(f32, float, 0)
DEFINE_ATTENTION(f16, uint16_t, 0)
DEFINE_ATTENTION(q8, int8_t, KV_SCALE_BYTES)
