/* The check of csrc/paged_attention.c, or with -DAVX512 of csrc/paged_attention_avx512.c: for each shape
 * below (head_dim, query heads per KV head), two rows of one prompt (a context and a shorter one, so a
 * task holds both rows' query heads) over a float cache, a half one and an int8 one (rows of codes and
 * their scale, kernels.h's KV_SCALE_BYTES), the context in blocks out of order and ending inside its
 * last block, against softmax(q K^T scale) V computed directly over the values the cache holds. */

#include "check.h"

typedef struct { int heads, kv_heads, head_dim; } Shape;
#ifdef AVX512
/* Every head_dim the kernel takes that models use, and GQA groups of 1 to 8 (its tiles of four heads
 * full, partial, and several in one task). */
static const Shape shapes[] = {{4, 2, 64}, {7, 1, 64}, {2, 2, 128}, {16, 2, 128}, {6, 1, 128}, {3, 1, 256}};
static const char *const names[3] = {"paged_decode_attention_avx512_f32", "paged_decode_attention_avx512_f16",
                                     "paged_decode_attention_avx512_q8"};
#else
static const Shape shapes[] = {{4, 2, 32}, {6, 1, 128}};
static const char *const names[3] = {"paged_decode_attention_f32", "paged_decode_attention_f16",
                                     "paged_decode_attention_q8"};
#endif
enum { ROWS = 2, BS = 4, NB = 6, CTX = 21, MAX_D = 256, MAX_H = 16 };
enum { MAX_CACHE = NB * BS * 2 * MAX_D, MAX_KV_ROWS = NB * BS * 2 };

static float q[ROWS * MAX_H * MAX_D], k[MAX_CACHE], v[MAX_CACHE], kf[MAX_CACHE], vf[MAX_CACHE], out[ROWS * MAX_H * MAX_D];
static uint16_t kh[MAX_CACHE], vh[MAX_CACHE];
static int8_t k8[MAX_KV_ROWS * (MAX_D + KV_SCALE_BYTES)], v8[MAX_KV_ROWS * (MAX_D + KV_SCALE_BYTES)];

/* x (d values) as int8 codes and scale into dst; its values as the kernel reads them into back. */
static void quantize_row(const float *x, int d, int8_t *dst, float *back) {
    float amax = 0;
    for (int i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float scale = amax / 127.0f;
    for (int i = 0; i < d; i++) dst[i] = (int8_t)lrintf(x[i] * (127.0f / amax)), back[i] = (float)dst[i] * scale;
    memcpy(dst + d, &scale, sizeof scale);
}

static void check_shape(void *lib, Shape sh) {
    const int H = sh.heads, KVH = sh.kv_heads, D = sh.head_dim, cache = NB * BS * KVH * D, row8 = D + KV_SCALE_BYTES;
    CHECK(H <= MAX_H && KVH <= 2 && D <= MAX_D, "shape %d/%d/%d past the check's arrays", H, KVH, D);
    int64_t tables[ROWS * NB];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < NB; i++) tables[r * NB + i] = (i + 2) % NB;  /* logical block i in physical block tables[i] */
    const int64_t lens[ROWS] = {CTX, CTX - 7};
    for (int i = 0; i < ROWS * H * D; i++) q[i] = (float)uniform(-1, 1);
    for (int i = 0; i < cache; i++) k[i] = (float)uniform(-1, 1), v[i] = (float)uniform(-1, 1);
    for (int i = 0; i < cache; i++) kh[i] = half_bits(k[i]), vh[i] = half_bits(v[i]);
    for (int half = 0; half < 3; half++) {  /* each cache type (float, half, int8): what the kernel reads back */
        attention_fn *attend = (attention_fn *)symbol(lib, names[half]);
        for (int i = 0; i < cache; i++) kf[i] = half ? half_value(kh[i]) : k[i], vf[i] = half ? half_value(vh[i]) : v[i];
        for (int r = 0; half == 2 && r < NB * BS * KVH; r++) {
            quantize_row(k + r * D, D, k8 + r * row8, kf + r * D);
            quantize_row(v + r * D, D, v8 + r * row8, vf + r * D);
        }
        const void *kc = half == 2 ? (const void *)k8 : half ? (const void *)kh : (const void *)k;
        const void *vc = half == 2 ? (const void *)v8 : half ? (const void *)vh : (const void *)v;
        CHECK(attend(q, kc, vc, tables, NB, lens, ROWS, H, KVH, D, BS, 0.25f, out) == 0, "%s failed", names[half]);
        for (int r = 0; r < ROWS; r++)
            for (int h = 0; h < H; h++) {
                const int kvh = h / (H / KVH);
                const float *qh = q + (r * H + h) * D, *got = out + (r * H + h) * D;
                double s[CTX], z = 0, top = -INFINITY;
                for (int p = 0; p < lens[r]; p++) {
                    const int64_t slot = tables[p / BS] * BS + p % BS;
                    s[p] = 0;
                    for (int i = 0; i < D; i++) s[p] += (double)qh[i] * kf[(slot * KVH + kvh) * D + i];
                    s[p] *= 0.25;
                    top = s[p] > top ? s[p] : top;
                }
                for (int p = 0; p < lens[r]; p++) z += s[p] = exp(s[p] - top);
                for (int i = 0; i < D; i++) {
                    double ref = 0;
                    for (int p = 0; p < lens[r]; p++) ref += s[p] / z * vf[((tables[p / BS] * BS + p % BS) * KVH + kvh) * D + i];
                    CHECK(fabs(got[i] - ref) < 1e-5, "%s, %d heads / %d KV heads / head_dim %d: row %d, head %d, %d: %g, want %g",
                          names[half], H, KVH, D, r, h, i, got[i], ref);
                }
            }
    }
}

int main(int argc, char **argv) {
    void *lib = open_library(argc, argv);
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) check_shape(lib, shapes[i]);
    return 0;
}
