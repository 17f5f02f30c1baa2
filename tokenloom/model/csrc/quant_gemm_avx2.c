/* quant_gemm.c's kernels for CPUs without AVX512-BF16 (AVX2 + FMA + F16C):
 *   int4_gemm: y[M, N] = x[M, K] @ W[N, K]^T over the GGUF's Q4_1 blocks (the decoder's projections),
 *     in its own code layout (model/linear.py pack_avx2_layout; scales and offsets as quant_gemm.c's,
 *     offsets NULL for symmetric codes);
 *   int5_gemm: the same with 5-bit codes (Q5_0's): the nibbles plus a plane of fifth bits, uint8
 *     [N/16][K/32][4 jj/2][16 lanes], bit 4 (jj % 2) + t the one of nibble t of the lane in slot jj;
 *   int8_gemm: the same over per-column int8 weights (the LM head's approximate logits), quant_gemm.c's
 *     layout, the same int16 activations;
 *   int8g_gemm: int8 weights with a scale per group of 32 inputs and column (quant_gemm.c's int8g).
 *
 * int4: the activations rounded to int16 per group of 32 with a power-of-two scale (15 bits relative to
 * the group's largest; bfloat16 keeps 8 relative to each value), then per group of 32 weights
 * y += d * scale * sum(q_x * q) + m * sum(x), the integer sums exact in int32 by vpmaddwd (16
 * multiply-adds an instruction where an FMA does 8). The codes are laid out so that one 32-byte load,
 * three shifts and three masks give four vpmaddwd operands. Against float32 activations and FMAs
 * (the kernel before): 1.44x at 32 rows, 1.9x at 1 row, measured with the CPU held to AVX2.
 *
 * Batch invariance: each output element accumulates over k in one fixed order whatever tile its row
 * falls in; threads split the column blocks.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define GROUP 32
#define COLS 16      /* output columns per column block: two ymm */
#define TILE_ROWS 4  /* int4: 4 rows x 2 accumulators + 4 code vectors + 2 broadcasts fit in 16 ymm */

#define PREFETCH_GROUPS 8  /* the codes this many groups on are asked for: batch-1 decode is DRAM-bound */

#define INLINE static inline __attribute__((always_inline))

/* One row's group of 32 inputs as int16 with a power-of-two scale: x ~= scale * q, |q| <= 32767, so
 * every input keeps 15 bits relative to its group's largest (bfloat16 keeps 8 relative to itself).
 * Also the group's exact float sum, for Q4_1's offset term. A non-finite group gets a NaN scale, so
 * it reaches the outputs as the float32 path would let it. */
INLINE void quantize_group(const float *x, int16_t *q, float *scale, float *sum) {
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
    const __m256 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 big = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, magnitude), _mm256_and_ps(x1, magnitude)),
                               _mm256_max_ps(_mm256_and_ps(x2, magnitude), _mm256_and_ps(x3, magnitude)));
    __m256 total = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    const float largest = _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    *sum = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    float inverse = 0.0f;
    if (!(fabsf(*sum) <= FLT_MAX && largest <= FLT_MAX)) {  /* a NaN or an infinity (the sum keeps NaNs) */
        *scale = NAN;
    } else if (largest < 1e-30f) {  /* (nearly) all zeros: nothing to multiply */
        *scale = 0.0f;
    } else {
        int e;
        frexpf(largest, &e);  /* largest = f * 2^e with f in [0.5, 1), so largest / 2^(e-15) < 32768 */
        *scale = ldexpf(1.0f, e - 15);
        inverse = ldexpf(1.0f, 15 - e);
    }
    const __m256 inv = _mm256_set1_ps(inverse);
    /* round to nearest, then pack with signed saturation (a rounded 32767.5 stays 32767) */
    const __m256i q01 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x0, inv)), _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv)));
    const __m256i q23 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x2, inv)), _mm256_cvtps_epi32(_mm256_mul_ps(x3, inv)));
    _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(q01, 0xD8));  /* packs interleaves 128-bit lanes */
    _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(q23, 0xD8));
}

/* Rows [0, MR) x column block nb. Per group of 32 inputs: y += d * scale * sum(q * code) + m * sum(x),
 * the integer dot products by vpmaddwd (two inputs' codes times the same two activations, added, per
 * column) in int32 registers, exact; the running outputs in y (L1).
 * Codes: per (column block, group, jj in 0..7) 16 int16 lanes of four nibbles; nibble t of lane 2c + p
 * is the code of column 8 (t % 2) + c, input 32g + 4jj + 2 (t / 2) + p. */
