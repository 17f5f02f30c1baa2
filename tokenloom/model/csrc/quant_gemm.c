/* Matmuls over quantized weights on AVX-512 (VNNI for int4 / int5 / int8g, BF16 for int8), for every batch size:
 *   int4_gemm: y[M, N] = x[M, K] @ W[N, K]^T with W in the GGUF's own Q4_1 blocks (w = d*q + m per 32
 *              weights, q in 0..15): the decoder's projections;
 *   int5_gemm: the same with 5-bit codes (q in 0..31: Q5_0's, w = d * (q - 16)): int4's nibbles plus a
 *              fifth bit per code, added under a byte mask (one op more per 64 codes);
 *   int8_gemm: the same with W = scale[n] * q[n][k], q in -127..127: the LM head's approximate logits;
 *   int8g_gemm: W = scale[n][k / 32] * q[n][k], a scale per group of 32 inputs: the projections a GGUF
 *               stores wider than 4 bits (Q5_0 and Q8_0 are such groups already; Q6_K, F16 nearly).
 *
 * int4 / int5: the activations rounded to int8 per group of 32 with their outliers kept in float32
 * (quant_rows.h, llama.cpp's Q8_0 plus the outliers), then per output element and group
 *     y += d * xscale * sum(q_x * q) + m * xsum,   then each outlier's d * x * q
 * with the integer sums by `vpdpbusd`: 64 multiply-adds of unsigned codes by signed activations an
 * instruction, into int32, exact. The kernel before multiplied bfloat16 activations by 128 + q in
 * `vdpbf16ps`, 32 an instruction. The float operations are quant_gemm_avx2.c's in the same order, so
 * the two kernels give the same bits.
 * int8g: the same int8 activations and `vpdpbusd` over codes in quads (below), exact integer sums.
 * int8: `vdpbf16ps` over the activations rounded to bfloat16 and the codes converted exactly.
 *
 * Batch invariance: every output element is one fixed chain of operations over K (the same operations
 * whatever tile its row or column falls in, whether its tile walks its outliers or the gemm indexes
 * them, and whichever thread runs it), and a row's rounding is its own, so a row's result does not
 * depend on how many rows there are. Threads split the columns (OpenMP,
 * torch's libgomp pool).
 *
 * Layout (model/quant/layouts.py pack_c_layout): for each block of 16 output columns, group of 32 inputs and
 * quarter jq of the group, 64 bytes: byte 4c + p holds the code of column c, input 8jq + p in its low
 * nibble and input 8jq + 4 + p in its high (a mask, or a shift and a mask, gives `vpdpbusd` the codes of
 * four inputs of 16 columns). Fifth bits: uint64 [N/16][K/32][4 jq][2 h], bit 4c + p the one of the code
 * of column c, input 8jq + 4h + p. Scales d and offsets m: float16, [N/16][K/32][16]; offsets NULL for
 * symmetric codes, m = -8 d (int4: Q4_0's) or -16 d (int5: Q5_0's), computed instead of read (0.5 bits
 * a weight less to keep). int8: [N/16][K/2][16][2] bytes, scales float32 [N]; int8g: [N/16][K/4][16][4]
 * bytes (model/quant/layouts.py pack_int8_quads), scales float32 [N/16][K/32][16].
 *
 * Built at run time by model/kernels.py with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512bf16
 * (and AVX2 + FMA + F16C for quant_rows.h).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_rows.h"

#define COLS 16      /* output columns per zmm */
#define TILE_COLS 3  /* column blocks per tile: 48 columns */
#define TILE_ROWS 6  /* int4 rows per tile: 6 x 3 accumulators, 6 code vectors and 2 broadcasts in 32 zmm */
#define INT8_TILE_ROWS 8  /* each converted int8 weight serves 8 rows (4 rows: the 32-row LM head 3.4 -> 2.5 ms) */
#define PREFETCH_GROUPS 8  /* the codes this many groups on are asked for: at one row the projections stream
                            * 53 MB from DRAM a token (batch-1 int4 time 2.6-2.9 -> 2.1-2.2 ms; 2, 4, 16 slower) */
_Static_assert(TILE_ROWS <= OUTLIER_WALK_ROWS, "add_outliers walks at most OUTLIER_WALK_ROWS rows");

#define INLINE static inline __attribute__((always_inline))

