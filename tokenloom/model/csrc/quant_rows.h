/* The activations of the int4 / int5 gemms (quant_gemm.c, quant_gemm_avx2.c) rounded to int8 per group
 * of 32 inputs, with the outliers of each group kept in float32: the same rounding on every CPU, so
 * both kernels compute the same sums. AVX2 + FMA (both files are built with them). */
#ifndef TOKENLOOM_QUANT_ROWS_H
#define TOKENLOOM_QUANT_ROWS_H

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_avx2.h"

#define GROUP 32  /* inputs per group: the GGUF blocks' */

/* An input of a group whose magnitude is more than OUTLIER_RATIO times the group's mean magnitude is an
 * outlier: it is taken out of the group's int8 rounding and meets its weights in float32. int8 steps of
 * the group's largest / 127 would otherwise leave the other inputs a few bits: RMS-normed inputs have a
 * few outlier channels. Measured with the rounding simulated on the float32 models (top-1 agreement with
 * float32 over 2,500 tokens): SmolLM2 0.977 with every input rounded, 0.991 with outliers (0.28 a group).
 * At most 5 a group: 6 outliers would sum to more than the group's total. */
#define OUTLIER_RATIO 6.0f
#define MAX_OUTLIERS 5

/* The activations of the int4 / int5 gemms: per row and group of 32 inputs int8 codes, their scale and
 * the rounded group's sum; per row its outliers (above), in a list: their inputs (g * 32 + k) and values. */
typedef struct {
    int8_t *q;
    float *scale, *sum, *outlier_x;  /* outlier_x, outlier_at: MAX_OUTLIERS * G a row */
    int32_t *outlier_at, *outliers;  /* outliers: how many each row has */
    int32_t *qsum;                   /* per row and group the sum of its int8 codes (int8g's VNNI kernel) */
} QuantRows;

/* One row's group of 32 inputs: its outliers (above) as they are, appended to the row's list (`at` the
 * group's first input), the rest as int8 with the rest's own scale: x ~= scale * q, |q| <= 127, the
 * largest at 127, an outlier's q 0. `sum`: scale * sum(q) + the outliers, so that the offset term meets
 * the same rounded activations as the codes (y is then exactly W times the rounded x, its error
 * sum(e_k w_k), the weights centred where the codes are not). A non-finite group gets a NaN scale, so
 * it reaches the outputs as the float32 path would let it. */