INLINE void tile(const int16_t *xq, const float *xscale, const float *sums, int64_t K, int64_t G, const int MR,
                 const uint8_t *codes, const uint8_t *hi, const uint16_t *scale, const uint16_t *offset, int64_t nb,
                 float *y, int64_t N) {
    __m256i acc[TILE_ROWS][2], fifth = _mm256_setzero_si256();
    const __m256i low = _mm256_set1_epi16(0x0F), sixteen = _mm256_set1_epi16(16);
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(y + r * N + nb * COLS, _mm256_setzero_ps());
        _mm256_storeu_ps(y + r * N + nb * COLS + 8, _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        const uint8_t *cg = codes + (nb * G + g) * (GROUP / 2) * COLS;
        for (int line = 0; line < GROUP / 2 * COLS; line += 64)  /* PREFETCH_GROUPS on (past the block: the share's next) */
            __builtin_prefetch(cg + PREFETCH_GROUPS * GROUP / 2 * COLS + line);
        for (int jj = 0; jj < GROUP / 4; jj++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(cg + jj * 32));
            __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), low), w3 = _mm256_srli_epi16(v, 12);
            if (hi) {  /* + 16 where the code's fifth bit is set: nibble t's comes from bit 4 + t of `bits` */
                if (jj % 2 == 0)  /* a byte per lane for this slot and the next, widened to the lane */
                    fifth = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(hi + ((nb * G + g) * 4 + jj / 2) * 16)));
                const __m256i bits = jj % 2 ? fifth : _mm256_slli_epi16(fifth, 4);
                w0 = _mm256_or_si256(w0, _mm256_and_si256(bits, sixteen));
                w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_srli_epi16(bits, 1), sixteen));
                w2 = _mm256_or_si256(w2, _mm256_and_si256(_mm256_srli_epi16(bits, 2), sixteen));
                w3 = _mm256_or_si256(w3, _mm256_and_si256(_mm256_srli_epi16(bits, 3), sixteen));
            }
            for (int r = 0; r < MR; r++) {
                int32_t pair[2];  /* activations k, k + 1 and k + 2, k + 3 */
                memcpy(pair, xq + r * K + g * GROUP + 4 * jj, sizeof pair);
                const __m256i xa = _mm256_set1_epi32(pair[0]), xb = _mm256_set1_epi32(pair[1]);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_add_epi32(_mm256_madd_epi16(w0, xa), _mm256_madd_epi16(w2, xb)));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_add_epi32(_mm256_madd_epi16(w1, xa), _mm256_madd_epi16(w3, xb)));
            }
        }
        const int64_t at = (nb * G + g) * COLS;
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + at + 8 * h)));
            const __m256 m = offset ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offset + at + 8 * h)))
                                    : _mm256_mul_ps(_mm256_set1_ps(hi ? -16.0f : -8.0f), d);  /* symmetric */
            for (int r = 0; r < MR; r++) {
                float *o = y + r * N + nb * COLS + 8 * h;
                const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(xscale[r * G + g]));
                const __m256 out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), dx, _mm256_loadu_ps(o));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(sums[r * G + g]), m, out));
            }
        }
    }
}

/* The activations [M, K] as int16 groups (quantize_group): one buffer, freed with free(rows.xq). */
typedef struct { int16_t *xq; float *scale, *sum; } Int16Rows;

static Int16Rows quantize_rows(const float *x, int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    Int16Rows rows = {malloc(sizeof(int16_t) * (size_t)(M * K) + sizeof(float) * (size_t)(2 * M * G) + 1), NULL, NULL};
    if (!rows.xq) return rows;
    rows.scale = (float *)(rows.xq + M * K);  /* M * K int16 = an even number of 4-byte floats before it */
    rows.sum = rows.scale + M * G;
    for (int64_t i = 0; i < M * G; i++) quantize_group(x + i * GROUP, rows.xq + i * GROUP, rows.scale + i, rows.sum + i);
    return rows;
}

/* int4 (hi NULL) or int5, in the layouts above. Returns 0, or 1 when the activations' int16 buffer
 * cannot be allocated. */