/* Four adjacent int8 activations as one 32-bit lane (memcpy: no aliasing through another type). */
INLINE int32_t quad_bits(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A 64-bit word of fifth bits as a byte mask. */
INLINE __mmask64 fifth_mask(const uint64_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return (__mmask64)v;
}

/* Input k of one group's codes (cg: its 4 x 64 bytes; hg: its fifth bits or NULL) for the 16 columns,
 * as float32. */
INLINE __m512 input_codes(const uint8_t *cg, const uint64_t *hg, int k) {
    const int jq = k / 8, h = k % 8 / 4, p = k % 4;
    __m512i v = _mm512_loadu_si512(cg + jq * 64);
    v = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    if (hg) v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(fifth_mask(hg + 2 * jq + h), _mm512_set1_epi8(16)));
    v = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * p)), _mm512_set1_epi32(0xFF));
    return _mm512_cvtepi32_ps(v);
}

/* Each of the walk's rows whose next outlier is input k: d * x * c (input k's codes c, scales d) into
 * its 16 outputs. Both kernels' add_outliers. */
INLINE void add_outlier_products(OutlierWalk *walk, int32_t k, __m512 c, __m512 d, float *y, int64_t N) {
    for (int r = 0; r < walk->rows; r++) {
        float x, *o = y + r * N;
        if (outlier_walk_take(walk, r, k, &x))
            _mm512_storeu_ps(o, _mm512_fmadd_ps(c, _mm512_mul_ps(d, _mm512_set1_ps(x)), _mm512_loadu_ps(o)));
    }
}

/* The tile's rows' outliers times their weights in column block nb, d * x * code, into their 16 outputs
 * each (their offsets are in their groups' sums), the rows' lists walked together (quant_rows.h). */
static void add_outliers(const QuantRows *rows, int64_t row0, int MR, int64_t G, const uint8_t *codes,
                         const uint64_t *hi, const uint16_t *scale, int64_t nb, float *y, int64_t N) {
    OutlierWalk walk = outlier_walk(rows, row0, MR, G);
    for (int32_t k; (k = outlier_walk_next(&walk)) != INT32_MAX;) {
        const int64_t group = nb * G + k / GROUP;
        const __m512 c = input_codes(codes + group * (GROUP / 2) * COLS, hi ? hi + group * 8 : NULL, k % GROUP);
        add_outlier_products(&walk, k, c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + group * COLS))), y, N);
    }
}

/* Index entry i's rows: d * x * c (input inputs[i]'s codes c, scales d) into their 16 outputs (y: the
 * column block's first output of row 0), as add_outlier_products does for a tile's rows. */
INLINE void add_indexed_products(const OutlierIndex *ix, int32_t i, __m512 c, __m512 d, float *y, int64_t N) {
    for (int32_t e = ix->first[i]; e < ix->first[i + 1]; e++) {
        float *o = y + (int64_t)ix->row[e] * N;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(c, _mm512_mul_ps(d, _mm512_set1_ps(ix->x[e])), _mm512_loadu_ps(o)));
    }
}

/* Every row's outliers times their weights in column block nb (int4 / int5 codes). */
static void add_indexed_outliers(const OutlierIndex *ix, int64_t G, const uint8_t *codes, const uint64_t *hi,
                                 const uint16_t *scale, int64_t nb, float *y, int64_t N) {
    for (int32_t i = 0; i < ix->count; i++) {
        const int32_t k = ix->inputs[i];
        const int64_t group = nb * G + k / GROUP;
        const __m512 c = input_codes(codes + group * (GROUP / 2) * COLS, hi ? hi + group * 8 : NULL, k % GROUP);
        add_indexed_products(ix, i, c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + group * COLS))), y, N);
    }
}

/* One tile: rows [row0, row0 + MR) x column blocks [nb0, nb0 + NB). Each group's integer dot products
 * accumulate in registers; the running outputs live in y (L1), updated once per group. */