static inline __attribute__((always_inline)) void quantize_group8(const float *x, int8_t *q, float *scale, float *sum,
                                                                 int32_t *qsum, int32_t at, float *outlier_x,
                                                                 int32_t *outlier_at, int32_t *outliers) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], a[4];
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        a[i] = _mm256_and_ps(v[i], magnitude);
    }
    /* the sum of magnitudes keeps NaNs and infinities (max would skip NaNs) */
    const float total = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    if (!(total <= FLT_MAX)) {
        *scale = NAN;
        *sum = 0.0f;
        *qsum = 0;
        memset(q, 0, GROUP);
        return;
    }
    float outlier_sum = 0.0f;
    const __m256 bar = _mm256_set1_ps(OUTLIER_RATIO * total / GROUP);
    for (int i = 0; i < 4; i++) {
        const __m256 out = _mm256_cmp_ps(a[i], bar, _CMP_GT_OQ);
        for (unsigned bits = (unsigned)_mm256_movemask_ps(out); bits; bits &= bits - 1) {
            const int k = 8 * i + __builtin_ctz(bits);
            outlier_at[*outliers] = at + k;
            outlier_x[(*outliers)++] = x[k];
            outlier_sum += x[k];
        }
        v[i] = _mm256_andnot_ps(out, v[i]);
        a[i] = _mm256_andnot_ps(out, a[i]);
    }
    const float largest = hmax8(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
    if (largest < 1e-30f) {  /* (nearly) all zeros: nothing to multiply */
        *scale = 0.0f;
        *sum = outlier_sum;
        *qsum = 0;
        memset(q, 0, GROUP);
        return;
    }
    *scale = largest / 127.0f;
    const __m256 inv = _mm256_set1_ps(127.0f / largest);  /* |x * inv| <= 127 + an ulp: no saturation */
    __m256i i32[4];
    for (int i = 0; i < 4; i++) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  /* to nearest even */
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *qsum = _mm_cvtsi128_si32(s4);
    *sum = *scale * (float)*qsum + outlier_sum;
    /* the packs interleave 128-bit lanes: dwords of four inputs come out as 0, 8, 16, 24, 4, 12, 20, 28 */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* The activations [M, K] as int8 groups with their outliers (quantize_group8), the rows split between
 * the threads: one buffer, freed with free(rows.scale). */
static inline QuantRows quantize_rows8(const float *x, int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    QuantRows rows = {.scale = malloc(4 * (size_t)((3 + 2 * MAX_OUTLIERS) * M * G + M) + (size_t)(M * K))};
    if (!rows.scale) return rows;
    rows.sum = rows.scale + M * G;
    rows.outlier_x = rows.sum + M * G;
    rows.outlier_at = (int32_t *)(rows.outlier_x + MAX_OUTLIERS * M * G);
    rows.qsum = rows.outlier_at + MAX_OUTLIERS * M * G;
    rows.outliers = rows.qsum + M * G;
    rows.q = (int8_t *)(rows.outliers + M);
#pragma omp parallel for schedule(static) if (M * G >= 512)
    for (int64_t r = 0; r < M; r++) {
        rows.outliers[r] = 0;
        for (int64_t g = 0, i = r * G; g < G; g++, i++)
            quantize_group8(x + i * GROUP, rows.q + i * GROUP, rows.scale + i, rows.sum + i, rows.qsum + i, (int32_t)(g * GROUP),
                            rows.outlier_x + r * G * MAX_OUTLIERS, rows.outlier_at + r * G * MAX_OUTLIERS, rows.outliers + r);
    }
    return rows;
}

/* A tile's rows' outlier lists walked together (the gemms' add_outliers, when a gemm has a tile's rows
 * or fewer): input by input, ascending, so that an input's codes are unpacked once for every row of the
 * tile that has it; each row still meets its outliers in its own order, the same operations as alone. */
#define OUTLIER_WALK_ROWS 8  /* the most rows a tile has */
typedef struct {
    const int32_t *at[OUTLIER_WALK_ROWS], *end[OUTLIER_WALK_ROWS];
    const float *value[OUTLIER_WALK_ROWS];
    int rows;
} OutlierWalk;

static inline OutlierWalk outlier_walk(const QuantRows *rows, int64_t row0, int MR, int64_t G) {
    OutlierWalk w = {.rows = MR};
    for (int r = 0; r < MR; r++) {
        w.at[r] = rows->outlier_at + (row0 + r) * G * MAX_OUTLIERS;
        w.end[r] = w.at[r] + rows->outliers[row0 + r];
        w.value[r] = rows->outlier_x + (row0 + r) * G * MAX_OUTLIERS;
    }
    return w;
}

/* The next input any row has as an outlier, or INT32_MAX when every list is done. */
static inline int32_t outlier_walk_next(const OutlierWalk *w) {
    int32_t k = INT32_MAX;
    for (int r = 0; r < w->rows; r++)
        if (w->at[r] < w->end[r] && *w->at[r] < k) k = *w->at[r];
    return k;
}

/* Whether row r has input k as its next outlier; if so its value in *x, and the row moves on. */
static inline int outlier_walk_take(OutlierWalk *w, int r, int32_t k, float *x) {
    if (w->at[r] == w->end[r] || *w->at[r] != k) return 0;
    *x = *w->value[r]++;
    w->at[r]++;
    return 1;
}

/* Every row's outliers grouped by input, for gemms of more rows than a tile: input inputs[i]'s entries
 * are [first[i], first[i + 1]) of `row` and `x`, rows ascending. An input's codes are then unpacked once
 * per column block for all the rows that have it, where a tile's walk (above) unpacks them once per tile
 * (SmolLM2's prefill on AVX-512 spent 16.5% of its time in the walks, 7.9% with the index). Each row still
 * meets its outliers in ascending input order after all its groups: the same operations in the same
 * order as the walk's, the same bits. */
typedef struct {
    int32_t *inputs, *first, *row;
    float *x;
    int32_t count;  /* distinct inputs */
} OutlierIndex;

/* The index of `rows`' outliers (M rows, K inputs): one buffer, freed with free(index.inputs); NULL
 * inputs when it cannot be allocated. */
static inline OutlierIndex outlier_index(const QuantRows *rows, int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    int64_t total = 0;
    for (int64_t r = 0; r < M; r++) total += rows->outliers[r];
    OutlierIndex ix = {.inputs = malloc(sizeof(int32_t) * (size_t)(3 * K + 1 + 2 * total))};
    if (!ix.inputs) return ix;
    int32_t *at_input = ix.inputs + K;  /* per input: how many rows have it, then where its next entry goes */
    ix.first = at_input + K;
    ix.row = ix.first + K + 1;
    ix.x = (float *)(ix.row + total);
    memset(at_input, 0, sizeof(int32_t) * (size_t)K);
    for (int64_t r = 0; r < M; r++)
        for (int32_t e = 0; e < rows->outliers[r]; e++) at_input[rows->outlier_at[r * G * MAX_OUTLIERS + e]]++;
    int32_t n = 0, next = 0;
    for (int32_t k = 0; k < K; k++)
        if (at_input[k]) {
            ix.inputs[n] = k;
            ix.first[n++] = next;
            next += at_input[k];
            at_input[k] = ix.first[n - 1];
        }
    ix.first[n] = next;
    ix.count = n;
    for (int64_t r = 0; r < M; r++)
        for (int32_t e = 0; e < rows->outliers[r]; e++) {
            const int64_t at = r * G * MAX_OUTLIERS + e;
            const int32_t slot = at_input[rows->outlier_at[at]]++;
            ix.row[slot] = (int32_t)r;
            ix.x[slot] = rows->outlier_x[at];
        }
    return ix;
}

/* *ix: the index of a gemm of more rows than a tile (`tile_rows`); for fewer, none (inputs NULL: the
 * tiles walk their own). Returns 1 when it cannot be allocated. */
static inline int index_outliers(const QuantRows *rows, int64_t M, int64_t K, int tile_rows, OutlierIndex *ix) {
    *ix = M > tile_rows ? outlier_index(rows, M, K) : (OutlierIndex){0};
    return M > tile_rows && !ix->inputs;
}

#endif
