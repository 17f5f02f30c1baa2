/* The check of csrc/layer_ops.c: one small case of each op against a direct computation (RMSNorm, RoPE
 * on rows with a stride, SiLU times up, the KV write into a half cache and an int8 one with a slot outside it, the LoRA
 * product of rows under different adapters and none, with a rank above its bound). */
#include "check.h"

enum { R = 3, D = 20, HD = 20, H = 2, STRIDE = 50, W = 12, CACHE_SLOTS = 5 };
enum { LK = 20, LN = 24, RANK = 3, ADAPTERS = 2 };

int main(int argc, char **argv) {
    void *lib = open_library(argc, argv);
    rms_norm_fn *rms_norm = (rms_norm_fn *)symbol(lib, "rms_norm_f32");
    rope_fn *rope = (rope_fn *)symbol(lib, "rope_f32");
    silu_mul_fn *silu_mul = (silu_mul_fn *)symbol(lib, "silu_mul_f32");
    write_kv_fn *write_kv = (write_kv_fn *)symbol(lib, "write_kv_f16");
    lora_add_fn *lora_add = (lora_add_fn *)symbol(lib, "lora_add_bf16");

    float x[R * D], w[D], out[R * D];
    for (int i = 0; i < R * D; i++) x[i] = (float)uniform(-2, 2);
    for (int i = 0; i < D; i++) w[i] = (float)uniform(0.5, 1.5);
    rms_norm(x, w, R, D, 1e-5f, out);
    for (int r = 0; r < R; r++) {
        double sum = 0;
        for (int i = 0; i < D; i++) sum += (double)x[r * D + i] * x[r * D + i];
        const double inv = 1 / sqrt(sum / D + 1e-5);
        for (int i = 0; i < D; i++)
            CHECK(fabs(out[r * D + i] - w[i] * x[r * D + i] * inv) < 1e-5, "rms_norm: row %d, %d", r, i);
    }

    float qk[R * STRIDE], buf[R * STRIDE], cos_[R * HD], sin_[R * HD];
    for (int i = 0; i < R * STRIDE; i++) buf[i] = qk[i] = (float)uniform(-1, 1);
    for (int i = 0; i < R * HD; i++) cos_[i] = (float)uniform(-1, 1), sin_[i] = (float)uniform(-1, 1);
    rope(buf, R, STRIDE, H, HD, cos_, sin_);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < HD; i++) {
                const int a = r * STRIDE + h * HD;
                const double rot = i < HD / 2 ? -qk[a + i + HD / 2] : qk[a + i - HD / 2];
                const double ref = (double)qk[a + i] * cos_[r * HD + i] + rot * sin_[r * HD + i];
                CHECK(fabs(buf[a + i] - ref) < 1e-5, "rope: row %d head %d, %d", r, h, i);
            }
    for (int i = 0; i < R * STRIDE; i++)
        CHECK(i % STRIDE < H * HD || buf[i] == qk[i], "rope wrote outside its heads at %d", i);

    float gu[R * 2 * D];
    for (int i = 0; i < R * 2 * D; i++) gu[i] = (float)uniform(-30, 30);
    silu_mul(gu, R, D, out);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < D; i++) {
            const double g = gu[r * 2 * D + i], u = gu[r * 2 * D + D + i], ref = g / (1 + exp(-g)) * u;
            CHECK(close_to(out[r * D + i], ref, 1e-5), "silu_mul: row %d, %d: %g, want %g", r, i, out[r * D + i], ref);
        }

    float k[R * STRIDE], v[R * STRIDE];
    for (int i = 0; i < R * STRIDE; i++) k[i] = (float)uniform(-3, 3), v[i] = (float)uniform(-3, 3);
    const int64_t slots[R] = {4, 0, 2}, outside[R] = {0, 5, 1};
    uint16_t kc[CACHE_SLOTS * W] = {0}, vc[CACHE_SLOTS * W] = {0};
    CHECK(write_kv(k, STRIDE, v, STRIDE, R, W, slots, CACHE_SLOTS, kc, vc) == 0, "write_kv_f16 failed");
    for (int r = 0; r < R; r++)
        for (int i = 0; i < W; i++) {
            CHECK(kc[slots[r] * W + i] == half_bits(k[r * STRIDE + i]), "kv: K row %d, %d", r, i);
            CHECK(vc[slots[r] * W + i] == half_bits(v[r * STRIDE + i]), "kv: V row %d, %d", r, i);
        }
    CHECK(write_kv(k, STRIDE, v, STRIDE, R, W, outside, CACHE_SLOTS, kc, vc) == 1, "write_kv_f16: a slot outside");

    /* The int8 write (KV heads of Q8_HD values): each (slot, head) row's codes x * (127 / max |x|) rounded
     * to nearest, then its scale max |x| / 127 (kernels.h's KV_SCALE_BYTES layout). */
    enum { Q8_HEADS = 2, Q8_HD = 16, Q8_ROW = Q8_HD + KV_SCALE_BYTES };
    write_kv_q8_fn *write_kv_q8 = (write_kv_q8_fn *)symbol(lib, "write_kv_q8");
    int8_t k8[CACHE_SLOTS * Q8_HEADS * Q8_ROW] = {0}, v8[CACHE_SLOTS * Q8_HEADS * Q8_ROW] = {0};
    CHECK(write_kv_q8(k, STRIDE, v, STRIDE, R, Q8_HEADS, Q8_HD, slots, CACHE_SLOTS, k8, v8) == 0, "write_kv_q8 failed");
    for (int r = 0; r < R; r++)
        for (int h = 0; h < Q8_HEADS; h++)
            for (int kv = 0; kv < 2; kv++) {
                const float *x = (kv ? v : k) + r * STRIDE + h * Q8_HD;
                const int8_t *row = (kv ? v8 : k8) + (slots[r] * Q8_HEADS + h) * Q8_ROW;
                float amax = 0, scale;
                for (int i = 0; i < Q8_HD; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
                memcpy(&scale, row + Q8_HD, sizeof scale);
                CHECK(scale == amax / 127.0f, "write_kv_q8: row %d head %d: scale %g", r, h, scale);
                for (int i = 0; i < Q8_HD; i++)
                    CHECK(row[i] == lrintf(x[i] * (127.0f / amax)), "write_kv_q8: row %d head %d, %d", r, h, i);
            }
    CHECK(write_kv_q8(k, STRIDE, v, STRIDE, R, Q8_HEADS, Q8_HD, outside, CACHE_SLOTS, k8, v8) == 1,
          "write_kv_q8: a slot outside");

    float lx[R * LK], y0[R * LN], y[R * LN], a[ADAPTERS * LK * RANK], b[ADAPTERS * RANK * LN];
    uint16_t a_bits[ADAPTERS * LK * RANK], b_bits[ADAPTERS * RANK * LN];
    for (int i = 0; i < R * LK; i++) lx[i] = (float)uniform(-1, 1);
    for (int i = 0; i < ADAPTERS * LK * RANK; i++) a[i] = bf16_value(a_bits[i] = bf16_bits((float)uniform(-1, 1)));
    for (int i = 0; i < ADAPTERS * RANK * LN; i++) b[i] = bf16_value(b_bits[i] = bf16_bits((float)uniform(-1, 1)));
    for (int i = 0; i < R * LN; i++) y[i] = y0[i] = (float)uniform(-1, 1);
    const int64_t adapter[R] = {1, -1, 0};
    CHECK(lora_add(lx, R, LK, adapter, a_bits, b_bits, RANK, LN, y) == 0, "lora_add_bf16 failed");
    for (int r = 0; r < R; r++) {
        const int64_t s = adapter[r];
        double t[RANK] = {0};
        for (int j = 0; j < RANK && s >= 0; j++)
            for (int i = 0; i < LK; i++) t[j] += (double)lx[r * LK + i] * a[(s * LK + i) * RANK + j];
        for (int c = 0; c < LN; c++) {
            double ref = y0[r * LN + c];
            for (int j = 0; j < RANK && s >= 0; j++) ref += t[j] * b[(s * RANK + j) * LN + c];
            CHECK(close_to(y[r * LN + c], ref, 1e-4), "lora_add: row %d, %d: %g, want %g", r, c, y[r * LN + c], ref);
        }
    }
    CHECK(lora_add(lx, R, LK, adapter, a_bits, b_bits, 513, LN, y) == 1, "lora_add_bf16: a rank above its bound");
    return 0;
}