INLINE void tile(const QuantRows *rows, int64_t row0, int64_t K, int64_t G, const int MR, const int NB,
                 const uint8_t *codes, const uint64_t *hi, const uint16_t *scale, const uint16_t *offset,
                 int64_t nb0, float *y, int64_t N, int walk) {
    const int8_t *xq = rows->q + row0 * K;
    const float *xscale = rows->scale + row0 * G, *sums = rows->sum + row0 * G;
    const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    __m512i acc[TILE_ROWS][TILE_COLS];
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y + r * N + (nb0 + b) * COLS, _mm512_setzero_ps());
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < MR; r++)
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_si512();
        for (int b = 0; b < NB; b++) {  /* the codes PREFETCH_GROUPS groups on (past the end: harmless) */
            const uint8_t *ahead = codes + ((nb0 + b) * G + g + PREFETCH_GROUPS) * (GROUP / 2) * COLS;
            for (int line = 0; line < GROUP / 2 * COLS; line += 64) __builtin_prefetch(ahead + line);
            if (hi) __builtin_prefetch(hi + ((nb0 + b) * G + g + PREFETCH_GROUPS) * 8);
        }
        for (int jq = 0; jq < 4; jq++) {
            __m512i w0[TILE_COLS], w1[TILE_COLS];  /* inputs 8jq .. + 3 and 8jq + 4 .. + 7 */
            for (int b = 0; b < NB; b++) {
                const int64_t at = ((nb0 + b) * G + g) * 4 + jq;
                const __m512i v = _mm512_loadu_si512(codes + at * 64);
                w0[b] = _mm512_and_si512(v, low);
                w1[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (hi) {  /* + 16 where the code's fifth bit is set */
                    w0[b] = _mm512_mask_add_epi8(w0[b], fifth_mask(hi + 2 * at), w0[b], sixteen);
                    w1[b] = _mm512_mask_add_epi8(w1[b], fifth_mask(hi + 2 * at + 1), w1[b], sixteen);
                }
            }
            for (int r = 0; r < MR; r++) {
                const int8_t *xg = xq + r * K + g * GROUP + 8 * jq;
                const __m512i x0 = _mm512_set1_epi32(quad_bits(xg)), x1 = _mm512_set1_epi32(quad_bits(xg + 4));
                for (int b = 0; b < NB; b++)
                    acc[r][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][b], w0[b], x0), w1[b], x1);
            }
        }
        for (int b = 0; b < NB; b++) {
            const int64_t at = ((nb0 + b) * G + g) * COLS;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + at)));
            const __m512 m = offset ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(offset + at)))
                                    : _mm512_mul_ps(_mm512_set1_ps(hi ? -16.0f : -8.0f), d);  /* symmetric */
            for (int r = 0; r < MR; r++) {
                float *o = y + r * N + (nb0 + b) * COLS;
                const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(xscale[r * G + g]));
                const __m512 out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][b]), dx, _mm512_loadu_ps(o));
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(sums[r * G + g]), m, out));
            }
        }
    }
    if (walk)  /* else the column's outlier pass (column_tile) */
        for (int b = 0; b < NB; b++)
            add_outliers(rows, row0, MR, G, codes, hi, scale, nb0 + b, y + (nb0 + b) * COLS, N);
}

/* All rows for column blocks [nb0, nb0 + nb), in tiles of at most TILE_ROWS (gemm_tile_rows), then
 * their outliers: each tile walks its own, or with an index (more rows than a tile) one pass for all.
 * The switch gives the compiler constant tile sizes to unroll and keep in registers; inlined into its
 * callers, int4's (hi NULL) loses the fifth-bit code altogether. */
INLINE void column_tile(const QuantRows *rows, const OutlierIndex *ix, int64_t M, int64_t K, int64_t G,
                        const uint8_t *codes, const uint64_t *hi, const uint16_t *scale, const uint16_t *offset,
                        int64_t nb0, int nb, float *y, int64_t N) {
    for (int64_t m = 0, mr; m < M; m += mr) {
        mr = gemm_tile_rows(M - m, TILE_ROWS);
        float *ym = y + m * N;
#define TILE(MR, NB) tile(rows, m, K, G, MR, NB, codes, hi, scale, offset, nb0, ym, N, !ix)
#define ROWS(MR) case MR * 4 + 3: TILE(MR, 3); break; case MR * 4 + 2: TILE(MR, 2); break; \
                 case MR * 4 + 1: TILE(MR, 1); break;
        switch (mr * 4 + nb) {
            ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) ROWS(1)
        }
#undef ROWS
#undef TILE
    }
    if (ix)
        for (int b = 0; b < nb; b++) add_indexed_outliers(ix, G, codes, hi, scale, nb0 + b, y + (nb0 + b) * COLS, N);
}

/* int4 (hi NULL) or int5. Returns 0, or 1 when the activations' buffer or the outlier index cannot be
 * allocated. K % 32 == 0 and N % 16 == 0. */
