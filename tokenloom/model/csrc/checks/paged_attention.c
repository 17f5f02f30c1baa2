/* The check of csrc/paged_attention.c (head_dim 32), or with -DAVX512 of csrc/paged_attention_avx512.c
 * (head_dim 64): one decode query over a float cache and a half one, its context in blocks out of order
 * and ending inside its last block, against softmax(q K^T scale) V computed directly. */
#include "check.h"

#ifdef AVX512
enum { H = 4, KVH = 2, D = 64, BS = 4, NB = 6, CTX = 21 };
static const char *const names[2] = {"paged_decode_attention_avx512_f32", "paged_decode_attention_avx512_f16"};
#else
enum { H = 4, KVH = 2, D = 32, BS = 4, NB = 3, CTX = 10 };
static const char *const names[2] = {"paged_decode_attention_f32", "paged_decode_attention_f16"};
#endif
enum { CACHE = NB * BS * KVH * D };

static float q[H * D], k[CACHE], v[CACHE], kf[CACHE], vf[CACHE], out[H * D];
static uint16_t kh[CACHE], vh[CACHE];

int main(int argc, char **argv) {
    void *lib = open_library(argc, argv);
    int64_t tables[NB];
    for (int i = 0; i < NB; i++) tables[i] = (i + 2) % NB;  /* logical block i lives in physical block tables[i] */
    for (int i = 0; i < H * D; i++) q[i] = (float)uniform(-1, 1);
    for (int i = 0; i < CACHE; i++) k[i] = (float)uniform(-1, 1);
    for (int i = 0; i < CACHE; i++) v[i] = (float)uniform(-1, 1);
    for (int i = 0; i < CACHE; i++) kh[i] = half_bits(k[i]), vh[i] = half_bits(v[i]);
    const int64_t lens[1] = {CTX};
    for (int half = 0; half < 2; half++) {  /* each cache type: what the kernel reads back */
        attention_fn *attend = (attention_fn *)symbol(lib, names[half]);
        for (int i = 0; i < CACHE; i++) kf[i] = half ? half_value(kh[i]) : k[i], vf[i] = half ? half_value(vh[i]) : v[i];
        const void *kc = half ? (const void *)kh : (const void *)k, *vc = half ? (const void *)vh : (const void *)v;
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
