/* quant_gemm.c's kernels for CPUs without AVX512-BF16 (AVX2 + FMA + F16C):
 *   int4_gemm: y[M, N] = x[M, K] @ W[N, K]^T over the GGUF's Q4_1 blocks (the decoder's projections),
 *     in its own code layout (model/quant/layouts.py pack_avx2_layout, `slot_codes` below; scales and offsets
 *     as quant_gemm.c's, offsets NULL for symmetric codes);
 *   int5_gemm: the same with 5-bit codes (Q5_0's): the nibbles plus two planes of fifth bits a group;
 *   int8_gemm: int8 weights, a scale per column (the LM head's approximate logits), quant_gemm.c's layout;
 *   int8g_gemm: int8 weights with a scale per group of 32 inputs and column (quant_gemm.c's int8g).
 *
 * int4 / int5: the activations rounded to int8 per group of 32 (llama.cpp's Q8_0, its outliers left out
 * and kept in float32: quantize_group8), then per group y += d * scale * sum(q_x * q) + m * sum(x), the
 * integer sums by vpmaddubsw: 32 multiply-adds an instruction where vpmaddwd over int16 activations (the
 * kernel before) does 16 and an FMA 8. Zen 3, Qwen2.5-0.5B's projections at 32 rows: int4 (down)
 * 1.40 -> 0.87 ms, int5 (gate/up) 3.34 -> 2.15 ms; at one row gate/up 221 -> 177 us.
 * int8: the activations rounded to int16 per group of 32 with a power-of-two scale (15 bits relative to
 * the group's largest), the sums by vpmaddwd: vpmaddubsw's pairs of int8 products would overflow int16.
 *
 * Batch invariance: each output element accumulates over k in one fixed order whatever tile its row
 * falls in; threads split the column blocks; a row's rounding is its own.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_rows.h"
#include "simd_avx2.h"

#define COLS 16      /* output columns per column block: two ymm */
#define TILE_ROWS 4  /* 4 rows x 2 accumulators + code vectors and broadcasts fit in 16 ymm */
_Static_assert(TILE_ROWS <= OUTLIER_WALK_ROWS, "add_outliers walks at most OUTLIER_WALK_ROWS rows");

#define PREFETCH_GROUPS 8  /* the codes this many groups on are asked for: batch-1 decode is DRAM-bound */

#define INLINE static inline __attribute__((always_inline))

/* One row's group of 32 inputs as int16 with a power-of-two scale (the int8 weights' activations):
 * x ~= scale * q, |q| <= 32767, every input keeping 15 bits relative to its group's largest. A
 * non-finite group gets a NaN scale. */
INLINE void quantize_group16(const float *x, int16_t *q, float *scale) {
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
    const __m256 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const float largest = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, magnitude), _mm256_and_ps(x1, magnitude)),
                                              _mm256_max_ps(_mm256_and_ps(x2, magnitude), _mm256_and_ps(x3, magnitude))));
    const float any = hsum8(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));  /* keeps NaNs, infinities */
    float inverse = 0.0f;
    if (!(fabsf(any) <= FLT_MAX && largest <= FLT_MAX)) {
        *scale = NAN;
    } else if (largest < 1e-30f) {
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

/* Bit `b` of each byte of `bits` moved to bit 4 (16, the fifth bit of a code), the rest cleared. */
INLINE __m256i fifth_bit(__m256i bits, int b, __m256i sixteen) {
    const __m256i at4 = b < 4 ? _mm256_slli_epi16(bits, 4 - b) : b > 4 ? _mm256_srli_epi16(bits, b - 4) : bits;
    return _mm256_and_si256(at4, sixteen);
}

/* The codes of slot jj of a group as vpmaddubsw's unsigned operands, columns 0-7 (w0) and 8-15 (w1).
 * Codes: per (column block, group, slot jj in 0..7) 32 bytes; byte 4c + p holds in its low nibble the
 * code of column c, input 4jj + p of the group, in its high nibble column 8 + c's. Fifth bits (`planes`
 * NULL for 4-bit codes): two 32-byte planes a group, bit b of byte i of plane h the fifth bit of byte i
 * of code vector 8h + b (vector 2jj the low nibbles of slot jj, 2jj + 1 the high). */
INLINE void slot_codes(const uint8_t *cg, const uint8_t *planes, int jj, __m256i *w0, __m256i *w1) {
    const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(cg + jj * 32));
    *w0 = _mm256_and_si256(v, low);
    *w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if (planes) {
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(planes + jj / 4 * 32));
        *w0 = _mm256_or_si256(*w0, fifth_bit(plane, 2 * (jj % 4), sixteen));
        *w1 = _mm256_or_si256(*w1, fifth_bit(plane, 2 * (jj % 4) + 1, sixteen));
    }
}