static int low_bit_gemm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint64_t *hi,
                        const uint16_t *scale, const uint16_t *offset, int64_t N, float *y) {
    const int64_t G = K / GROUP, blocks = N / COLS;
    const QuantRows rows = quantize_rows8(x, M, K);
    OutlierIndex ix;
    if (!rows.scale || index_outliers(&rows, M, K, TILE_ROWS, &ix)) {
        free(rows.scale);
        return 1;
    }
    const OutlierIndex *index = ix.inputs ? &ix : NULL;
    const int64_t tiles = (blocks + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for schedule(dynamic, 1)  /* a thread the OS has paused leaves its tiles to the others */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t nb0 = t * TILE_COLS;
        const int nb = (int)(blocks - nb0 < TILE_COLS ? blocks - nb0 : TILE_COLS);
        if (hi)
            column_tile(&rows, index, M, K, G, codes, hi, scale, offset, nb0, nb, y, N);
        else
            column_tile(&rows, index, M, K, G, codes, NULL, scale, offset, nb0, nb, y, N);
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
    return low_bit_gemm(x, M, K, codes, (const uint64_t *)hi, scale, offset, N, y);
}

/* int4_gemm's tiles into a per-thread buffer, each row's `keep` largest outputs kept as they come (kernels.h):
 * the LM head's greedy scan, 48 columns of output at a time where the whole is 600 KB a row. */
int int4_top(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
             const uint16_t *offset, int64_t N, int64_t keep, int64_t slots, float *top_values, int32_t *top_ids,
             uint8_t *unordered) {
    const int64_t G = K / GROUP, blocks = N / COLS, width = TILE_COLS * COLS;
    const QuantRows rows = quantize_rows8(x, M, K);
    float *tiles_out = aligned_alloc(64, sizeof(float) * slots * M * width);
    OutlierIndex ix = {0};
    if (!rows.scale || !tiles_out || index_outliers(&rows, M, K, TILE_ROWS, &ix)) {
        free(rows.scale);
        free(tiles_out);
        return 1;
    }
    const OutlierIndex *index = ix.inputs ? &ix : NULL;
    const int64_t tiles = (blocks + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel num_threads(slots)
    {
        const int64_t slot = omp_get_thread_num();
        float *y = tiles_out + slot * M * width;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t nb0 = t * TILE_COLS, at = nb0 * G * COLS;
            const int nb = (int)(blocks - nb0 < TILE_COLS ? blocks - nb0 : TILE_COLS);
            column_tile(&rows, index, M, K, G, codes + at * (GROUP / 2), NULL, scale + at,
                        offset ? offset + at : NULL, 0, nb, y, width);
            for (int64_t r = 0; r < M; r++) {
                float *vals = top_values + (slot * M + r) * keep;
                int32_t *ids = top_ids + (slot * M + r) * keep;
                for (int b = 0; b < nb; b++) {
                    const float *v = y + r * width + b * COLS;
                    /* not <= the list's last: larger, or NaN (which no comparison takes in) */
                    __mmask16 in = _mm512_cmp_ps_mask(_mm512_loadu_ps(v), _mm512_set1_ps(vals[keep - 1]), _CMP_NLE_UQ);
                    for (; in; in &= in - 1) {
                        const int c = __builtin_ctz(in);
                        if (v[c] != v[c])
                            unordered[slot * M + r] = 1;
                        else if (v[c] > vals[keep - 1])  /* the last may have risen since the mask */
                            top_insert(vals, ids, keep, v[c], (int32_t)((nb0 + b) * COLS + c));
                    }
                }
            }
        }
    }
    free(ix.inputs);
    free(rows.scale);
    free(tiles_out);
    return 0;
}

/* Activations to bfloat16 (round to nearest even): the int8 kernels' operands. */
static void to_bf16(const float *x, int64_t n, uint16_t *xb) {
    for (int64_t i = 0; i < n; i += 32) {
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_store_si512(xb + i, h);
    }
}

/* Two adjacent bfloat16 activations as one 32-bit lane (memcpy: no aliasing through another type). */
INLINE int32_t pair_bits(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* --- int8 ---------------------------------------------------------------------------------------- */

/* 32 bytes of codes (16 columns x 2 inputs, signed) -> 32 bfloat16, exact (|q| <= 127 < 2^8). */
INLINE __m512i int8_to_bf16(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

INLINE void tile8(const uint16_t *xb, int64_t K, const int MR, const int NB, const int8_t *codes,
                  const float *scale, int64_t nb0, float *y, int64_t N) {
    __m512 acc[INT8_TILE_ROWS][TILE_COLS];
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 2; j++) {
        __m512i w[TILE_COLS];
        for (int b = 0; b < NB; b++) w[b] = int8_to_bf16(codes + ((nb0 + b) * (K / 2) + j) * 2 * COLS);
        for (int r = 0; r < MR; r++) {
            const __m512i xv = _mm512_set1_epi32(pair_bits(xb + r * K + 2 * j));
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xv, (__m512bh)w[b]);
        }
    }
    for (int b = 0; b < NB; b++) {
        const __m512 s = _mm512_loadu_ps(scale + (nb0 + b) * COLS);
        for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + r * N + (nb0 + b) * COLS, _mm512_mul_ps(acc[r][b], s));
    }
}