static int low_bit_gemm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *hi,
                        const uint16_t *scale, const uint16_t *offset, int64_t N, float *y) {
    const int64_t G = K / GROUP, blocks = N / COLS;
    const Int16Rows rows = quantize_rows(x, M, K);
    if (!rows.xq) return 1;
    const int64_t share = gemm_share_blocks(G, blocks);
#pragma omp parallel for schedule(dynamic, share)
    for (int64_t nb = 0; nb < blocks; nb++) {
        for (int64_t m = 0, mr; m < M; m += mr) {
            mr = gemm_tile_rows(M - m, TILE_ROWS);
            const int16_t *xm = rows.xq + m * K;
            const float *sm = rows.sum + m * G, *cm = rows.scale + m * G;
            float *ym = y + m * N;
            switch (mr) {
                case 4: tile(xm, cm, sm, K, G, 4, codes, hi, scale, offset, nb, ym, N); break;
                case 3: tile(xm, cm, sm, K, G, 3, codes, hi, scale, offset, nb, ym, N); break;
                case 2: tile(xm, cm, sm, K, G, 2, codes, hi, scale, offset, nb, ym, N); break;
                default: tile(xm, cm, sm, K, G, 1, codes, hi, scale, offset, nb, ym, N); break;
            }
        }
    }
    free(rows.xq);
    return 0;
}

int int4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
              const uint16_t *offset, int64_t N, float *y) {
    return low_bit_gemm(x, M, K, codes, NULL, scale, offset, N, y);
}

int int5_gemm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint32_t *hi,
              const uint16_t *scale, const uint16_t *offset, int64_t N, float *y) {
    return low_bit_gemm(x, M, K, codes, (const uint8_t *)hi, scale, offset, N, y);
}

/* int4_gemm's column blocks into a per-thread buffer, each row's `keep` largest outputs kept as they come
 * (kernels.h): the LM head's greedy scan, 16 columns of output at a time where the whole is 600 KB a row. */
int int4_top(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
             const uint16_t *offset, int64_t N, int64_t keep, int64_t slots, float *top_values, int32_t *top_ids,
             uint8_t *unordered) {
    const int64_t G = K / GROUP, blocks = N / COLS;
    const Int16Rows rows = quantize_rows(x, M, K);
    float *blocks_out = malloc(sizeof(float) * slots * M * COLS);
    if (!rows.xq || !blocks_out) {
        free(rows.xq);
        free(blocks_out);
        return 1;
    }
#pragma omp parallel num_threads(slots)
    {
        const int64_t slot = omp_get_thread_num();
        float *y = blocks_out + slot * M * COLS;
#pragma omp for schedule(dynamic, gemm_share_blocks(G, blocks))
        for (int64_t nb = 0; nb < blocks; nb++) {
            const int64_t at = nb * G * COLS;
            for (int64_t m = 0, mr; m < M; m += mr) {
                mr = gemm_tile_rows(M - m, TILE_ROWS);
                const int16_t *xm = rows.xq + m * K;
                const float *sm = rows.sum + m * G, *cm = rows.scale + m * G;
                const uint8_t *c = codes + at * (GROUP / 2);
                const uint16_t *o = offset ? offset + at : NULL;
                switch (mr) {
                    case 4: tile(xm, cm, sm, K, G, 4, c, NULL, scale + at, o, 0, y + m * COLS, COLS); break;
                    case 3: tile(xm, cm, sm, K, G, 3, c, NULL, scale + at, o, 0, y + m * COLS, COLS); break;
                    case 2: tile(xm, cm, sm, K, G, 2, c, NULL, scale + at, o, 0, y + m * COLS, COLS); break;
                    default: tile(xm, cm, sm, K, G, 1, c, NULL, scale + at, o, 0, y + m * COLS, COLS); break;
                }
            }
            for (int64_t r = 0; r < M; r++) {
                float *vals = top_values + (slot * M + r) * keep;
                int32_t *ids = top_ids + (slot * M + r) * keep;
                const float *v = y + r * COLS;
                const __m256 last = _mm256_set1_ps(vals[keep - 1]);
                /* not <= the list's last: larger, or NaN (which no comparison takes in) */
                unsigned in = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v), last, _CMP_NLE_UQ))
                              | (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + 8), last, _CMP_NLE_UQ)) << 8;
                for (; in; in &= in - 1) {
                    const int col = __builtin_ctz(in);
                    if (v[col] != v[col])
                        unordered[slot * M + r] = 1;
                    else if (v[col] > vals[keep - 1])  /* the last may have risen since the mask */
                        top_insert(vals, ids, keep, v[col], (int32_t)(nb * COLS + col));
                }
            }
        }
    }
    free(rows.xq);
    free(blocks_out);
    return 0;
}

