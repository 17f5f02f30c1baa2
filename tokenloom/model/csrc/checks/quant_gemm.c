/* The check of a quant_gemm library (csrc/quant_gemm.c, or with -DAVX2_LAYOUT csrc/quant_gemm_avx2.c):
 * int4_gemm with and without offsets, int4_top, int5_gemm with and without offsets, int8_gemm and
 * int8g_gemm on one small case, the codes laid out as model/quant/layouts.py packs them for it. The
 * activations are values exact in bfloat16 and in int8 groups, with an outlier (over 6x its group's mean
 * magnitude) that the int8 groups keep in float32. */
#include "check.h"

enum { M = 5, K = 64, N = 48, G = K / 32, NB = N / 16 };

static int q[N][K], q5[N][K], w8[N][K];
static float d[N][G], m[N][G], s8[N], g8[N][G];

#ifdef AVX2_LAYOUT
enum { INT8G_INPUTS = 2 };  /* pack_int8_c_layout */
/* pack_avx2_layout: byte 4c + p of slot jj holds columns c (low nibble) and 8 + c of input 4jj + p. */
static void code_bytes(int (*codes)[K], uint8_t *out) {
    for (int nb = 0; nb < NB; nb++)
        for (int g = 0; g < G; g++)
            for (int jj = 0; jj < 8; jj++)
                for (int c = 0; c < 8; c++)
                    for (int p = 0; p < 4; p++)
                        *out++ = (uint8_t)((codes[nb * 16 + c][g * 32 + 4 * jj + p] & 15)
                                           | (codes[nb * 16 + 8 + c][g * 32 + 4 * jj + p] & 15) << 4);
}
/* Its fifth bits: plane h, byte 4c + p, bit b that of code vector 8h + b (slot b / 2, half b % 2). */
static void fifth_bytes(int (*codes)[K], uint8_t *out) {
    for (int nb = 0; nb < NB; nb++)
        for (int g = 0; g < G; g++)
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 8; c++)
                    for (int p = 0; p < 4; p++) {
                        int byte = 0;
                        for (int b = 0; b < 8; b++)
                            byte |= (codes[nb * 16 + 8 * (b % 2) + c][g * 32 + 4 * (4 * h + b / 2) + p] >> 4) << b;
                        *out++ = (uint8_t)byte;
                    }
}
#else
enum { INT8G_INPUTS = 4 };  /* pack_int8_quads */
/* pack_c_layout: byte 4c + p of quarter jq holds inputs 8jq + p (low nibble) and 8jq + 4 + p of column c. */
static void code_bytes(int (*codes)[K], uint8_t *out) {
    for (int nb = 0; nb < NB; nb++)
        for (int g = 0; g < G; g++)
            for (int jq = 0; jq < 4; jq++)
                for (int c = 0; c < 16; c++)
                    for (int p = 0; p < 4; p++)
                        *out++ = (uint8_t)((codes[nb * 16 + c][g * 32 + 8 * jq + p] & 15)
                                           | (codes[nb * 16 + c][g * 32 + 8 * jq + 4 + p] & 15) << 4);
}
/* Its fifth bits: a uint64 per (block, group, jq, h), bit 4c + p that of input 8jq + 4h + p of column c. */
static void fifth_bytes(int (*codes)[K], uint8_t *out) {
    for (int nb = 0; nb < NB; nb++)
        for (int g = 0; g < G; g++)
            for (int jq = 0; jq < 4; jq++)
                for (int h = 0; h < 2; h++) {
                    uint64_t word = 0;
                    for (int c = 0; c < 16; c++)
                        for (int p = 0; p < 4; p++)
                            word |= (uint64_t)(codes[nb * 16 + c][g * 32 + 8 * jq + 4 * h + p] >> 4) << (4 * c + p);
                    memcpy(out, &word, 8);  /* little-endian, as the kernel reads it */
                    out += 8;
                }
}
#endif

/* A [N][G] table as the kernels take scales: [N/16][G][16], float16 bits or float32. */
static void per_block_half(float (*t)[G], uint16_t *out) {
    for (int nb = 0; nb < NB; nb++)
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 16; c++) *out++ = half_bits(t[nb * 16 + c][g]);
}

static float x[M * K], y[M * N];

/* y against x times the weights w(n, k) of `codes` with scale d, offset m (or `zero` times d when symmetric). */
static void expect_codes(int (*codes)[K], int symmetric, double zero, const char *what) {
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) {
            double ref = 0;
            for (int k = 0; k < K; k++) {
                const double dk = d[n][k / 32];
                ref += x[r * K + k] * (symmetric ? dk * (codes[n][k] + zero) : dk * codes[n][k] + m[n][k / 32]);
            }
            CHECK(close_to(y[r * N + n], ref, 1e-4), "%s: row %d column %d: %g, want %g", what, r, n, y[r * N + n], ref);
        }
}

