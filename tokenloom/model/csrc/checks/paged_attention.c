/* The check of csrc/paged_attention.c (head_dim 32), or with -DAVX512 of csrc/paged_attention_avx512.c
 * (head_dim 64): one decode query over a float cache, a half one and an int8 one (rows of codes and
 * their scale, kernels.h's KV_SCALE_BYTES), its context in blocks out of order and ending inside its
 * last block, against softmax(q K^T scale) V computed directly over the values the cache holds. */

#include "check.h"

#ifdef AVX512
enum { H = 4, KVH = 2, D = 64, BS = 4, NB = 6, CTX = 21 };
static const char *const names[3] = {"paged_decode_attention_avx512_f32", "paged_decode_attention_avx512_f16",
                                     "paged_decode_attention_avx512_q8"};
#else
enum { H = 4, KVH = 2, D = 32, BS = 4, NB = 3, CTX = 10 };
static const char *const names[3] = {"paged_decode_attention_f32", "paged_decode_attention_f16",
                                     "paged_decode_attention_q8"};
#endif
enum { CACHE = NB * BS * KVH * D, ROWS = NB * BS * KVH, ROW8 = D + KV_SCALE_BYTES };

static float q[H * D], k[CACHE], v[CACHE], kf[CACHE], vf[CACHE], out[H * D];
static uint16_t kh[CACHE], vh[CACHE];
static int8_t k8[ROWS * ROW8], v8[ROWS * ROW8];

/* Row r of x (D values) as int8 codes and scale into dst; its values as the kernel reads them into back. */
static void quantize_row(const float *x, int8_t *dst, float *back) {
    float amax = 0;
    for (int i = 0; i < D; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float scale = amax / 127.0f;
    for (int i = 0; i < D; i++) dst[i] = (int8_t)lrintf(x[i] * (127.0f / amax)), back[i] = (float)dst[i] * scale;
    memcpy(dst + D, &scale, sizeof scale);
}

int main(int argc, char **argv) {
    void *lib = open_library(argc, argv);
    int64_t tables[NB];
    for (int i = 0; i < NB; i++) tables[i] = (i + 2) % NB;  /* logical block i lives in physical block tables[i] */
    for (int i = 0; i < H * D; i++) q[i] = (float)uniform(-1, 1);
    for (int i = 0; i < CACHE; i++) k[i] = (float)uniform(-1, 1);
    for (int i = 0; i < CACHE; i++) v[i] = (float)uniform(-1, 1);
    for (int i = 0; i < CACHE; i++) kh[i] = half_bits(k[i]), vh[i] = half_bits(v[i]);
    const int64_t lens[1] = {CTX};
    for (int half = 0; half < 3; half++) {  /* each cache type (float, half, int8): what the kernel reads back */
        attention_fn *attend = (attention_fn *)symbol(lib, names[half]);
        for (int i = 0; i < CACHE; i++) kf[i] = half ? half_value(kh[i]) : k[i], vf[i] = half ? half_value(vh[i]) : v[i];
        for (int r = 0; half == 2 && r < ROWS; r++) {
            quantize_row(k + r * D, k8 + r * ROW8, kf + r * D);
            quantize_row(v + r * D, v8 + r * ROW8, vf + r * D);
        }
        const void *kc = half == 2 ? (const void *)k8 : half ? (const void *)kh : (const void *)k;
        const void *vc = half == 2 ? (const void *)v8 : half ? (const void *)vh : (const void *)v;
        CHECK(attend(q, kc, vc, tables, NB, lens, 1, H, KVH, D, BS, 0.25f, out) == 0, "%s failed", names[half]);
        for (int h = 0; h < H; h++) {
            const int kvh = h / (H / KVH);
            double s[CTX], z = 0, top = -INFINITY;
            for (int p = 0; p < CTX; p++) {
                const int64_t slot = tables[p / BS] * BS + p % BS;
                s[p] = 0;
                for (int i = 0; i < D; i++) s[p] += (double)q[h * D + i] * kf[(slot * KVH + kvh) * D + i];
                s[p] *= 0.25;
                top = s[p] > top ? s[p] : top;
            }
            for (int p = 0; p < CTX; p++) z += s[p] = exp(s[p] - top);
            for (int i = 0; i < D; i++) {
                double ref = 0;
                for (int p = 0; p < CTX; p++) ref += s[p] / z * vf[((tables[p / BS] * BS + p % BS) * KVH + kvh) * D + i];
                CHECK(fabs(out[h * D + i] - ref) < 1e-5, "%s: head %d, %d: %g, want %g", names[half], h, i, out[h * D + i], ref);
            }
        }
    }
    return 0;
}