/* --- int8: codes [N/16][K/2][16][2] (each column's pair of inputs side by side), scales float32 [N] ----
 * The same int16 activations: per pair of inputs, sign-extending 16 bytes gives vpmaddwd's operand for
 * 8 columns as they lie. Per group of 32 the int32 sums meet the group's activation scale (no overflow:
 * 32 * 127 * 32767 < 2^31), and each column's own scale at the end. */

/* `gscale` NULL: per-column `scale` at the end; else a scale per group and column [N/16][G][16] that
 * meets each group's sums with the activations' scale. */
INLINE void tile8(const int16_t *xq, const float *xscale, int64_t K, int64_t G, const int MR, const int8_t *codes,
                  const float *scale, const float *gscale, int64_t nb, float *y, int64_t N) {
    __m256i acc[TILE_ROWS][2];
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(y + r * N + nb * COLS, _mm256_setzero_ps());
        _mm256_storeu_ps(y + r * N + nb * COLS + 8, _mm256_setzero_ps());
    }
    const int8_t *cb = codes + nb * (K / 2) * COLS * 2;
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < GROUP / 2; j++) {
            const int8_t *cj = cb + (g * GROUP / 2 + j) * 2 * COLS;
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)cj));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(cj + COLS)));
            for (int r = 0; r < MR; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * K + g * GROUP + 2 * j, sizeof pair);
                const __m256i xp = _mm256_set1_epi32(pair);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xp));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xp));
            }
        }
        for (int r = 0; r < MR; r++) {  /* the running outputs in y (L1), as int4's */
            const __m256 xs = _mm256_set1_ps(xscale[r * G + g]);
            for (int h = 0; h < 2; h++) {
                float *o = y + r * N + nb * COLS + 8 * h;
                const __m256 f = gscale ? _mm256_mul_ps(xs, _mm256_loadu_ps(gscale + (nb * G + g) * COLS + 8 * h)) : xs;
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), f, _mm256_loadu_ps(o)));
            }
        }
    }
    if (gscale) return;
    for (int h = 0; h < 2; h++) {
        const __m256 s = _mm256_loadu_ps(scale + nb * COLS + 8 * h);
        for (int r = 0; r < MR; r++) {
            float *o = y + r * N + nb * COLS + 8 * h;
            _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), s));
        }
    }
}

static int int8_any(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale,
                    const float *gscale, int64_t N, float *y) {
    const int64_t G = K / GROUP, blocks = N / COLS;
    const Int16Rows rows = quantize_rows(x, M, K);
    if (!rows.xq) return 1;
    const int64_t share = gemm_share_blocks(G, blocks);
#pragma omp parallel for schedule(dynamic, share)
    for (int64_t nb = 0; nb < blocks; nb++) {
        for (int64_t m = 0, mr; m < M; m += mr) {
            mr = gemm_tile_rows(M - m, TILE_ROWS);
            const int16_t *xm = rows.xq + m * K;
            const float *cm = rows.scale + m * G;
            float *ym = y + m * N;
            switch (mr) {
                case 4: tile8(xm, cm, K, G, 4, codes, scale, gscale, nb, ym, N); break;
                case 3: tile8(xm, cm, K, G, 3, codes, scale, gscale, nb, ym, N); break;
                case 2: tile8(xm, cm, K, G, 2, codes, scale, gscale, nb, ym, N); break;
                default: tile8(xm, cm, K, G, 1, codes, scale, gscale, nb, ym, N); break;
            }
        }
    }
    free(rows.xq);
    return 0;
}

/* Same signature and layout as quant_gemm.c's int8_gemm (K a multiple of 32, N of 16). Returns 0, or 1
 * when the activations' int16 buffer cannot be allocated. */
int int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale, int64_t N, float *y) {
    return int8_any(x, M, K, codes, scale, NULL, N, y);
}

/* Same signature and layout as quant_gemm.c's int8g_gemm. */
int int8g_gemm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *gscale, int64_t N, float *y) {
    return int8_any(x, M, K, codes, NULL, gscale, N, y);
}