/* --- int8 with a scale per group of 32 inputs: VNNI over the int4 kernels' int8 activations -------------
 * Codes [N/16][K/4][16][4]: each column's four adjacent inputs as one 32-bit lane. `vpdpbusd` multiplies
 * unsigned bytes by signed ones, so the codes go in as q + 128 (the sign bit flipped: one xor) and each
 * group's integer sums give back 128 times the activations' own sum (quant_rows.h's qsum): exactly
 * sum(q_x * q), with no float cancellation. Then per group y += d * xscale * sum, and the outliers'
 * d * x * q, as int4's. */

/* Input k of one group's codes (cg: its 8 x 64 bytes) for the 16 columns, as float32. */
INLINE __m512 input_codes8(const int8_t *cg, int k) {
    const __m512i v = _mm512_loadu_si512(cg + k / 4 * 64);
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8 * (3 - k % 4)), 24));
}

static void add_outliers8(const QuantRows *rows, int64_t row0, int MR, int64_t G, const int8_t *codes,
                          const float *gscale, int64_t nb, float *y, int64_t N) {
    OutlierWalk walk = outlier_walk(rows, row0, MR, G);
    for (int32_t k; (k = outlier_walk_next(&walk)) != INT32_MAX;) {
        const int64_t group = nb * G + k / GROUP;
        const __m512 c = input_codes8(codes + group * GROUP * COLS, k % GROUP);
        add_outlier_products(&walk, k, c, _mm512_loadu_ps(gscale + group * COLS), y, N);
    }
}

/* Every row's outliers times their weights in column block nb (int8g codes). */
static void add_indexed_outliers8(const OutlierIndex *ix, int64_t G, const int8_t *codes, const float *gscale,
                                  int64_t nb, float *y, int64_t N) {
    for (int32_t i = 0; i < ix->count; i++) {
        const int32_t k = ix->inputs[i];
        const int64_t group = nb * G + k / GROUP;
        add_indexed_products(ix, i, input_codes8(codes + group * GROUP * COLS, k % GROUP),
                             _mm512_loadu_ps(gscale + group * COLS), y, N);
    }
}

INLINE void tile8g(const QuantRows *rows, int64_t row0, int64_t K, int64_t G, const int MR, const int NB,
                   const int8_t *codes, const float *gscale, int64_t nb0, float *y, int64_t N, int walk) {
    const int8_t *xq = rows->q + row0 * K;
    const float *xscale = rows->scale + row0 * G;
    const int32_t *qsum = rows->qsum + row0 * G;
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    __m512i acc[TILE_ROWS][TILE_COLS];
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y + r * N + (nb0 + b) * COLS, _mm512_setzero_ps());
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < MR; r++)
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_si512();
        for (int b = 0; b < NB; b++) {  /* the codes PREFETCH_GROUPS groups on (past the end: harmless) */
            const int8_t *ahead = codes + ((nb0 + b) * G + g + PREFETCH_GROUPS) * GROUP * COLS;
            for (int line = 0; line < GROUP * COLS; line += 64) __builtin_prefetch(ahead + line);
        }
        for (int j = 0; j < GROUP / 4; j++) {
            __m512i w[TILE_COLS];
            for (int b = 0; b < NB; b++)
                w[b] = _mm512_xor_si512(_mm512_loadu_si512(codes + (((nb0 + b) * G + g) * 8 + j) * 64), sign);
            for (int r = 0; r < MR; r++) {
                const __m512i xv = _mm512_set1_epi32(quad_bits(xq + r * K + g * GROUP + 4 * j));
                for (int b = 0; b < NB; b++) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], w[b], xv);
            }
        }
        for (int b = 0; b < NB; b++) {
            const __m512 d = _mm512_loadu_ps(gscale + ((nb0 + b) * G + g) * COLS);
            for (int r = 0; r < MR; r++) {
                float *o = y + r * N + (nb0 + b) * COLS;
                const __m512i dot = _mm512_sub_epi32(acc[r][b], _mm512_set1_epi32(128 * qsum[r * G + g]));
                const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(xscale[r * G + g]));
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, _mm512_loadu_ps(o)));
            }
        }
    }
    if (walk)  /* else the column's outlier pass (int8g_gemm) */
        for (int b = 0; b < NB; b++)
            add_outliers8(rows, row0, MR, G, codes, gscale, nb0 + b, y + (nb0 + b) * COLS, N);
}