/* Input k of a group's codes for its 16 columns as float32: columns 0-7 (*c0) and 8-15 (*c1). In slot
 * k / 4, 32-bit lane c holds inputs 4(k / 4) .. + 3 of columns c and 8 + c, input k in byte k % 4. */
INLINE void input_codes(const uint8_t *cg, const uint8_t *planes, int k, __m256 *c0, __m256 *c1) {
    const int jj = k / 4;
    const __m128i shift = _mm_cvtsi32_si128(8 * (k % 4));
    const __m256i b = _mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(cg + jj * 32)), shift),
                                       _mm256_set1_epi32(0xFF));
    __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(0x0F)), hi = _mm256_srli_epi32(b, 4);
    if (planes) {  /* bits 2(jj % 4) and + 1 of the same byte of plane jj / 4 */
        const __m256i bits = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(planes + jj / 4 * 32)), shift);
        const __m256i one = _mm256_set1_epi32(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 2 * (jj % 4)), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 2 * (jj % 4) + 1), one), 4));
    }
    *c0 = _mm256_cvtepi32_ps(lo);
    *c1 = _mm256_cvtepi32_ps(hi);
}

/* The tile's rows' outliers times their weights in column block nb, d * x * code, into their 16 outputs
 * each (their offsets are in their groups' sums), the rows' lists walked together (quant_rows.h). After
 * the tile: inlined in it they cost its loop registers. */
static void add_outliers(const QuantRows *rows, int64_t row0, int MR, int64_t G, const uint8_t *codes,
                         const uint8_t *hi, const uint16_t *scale, int64_t nb, float *y, int64_t N) {
    OutlierWalk walk = outlier_walk(rows, row0, MR, G);
    for (int32_t k; (k = outlier_walk_next(&walk)) != INT32_MAX;) {
        const int64_t group = nb * G + k / GROUP;
        __m256 c[2], d[2];
        input_codes(codes + group * (GROUP / 2) * COLS, hi ? hi + group * 64 : NULL, k % GROUP, &c[0], &c[1]);
        for (int h = 0; h < 2; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + group * COLS + 8 * h)));
        for (int r = 0; r < MR; r++) {
            float x, *o = y + r * N;
            if (!outlier_walk_take(&walk, r, k, &x)) continue;
            const __m256 xv = _mm256_set1_ps(x);
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(c[h], _mm256_mul_ps(d[h], xv), _mm256_loadu_ps(o + 8 * h)));
        }
    }
}

/* Every row's outliers (quant_rows.h's index) times their weights in column block nb, as add_outliers
 * adds a tile's. */
static void add_indexed_outliers(const OutlierIndex *ix, int64_t G, const uint8_t *codes, const uint8_t *hi,
                                 const uint16_t *scale, int64_t nb, float *y, int64_t N) {
    for (int32_t i = 0; i < ix->count; i++) {
        const int32_t k = ix->inputs[i];
        const int64_t group = nb * G + k / GROUP;
        __m256 c[2], d[2];
        input_codes(codes + group * (GROUP / 2) * COLS, hi ? hi + group * 64 : NULL, k % GROUP, &c[0], &c[1]);
        for (int h = 0; h < 2; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + group * COLS + 8 * h)));
        for (int32_t e = ix->first[i]; e < ix->first[i + 1]; e++) {
            float *o = y + (int64_t)ix->row[e] * N;
            const __m256 xv = _mm256_set1_ps(ix->x[e]);
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(c[h], _mm256_mul_ps(d[h], xv), _mm256_loadu_ps(o + 8 * h)));
        }
    }
}

