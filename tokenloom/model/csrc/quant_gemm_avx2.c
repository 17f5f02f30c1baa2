/* quant_gemm.c's two kernels for CPUs without AVX512-BF16 (AVX2 + FMA + F16C), with the same layouts
 * (model/linear.py packs one layout for both) and float32 activations:
 *   int4_gemm: y[M, N] = x[M, K] @ W[N, K]^T over the GGUF's Q4_1 blocks (the decoder's projections);
 *   int8_gemm: the same over per-column int8 weights (the LM head's approximate logits).
 *
 * int4: per group of 32 weights, y += d * sum(x * q) + m * sum(x) with the codes q converted to float32
 * in registers and float32 activations: no rounding of the activations at all. At one row this reads
 * 4.5 bits a weight where torch's int4 op (bfloat16 activations, emulated without AVX512-BF16) took
 * 2.3x longer, measured with torch held to AVX2.
 *
 * Batch invariance: each output element accumulates over k in one fixed order whatever tile its row
 * falls in; threads split the column blocks.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define COLS 16      /* output columns per column block: two ymm */
#define TILE_ROWS 4  /* 4 rows x 2 accumulators + 4 code vectors + 2 broadcasts fit in 16 ymm */

#define INLINE static inline __attribute__((always_inline))

INLINE __m256 bytes_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* Rows [0, MR) x column block nb. Per group of 32 inputs: y += d * sum(x * q) + m * sum(x), the dot
 * products of the codes in registers, the running outputs in y (L1). */
INLINE void tile(const float *x, const float *sums, int64_t K, int64_t G, const int MR, const uint8_t *codes,
                 const uint16_t *scale, const uint16_t *offset, int64_t nb, float *y, int64_t N) {
    __m256 acc[TILE_ROWS][2];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(y + r * N + nb * COLS, _mm256_setzero_ps());
        _mm256_storeu_ps(y + r * N + nb * COLS + 8, _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const uint8_t *cg = codes + (nb * G + g) * (GROUP / 2) * COLS;
        for (int j = 0; j < GROUP / 2; j++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(cg + j * COLS));
            const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
            /* codes of inputs k = 32g + 2j (a) and k + 1 (b), columns 0-7 and 8-15 */
            const __m256 a0 = bytes_to_ps(lo), a1 = bytes_to_ps(_mm_srli_si128(lo, 8));
            const __m256 b0 = bytes_to_ps(hi), b1 = bytes_to_ps(_mm_srli_si128(hi, 8));
            for (int r = 0; r < MR; r++) {
                const float *xr = x + r * K + g * GROUP + 2 * j;
                const __m256 xa = _mm256_broadcast_ss(xr), xb = _mm256_broadcast_ss(xr + 1);
                acc[r][0] = _mm256_fmadd_ps(xb, b0, _mm256_fmadd_ps(xa, a0, acc[r][0]));
                acc[r][1] = _mm256_fmadd_ps(xb, b1, _mm256_fmadd_ps(xa, a1, acc[r][1]));
            }
        }
        const int64_t at = (nb * G + g) * COLS;
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + at + 8 * h)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offset + at + 8 * h)));
            for (int r = 0; r < MR; r++) {
                float *o = y + r * N + nb * COLS + 8 * h;
                const __m256 out = _mm256_fmadd_ps(acc[r][h], d, _mm256_loadu_ps(o));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(sums[r * G + g]), m, out));
            }
        }
    }
}

/* Same signature and layout as quant_gemm.c's int4_gemm. Returns 0, or 1 when the group sums' buffer
 * cannot be allocated. */
int int4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
              const uint16_t *offset, int64_t N, float *y) {
    const int64_t G = K / GROUP, blocks = N / COLS;
    float *sums = malloc(sizeof(float) * (size_t)(M * G > 0 ? M * G : 1));
    if (!sums) return 1;
    for (int64_t i = 0; i < M * G; i++) {  /* each row's sum over each group of 32 inputs */
        const float *xi = x + i * GROUP;
        const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xi), _mm256_loadu_ps(xi + 8)),
                                       _mm256_add_ps(_mm256_loadu_ps(xi + 16), _mm256_loadu_ps(xi + 24)));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        sums[i] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        for (int64_t m = 0; m < M; m += TILE_ROWS) {
            const float *xm = x + m * K, *sm = sums + m * G;
            float *ym = y + m * N;
            switch (M - m < TILE_ROWS ? (int)(M - m) : TILE_ROWS) {
                case 4: tile(xm, sm, K, G, 4, codes, scale, offset, nb, ym, N); break;
                case 3: tile(xm, sm, K, G, 3, codes, scale, offset, nb, ym, N); break;
                case 2: tile(xm, sm, K, G, 2, codes, scale, offset, nb, ym, N); break;
                default: tile(xm, sm, K, G, 1, codes, scale, offset, nb, ym, N); break;
            }
        }
    }
    free(sums);
    return 0;
}

/* --- int8: codes [N/16][K/2][16][2] (each column's pair of inputs side by side), scales float32 [N] ---- */

#define TILE_ROWS8 2  /* 2 rows x 4 accumulators + 4 weight vectors + 1 broadcast fit in 16 ymm */

/* The pair x[k], x[k+1] repeated four times: it meets four columns' pairs of weights. */
INLINE __m256 pair4(const float *x) {
    double d;
    memcpy(&d, x, sizeof d);
    return _mm256_castpd_ps(_mm256_set1_pd(d));
}

/* Lane 2c holds column c's sum over even inputs, lane 2c + 1 over odd ones: add them, in column order. */
INLINE __m256 fold_pairs(__m256 cols0_3, __m256 cols4_7) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(cols0_3, cols4_7)), 0xD8));
}

INLINE void tile8(const float *x, int64_t K, const int MR, const int8_t *codes, const float *scale, int64_t nb,
                  float *y, int64_t N) {
    __m256 acc[TILE_ROWS8][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm256_setzero_ps();
    const int8_t *cb = codes + nb * (K / 2) * COLS * 2;
    for (int64_t j = 0; j < K / 2; j++) {
        __m256 w[4];
        for (int q = 0; q < 4; q++)
            w[q] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(cb + j * 32 + 8 * q))));
        for (int r = 0; r < MR; r++) {
            const __m256 xp = pair4(x + r * K + 2 * j);
            for (int q = 0; q < 4; q++) acc[r][q] = _mm256_fmadd_ps(xp, w[q], acc[r][q]);
        }
    }
    const __m256 s0 = _mm256_loadu_ps(scale + nb * COLS), s1 = _mm256_loadu_ps(scale + nb * COLS + 8);
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(y + r * N + nb * COLS, _mm256_mul_ps(fold_pairs(acc[r][0], acc[r][1]), s0));
        _mm256_storeu_ps(y + r * N + nb * COLS + 8, _mm256_mul_ps(fold_pairs(acc[r][2], acc[r][3]), s1));
    }
}

/* Same signature and layout as quant_gemm.c's int8_gemm (K even, N a multiple of 16). Returns 0. */
int int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale, int64_t N, float *y) {
    const int64_t blocks = N / COLS;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++)
        for (int64_t m = 0; m < M; m += TILE_ROWS8) {
            if (M - m >= 2)
                tile8(x + m * K, K, 2, codes, scale, nb, y + m * N, N);
            else
                tile8(x + m * K, K, 1, codes, scale, nb, y + m * N, N);
        }
    return 0;
}