/* The per-column int8 kernel's driver. */
static int int8_any(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale, int64_t N,
                    float *y) {
    const int64_t blocks = N / COLS;
    uint16_t *xb = aligned_alloc(64, (sizeof(uint16_t) * M * K + 63) / 64 * 64);
    if (!xb) return 1;
    to_bf16(x, M * K, xb);
    const int64_t tiles = (blocks + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for schedule(dynamic, 1)  /* a thread the OS has paused leaves its tiles to the others */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t nb0 = t * TILE_COLS;
        const int nb = (int)(blocks - nb0 < TILE_COLS ? blocks - nb0 : TILE_COLS);
        for (int64_t m = 0, mr; m < M; m += mr) {
            mr = gemm_tile_rows(M - m, INT8_TILE_ROWS);
            const uint16_t *xm = xb + m * K;
            float *ym = y + m * N;
#define TILE8(MR, NB) tile8(xm, K, MR, NB, codes, scale, nb0, ym, N)
#define ROWS8(MR) case MR * 4 + 3: TILE8(MR, 3); break; case MR * 4 + 2: TILE8(MR, 2); break; \
                  case MR * 4 + 1: TILE8(MR, 1); break;
            switch (mr * 4 + nb) {
                ROWS8(8) ROWS8(7) ROWS8(6) ROWS8(5) ROWS8(4) ROWS8(3) ROWS8(2) ROWS8(1)
            }
#undef ROWS8
#undef TILE8
        }
    }
    free(xb);
    return 0;
}

/* y[M, N] = (x[M, K] rounded to bfloat16) @ (scale[n] * q[n][k])^T. K % 32 == 0, N % 16 == 0. */
int int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale, int64_t N, float *y) {
    return int8_any(x, M, K, codes, scale, N, y);
}

/* y[M, N] = (x as int8 groups with their outliers) @ (gscale[n][k / 32] * q[n][k])^T, codes [N/16][K/4][16][4].
 * K % 32 == 0, N % 16 == 0. Returns 0, or 1 when the activations' buffer or the outlier index cannot be
 * allocated. */
int int8g_gemm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *gscale, int64_t N, float *y) {
    const int64_t G = K / GROUP, blocks = N / COLS;
    const QuantRows rows = quantize_rows8(x, M, K);
    OutlierIndex ix;
    if (!rows.scale || index_outliers(&rows, M, K, TILE_ROWS, &ix)) {
        free(rows.scale);
        return 1;
    }
    const int64_t tiles = (blocks + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for schedule(dynamic, 1)  /* a thread the OS has paused leaves its tiles to the others */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t nb0 = t * TILE_COLS;
        const int nb = (int)(blocks - nb0 < TILE_COLS ? blocks - nb0 : TILE_COLS);
        for (int64_t m = 0, mr; m < M; m += mr) {
            mr = gemm_tile_rows(M - m, TILE_ROWS);
            float *ym = y + m * N;
#define TILE8G(MR, NB) tile8g(&rows, m, K, G, MR, NB, codes, gscale, nb0, ym, N, !ix.inputs)
#define ROWS8G(MR) case MR * 4 + 3: TILE8G(MR, 3); break; case MR * 4 + 2: TILE8G(MR, 2); break; \
                   case MR * 4 + 1: TILE8G(MR, 1); break;
            switch (mr * 4 + nb) {
                ROWS8G(6) ROWS8G(5) ROWS8G(4) ROWS8G(3) ROWS8G(2) ROWS8G(1)
            }
#undef ROWS8G
#undef TILE8G
        }
        if (ix.inputs)
            for (int b = 0; b < nb; b++) add_indexed_outliers8(&ix, G, codes, gscale, nb0 + b, y + (nb0 + b) * COLS, N);
    }
    free(ix.inputs);
    free(rows.scale);
    return 0;
}