/* Rows [0, MR) x column block nb. Per group of 32 inputs: y += d * xscale * dot + m * xsum, then each
 * outlier's d * x * code (when `walk`; else the column block's pass adds them, add_indexed_outliers);
 * the running outputs in y (L1). The integer dot products by vpmaddubsw (the
 * codes unsigned, the activations signed: a multiply for 32 products and pair sums where vpmaddwd gives
 * 16), summed in int16 over the group (int4: 8 * 2 * 15 * 127 < 2^15) or half of it (5-bit codes to 31),
 * then widened. */
INLINE void tile(const QuantRows *rows, int64_t row0, int64_t K, int64_t G, const int MR, const uint8_t *codes,
                 const uint8_t *hi, const uint16_t *scale, const uint16_t *offset, int64_t nb, float *y, int64_t N,
                 int walk) {
    const int8_t *xq = rows->q + row0 * K;
    const float *xscale = rows->scale + row0 * G, *sums = rows->sum + row0 * G;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[TILE_ROWS][2], half[TILE_ROWS][2];
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(y + r * N + nb * COLS, _mm256_setzero_ps());
        _mm256_storeu_ps(y + r * N + nb * COLS + 8, _mm256_setzero_ps());
        half[r][0] = half[r][1] = _mm256_setzero_si256();
    }
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *cg = codes + (nb * G + g) * (GROUP / 2) * COLS, *planes = hi ? hi + (nb * G + g) * 64 : NULL;
        for (int line = 0; line < GROUP / 2 * COLS; line += 64)  /* PREFETCH_GROUPS on (past the block: the share's next) */
            __builtin_prefetch(cg + PREFETCH_GROUPS * GROUP / 2 * COLS + line);
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        /* unrolled, the fifth bits' shifts are constants: Qwen2.5-0.5B's gate/up int5 2.63 -> 2.15 ms at 32
         * rows, 230 -> 177 us at 1 (GCC 12 left the loop rolled; the int8 tiles' loop unrolled is slower) */
#pragma GCC unroll 8
        for (int jj = 0; jj < GROUP / 4; jj++) {
            __m256i w0, w1;
            slot_codes(cg, planes, jj, &w0, &w1);
            for (int r = 0; r < MR; r++) {
                int32_t quad;  /* activations 4jj .. 4jj + 3 */
                memcpy(&quad, xq + r * K + g * GROUP + 4 * jj, sizeof quad);
                const __m256i xb = _mm256_set1_epi32(quad);
                acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, xb));
                acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, xb));
            }
            if (hi && jj == GROUP / 8 - 1)  /* 5-bit codes: half a group fills int16; widen, go on from zero */
                for (int r = 0; r < MR; r++)
                    for (int h = 0; h < 2; h++) {
                        half[r][h] = _mm256_madd_epi16(acc[r][h], ones);
                        acc[r][h] = _mm256_setzero_si256();
                    }
        }
        const int64_t at = (nb * G + g) * COLS;
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + at + 8 * h)));
            const __m256 m = offset ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offset + at + 8 * h)))
                                    : _mm256_mul_ps(_mm256_set1_ps(hi ? -16.0f : -8.0f), d);  /* symmetric */
            for (int r = 0; r < MR; r++) {
                float *o = y + r * N + nb * COLS + 8 * h;
                __m256i dot = _mm256_madd_epi16(acc[r][h], ones);
                if (hi) dot = _mm256_add_epi32(dot, half[r][h]);
                const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(xscale[r * G + g]));
                const __m256 out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, _mm256_loadu_ps(o));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(sums[r * G + g]), m, out));
            }
        }
    }
    if (walk) add_outliers(rows, row0, MR, G, codes, hi, scale, nb, y + nb * COLS, N);
}

/* The activations [M, K] as int16 groups (quantize_group16): xq, then the scales; freed with free(). */
static int16_t *quantize_rows16(const float *x, int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(M * K) + sizeof(float) * (size_t)(M * G));
    if (!xq) return NULL;
    float *scales = (float *)(xq + M * K);
    for (int64_t i = 0; i < M * G; i++) quantize_group16(x + i * GROUP, xq + i * GROUP, scales + i);
    return xq;
}

/* int4 (hi NULL) or int5, in the layouts above. Returns 0, or 1 when the activations' buffer or the
 * outlier index cannot be allocated. */