int main(int argc, char **argv) {
    void *lib = open_library(argc, argv);
    int4_gemm_fn *gemm4 = (int4_gemm_fn *)symbol(lib, "int4_gemm");
    int5_gemm_fn *gemm5 = (int5_gemm_fn *)symbol(lib, "int5_gemm");
    int4_top_fn *top = (int4_top_fn *)symbol(lib, "int4_top");
    int8_gemm_fn *gemm8 = (int8_gemm_fn *)symbol(lib, "int8_gemm");
    int8_gemm_fn *gemm8g = (int8_gemm_fn *)symbol(lib, "int8g_gemm");

    for (int i = 0; i < M * K; i++) x[i] = (float)randrange(-127, 128) / 64;
    for (int i = 0; i < M * K; i += 32) x[i] = (randrange(0, 2) ? 127.0f : -127.0f) / 64;  /* each group's largest */
    for (int r = 0; r < M; r++) x[r * K + 39] = randrange(0, 2) ? 64.0f : -64.0f;  /* the outlier of group 1 */
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++) q[n][k] = (int)randrange(0, 16), q5[n][k] = (int)randrange(0, 32);
        for (int g = 0; g < G; g++) d[n][g] = half_round((float)uniform(0.01, 0.1)), m[n][g] = half_round((float)uniform(-0.5, 0));
    }
    static uint8_t codes[NB * G * 256], codes5[NB * G * 256], fifth5[NB * G * 64];
    static uint16_t scales[N * G], offsets[N * G];
    code_bytes(q, codes);
    code_bytes(q5, codes5);
    fifth_bytes(q5, fifth5);
    per_block_half(d, scales);
    per_block_half(m, offsets);

    CHECK(gemm4(x, M, K, codes, scales, offsets, N, y) == 0, "int4_gemm failed");
    expect_codes(q, 0, 0, "int4");
    CHECK(gemm4(x, M, K, codes, scales, NULL, N, y) == 0, "int4_gemm failed");  /* symmetric: offset -8 d */
    expect_codes(q, 1, -8, "int4 symmetric");

    /* int4_top: each thread's lists, merged, are each row's KEEP largest outputs with their columns. */
    enum { KEEP = 4, SLOTS = 2 };
    CHECK(gemm4(x, M, K, codes, scales, offsets, N, y) == 0, "int4_gemm failed");
    float values[SLOTS * M * KEEP];
    int32_t ids[SLOTS * M * KEEP];
    uint8_t unordered[SLOTS * M] = {0};
    for (int i = 0; i < SLOTS * M * KEEP; i++) values[i] = -INFINITY, ids[i] = -1;
    CHECK(top(x, M, K, codes, scales, offsets, N, KEEP, SLOTS, values, ids, unordered) == 0, "int4_top failed");
    for (int i = 0; i < SLOTS * M; i++) CHECK(!unordered[i], "int4_top: a NaN in row %d", i % M);
    for (int r = 0; r < M; r++) {
        for (int s = 0; s < SLOTS * KEEP; s++) {  /* every entry kept is a column's own output */
            const int at = (s / KEEP * M + r) * KEEP + s % KEEP;
            CHECK(ids[at] < N && (ids[at] < 0 || y[r * N + ids[at]] == values[at]), "int4_top: row %d id %d", r, ids[at]);
        }
        int taken[SLOTS * KEEP] = {0};
        float row[N];
        memcpy(row, y + r * N, sizeof row);
        for (int j = 0; j < KEEP; j++) {  /* the row's j-th largest output is among them */
            int best = 0, found = 0;
            for (int n = 1; n < N; n++)
                if (row[n] > row[best]) best = n;
            for (int s = 0; s < SLOTS * KEEP && !found; s++) {
                const int at = (s / KEEP * M + r) * KEEP + s % KEEP;
                if (!taken[s] && ids[at] >= 0 && values[at] == row[best]) taken[s] = found = 1;
            }
            CHECK(found, "int4_top: row %d lacks its value %g", r, row[best]);
            row[best] = -INFINITY;
        }
    }

    CHECK(gemm5(x, M, K, codes5, (const uint32_t *)fifth5, scales, offsets, N, y) == 0, "int5_gemm failed");
    expect_codes(q5, 0, 0, "int5");
    CHECK(gemm5(x, M, K, codes5, (const uint32_t *)fifth5, scales, NULL, N, y) == 0, "int5_gemm failed");
    expect_codes(q5, 1, -16, "int5 symmetric");  /* symmetric: offset -16 d */

    /* int8 with a scale per column: codes in pairs of adjacent inputs of 16 columns. */
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++) w8[n][k] = (int)randrange(-127, 128);
        s8[n] = (float)uniform(0.001, 0.01);
        for (int g = 0; g < G; g++) g8[n][g] = (float)uniform(0.001, 0.01);
    }
    static int8_t c8[N * K], c8g[N * K];
    static float gs[N * G];
    int at = 0;
    for (int nb = 0; nb < NB; nb++)
        for (int j = 0; j < K / 2; j++)
            for (int c = 0; c < 16; c++)
                for (int i = 0; i < 2; i++) c8[at++] = (int8_t)w8[nb * 16 + c][2 * j + i];
    CHECK(gemm8(x, M, K, c8, s8, N, y) == 0, "int8_gemm failed");
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) {
            double ref = 0;
            for (int k = 0; k < K; k++) ref += (double)x[r * K + k] * w8[n][k];
            ref *= s8[n];
            CHECK(close_to(y[r * N + n], ref, 1e-4), "int8: row %d column %d: %g, want %g", r, n, y[r * N + n], ref);
        }

    /* int8 with a scale per group of 32 inputs: codes in runs of INT8G_INPUTS inputs of 16 columns. */
    at = 0;
    for (int nb = 0; nb < NB; nb++)
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 16; c++) gs[at++] = g8[nb * 16 + c][g];
    at = 0;
    for (int nb = 0; nb < NB; nb++)
        for (int j = 0; j < K / INT8G_INPUTS; j++)
            for (int c = 0; c < 16; c++)
                for (int i = 0; i < INT8G_INPUTS; i++) c8g[at++] = (int8_t)w8[nb * 16 + c][INT8G_INPUTS * j + i];
    CHECK(gemm8g(x, M, K, c8g, gs, N, y) == 0, "int8g_gemm failed");
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) {
            double ref = 0;
            for (int k = 0; k < K; k++) ref += (double)x[r * K + k] * w8[n][k] * g8[n][k / 32];
            CHECK(close_to(y[r * N + n], ref, 1e-4), "int8g: row %d column %d: %g, want %g", r, n, y[r * N + n], ref);
        }
    return 0;
}