static int low_bit_gemm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *hi,
                        const uint16_t *scale, const uint16_t *offset, int64_t N, float *y) {
    const int64_t G = K / GROUP, blocks = N / COLS;
    const QuantRows rows = quantize_rows8(x, M, K);
    OutlierIndex ix;
    if (!rows.scale || index_outliers(&rows, M, K, TILE_ROWS, &ix)) {
        free(rows.scale);
        return 1;
    }
    const int walk = !ix.inputs;
    const int64_t share = gemm_share_blocks(G, blocks);
#pragma omp parallel for schedule(dynamic, share)
    for (int64_t nb = 0; nb < blocks; nb++) {
        for (int64_t m = 0, mr; m < M; m += mr) {
            mr = gemm_tile_rows(M - m, TILE_ROWS);
            float *ym = y + m * N;
            switch (mr) {
                case 4: tile(&rows, m, K, G, 4, codes, hi, scale, offset, nb, ym, N, walk); break;
                case 3: tile(&rows, m, K, G, 3, codes, hi, scale, offset, nb, ym, N, walk); break;
                case 2: tile(&rows, m, K, G, 2, codes, hi, scale, offset, nb, ym, N, walk); break;
                default: tile(&rows, m, K, G, 1, codes, hi, scale, offset, nb, ym, N, walk); break;
            }
        }
        if (!walk) add_indexed_outliers(&ix, G, codes, hi, scale, nb, y + nb * COLS, N);
    }
    free(ix.inputs);
    free(rows.scale);
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
    const QuantRows rows = quantize_rows8(x, M, K);
    float *blocks_out = malloc(sizeof(float) * slots * M * COLS);
    OutlierIndex ix = {0};
    if (!rows.scale || !blocks_out || index_outliers(&rows, M, K, TILE_ROWS, &ix)) {
        free(rows.scale);
        free(blocks_out);
        return 1;
    }
    const int walk = !ix.inputs;
#pragma omp parallel num_threads(slots)
    {
        const int64_t slot = omp_get_thread_num();
        float *y = blocks_out + slot * M * COLS;
#pragma omp for schedule(dynamic, gemm_share_blocks(G, blocks))
        for (int64_t nb = 0; nb < blocks; nb++) {
            const int64_t at = nb * G * COLS;
            for (int64_t m = 0, mr; m < M; m += mr) {
                mr = gemm_tile_rows(M - m, TILE_ROWS);
                const uint8_t *c = codes + at * (GROUP / 2);
                const uint16_t *o = offset ? offset + at : NULL;
                switch (mr) {
                    case 4: tile(&rows, m, K, G, 4, c, NULL, scale + at, o, 0, y + m * COLS, COLS, walk); break;
                    case 3: tile(&rows, m, K, G, 3, c, NULL, scale + at, o, 0, y + m * COLS, COLS, walk); break;
                    case 2: tile(&rows, m, K, G, 2, c, NULL, scale + at, o, 0, y + m * COLS, COLS, walk); break;
                    default: tile(&rows, m, K, G, 1, c, NULL, scale + at, o, 0, y + m * COLS, COLS, walk); break;
                }
            }
            if (!walk) add_indexed_outliers(&ix, G, codes + at * (GROUP / 2), NULL, scale + at, 0, y, COLS);
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
    free(ix.inputs);
    free(rows.scale);
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
    int16_t *xq = quantize_rows16(x, M, K);
    if (!xq) return 1;
    const float *scales = (const float *)(xq + M * K);
    const int64_t share = gemm_share_blocks(G, blocks);
#pragma omp parallel for schedule(dynamic, share)
    for (int64_t nb = 0; nb < blocks; nb++) {
        for (int64_t m = 0, mr; m < M; m += mr) {
            mr = gemm_tile_rows(M - m, TILE_ROWS);
            const int16_t *xm = xq + m * K;
            const float *cm = scales + m * G;
            float *ym = y + m * N;
            switch (mr) {
                case 4: tile8(xm, cm, K, G, 4, codes, scale, gscale, nb, ym, N); break;
                case 3: tile8(xm, cm, K, G, 3, codes, scale, gscale, nb, ym, N); break;
                case 2: tile8(xm, cm, K, G, 2, codes, scale, gscale, nb, ym, N); break;
                default: tile8(xm, cm, K, G, 1, codes, scale, gscale, nb, ym, N); break;
            }
        }
    }
    free(xq);
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
