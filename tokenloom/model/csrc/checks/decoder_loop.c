/* The check of csrc/decoder_loop.c: three layers over stand-in kernels (each norm scales by its weight,
 * each int4 gemm sums its input row times a per-weight number, the int8 one (layer 1's down projection)
 * twice that, the grouped int8 one (layer 0's down projection) three times, the int5 one (layer 1's
 * gate/up) four times, a LoRA product adds its A's first value to its rows, RoPE adds each row's cos to
 * every head (so a norm before it and one after it differ), the KV write stores K and V in the layer's
 * cache, the attention passes the queries through scaled; layer 0's QKV has a bias, layer 2 has QK-norm),
 * with and without a LoRA step, against the same arithmetic done directly: the residual stream and
 * every layer's cached K and V. */
#include "check.h"
#include "decoder_loop.h"

enum { ROWS = 2, HID = 4, INTER = 3, HEADS = 2, KVH = 1, HD = 2, LAYERS = 3, CACHE_SLOTS = 7, QK_NORMED = 2 };
enum { QKV = (HEADS + 2 * KVH) * HD, Q = HEADS * HD, KV = KVH * HD };

static double row_sum(const float *x, int64_t r, int64_t k) {
    double s = 0;
    for (int64_t i = 0; i < k; i++) s += x[r * k + i];
    return s;
}
static void stand_in(const float *x, int64_t rows, int64_t k, const void *codes, int64_t n, float *y, float times) {
    for (int64_t r = 0; r < rows; r++) {
        const double s = row_sum(x, r, k);
        for (int64_t j = 0; j < n; j++) y[r * n + j] = (float)(times * s * *(const float *)codes + (double)j);
    }
}
static int gemm4(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *scales,
                 const uint16_t *offsets, int64_t n, float *y) {
    (void)scales, (void)offsets;
    stand_in(x, rows, k, codes, n, y, 1);
    return 0;
}
static int gemm5(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const uint32_t *fifth,
                 const uint16_t *scales, const uint16_t *offsets, int64_t n, float *y) {
    (void)fifth, (void)scales, (void)offsets;
    stand_in(x, rows, k, codes, n, y, 4);
    return 0;
}
static int gemm8(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scales, int64_t n, float *y) {
    (void)scales;
    stand_in(x, rows, k, codes, n, y, 2);
    return 0;
}
static int gemm8g(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scales, int64_t n, float *y) {
    (void)scales;
    stand_in(x, rows, k, codes, n, y, 3);
    return 0;
}
static void norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    (void)eps;
    for (int64_t i = 0; i < rows * dim; i++) out[i] = x[i] * w[i % dim];
}
static void rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos,
                 const float *sin) {
    (void)sin;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t i = 0; i < head_dim; i++) x[r * row_stride + h * head_dim + i] += cos[r * head_dim + i];
}
static int writes, write_ok = 1;
static int write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t rows, int64_t width,
                    const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache) {
    writes++;
    write_ok &= rows == ROWS && width == KV && num_slots == CACHE_SLOTS;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) {
            ((float *)k_cache)[slots[r] * width + i] = k[r * k_stride + i];
            ((float *)v_cache)[slots[r] * width + i] = v[r * v_stride + i];
        }
    return 0;
}
static void silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i++) out[r * inter + i] = gate_up[r * 2 * inter + i] - gate_up[r * 2 * inter + inter + i];
}
static int attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables, int64_t max_blocks,
                     const int64_t *context_lens, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size, float scale, float *out) {
    (void)k_cache, (void)v_cache, (void)tables, (void)max_blocks, (void)context_lens, (void)kv_heads, (void)block_size;
    for (int64_t i = 0; i < rows * heads * head_dim; i++) out[i] = q[i] * scale;
    return 0;
}
static int lora_calls, lora_ok = 1;
static int lora_add(const float *x, int64_t rows, int64_t k, const int64_t *slot, const uint16_t *a, const uint16_t *b,
                    int64_t rank, int64_t n, float *y) {
    (void)x, (void)b;
    lora_calls++;
    lora_ok &= k == Q && rank == 4 && n == HID;  /* layer 1's o projection: k = q_size, n = hidden */
    for (int64_t r = 0; r < rows; r++)
        if (slot[r] >= 0)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += *(const float *)a;
    return 0;
}

int main(int argc, char **argv) {
    void *lib = open_library(argc, argv);
    __typeof__(&decoder_loop) loop = symbol(lib, "decoder_loop");  /* as kernels.h declares it */
    const Model m = {gemm4, gemm5, gemm8, gemm8g, norm, rope, write_kv, NULL, silu_mul, attention, lora_add,
                     LAYERS, HID, INTER, HEADS, KVH, HD, CACHE_SLOTS, 1e-5f, 0.5f};
    static const float norms[LAYERS][HID] = {{1.0f, 2.0f, 0.5f, 1.0f}, {0.5f, 0.5f, 1.0f, 2.0f},
                                             {2.0f, 1.0f, 0.5f, 0.25f}};
    static const float codes[LAYERS][4] = {{0.25f, 0.5f, 1.0f, -0.125f}, {0.75f, 0.5f, 0.25f, 1.0f},
                                           {0.5f, -0.25f, 0.5f, 0.75f}};
    /* Layer 2's QK-norm weights, a head_dim each (and different: a K normed by Q's weight is caught). */
    static const float q_norm[HD] = {1.5f, -0.5f}, k_norm[HD] = {0.25f, 2.0f};
    /* (layer, projection) kinds: 1 int8 (x2) for layer 1's down, 2 grouped int8 (x3) for layer 0's down,
     * 3 int5 (x4) for layer 1's gate/up; the rest int4 (x1). */
    static const int kinds[LAYERS][4] = {{0, 0, 0, 2}, {0, 0, 3, 1}, {0, 0, 0, 0}};
    static float k_cache[LAYERS][CACHE_SLOTS * KV], v_cache[LAYERS][CACHE_SLOTS * KV];
    static const double times[4] = {1, 2, 3, 4};
    float bias[QKV];
    for (int j = 0; j < QKV; j++) bias[j] = 0.125f * j - 0.5f;
    Layer layers[LAYERS];
    memset(layers, 0, sizeof layers);
    for (int l = 0; l < LAYERS; l++) {
        Weight *w[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        layers[l].input_norm = layers[l].post_attention_norm = norms[l];
        for (int j = 0; j < 4; j++) w[j]->codes = &codes[l][j], w[j]->kind = kinds[l][j];
        layers[l].k_cache = k_cache[l], layers[l].v_cache = v_cache[l];
    }
    layers[0].qkv.bias = bias;
    layers[QK_NORMED].q_norm = q_norm, layers[QK_NORMED].k_norm = k_norm;
    const float x0[ROWS * HID] = {0.5f, -1.0f, 2.0f, 0.25f, 1.5f, 0.0f, -0.5f, 1.0f};
    const float cos_[ROWS * HD] = {0.25f, -0.5f, 0.75f, 1.0f}, sin_[ROWS * HD] = {0, 0, 0, 0};
    const int64_t zeros[8] = {0}, kv_slots[ROWS] = {3, 5};
    /* The LoRA step: row 1 under an adapter whose only projection is layer 1's o (its A's first value 0.75). */
    static const float lora_a = 0.75f;
    const int64_t row_slots[ROWS] = {-1, 0};
    LoRAWeight lora_weights[4 * LAYERS];
    memset(lora_weights, 0, sizeof lora_weights);
    lora_weights[4 * 1 + 1] = (LoRAWeight){(const uint16_t *)&lora_a, (const uint16_t *)&lora_a, 4};
    const LoRAStep lora_step = {row_slots, lora_weights};
    for (int adapted_step = 0; adapted_step < 2; adapted_step++) {
        double x[ROWS * HID];
        float buf[ROWS * HID];
        for (int i = 0; i < ROWS * HID; i++) x[i] = buf[i] = x0[i];
        memset(k_cache, 0, sizeof k_cache), memset(v_cache, 0, sizeof v_cache);
        CHECK(loop(&m, layers, adapted_step ? &lora_step : NULL, buf, ROWS, cos_, sin_, kv_slots, zeros, 1, zeros, 16) == 0,
              "decoder_loop failed");
        for (int l = 0; l < LAYERS; l++) {
            double c[4];
            for (int j = 0; j < 4; j++) c[j] = codes[l][j] * times[kinds[l][j]];
            for (int r = 0; r < ROWS; r++) {
                double *row = x + r * HID, normed = 0, attended = 0, act = 0, gu[2 * INTER], qkv[QKV];
                for (int i = 0; i < HID; i++) normed += row[i] * norms[l][i];
                for (int j = 0; j < QKV; j++) qkv[j] = normed * c[0] + j + (l == 0 ? bias[j] : 0);
                /* Q and K: normed per head (layer 2), then RoPE; V as projected. */
                for (int j = 0; j < Q + KV; j++) {
                    const int i = j % HD;
                    if (l == QK_NORMED) qkv[j] *= j < Q ? q_norm[i] : k_norm[i];
                    qkv[j] += cos_[r * HD + i];
                }
                for (int j = 0; j < KV; j++) {
                    const float k = k_cache[l][kv_slots[r] * KV + j], v = v_cache[l][kv_slots[r] * KV + j];
                    CHECK(close_to(k, qkv[Q + j], 1e-4), "LoRA step %d: layer %d row %d: K %d: %g, want %g",
                          adapted_step, l, r, j, k, qkv[Q + j]);
                    CHECK(close_to(v, qkv[Q + KV + j], 1e-4), "LoRA step %d: layer %d row %d: V %d: %g, want %g",
                          adapted_step, l, r, j, v, qkv[Q + KV + j]);
                }
                for (int j = 0; j < Q; j++) attended += qkv[j] * 0.5;
                const double adapted = adapted_step && l == 1 && r == 1 ? 0.75 : 0;
                for (int j = 0; j < HID; j++) row[j] += attended * c[1] + j + adapted;
                normed = 0;
                for (int i = 0; i < HID; i++) normed += row[i] * norms[l][i];
                for (int j = 0; j < 2 * INTER; j++) gu[j] = normed * c[2] + j;
                for (int i = 0; i < INTER; i++) act += gu[i] - gu[INTER + i];
                for (int j = 0; j < HID; j++) row[j] += act * c[3] + j;
            }
        }
        for (int i = 0; i < ROWS * HID; i++)
            CHECK(close_to(buf[i], x[i], 1e-4), "LoRA step %d: %d: %g, want %g", adapted_step, i, buf[i], x[i]);
    }
    CHECK(lora_calls == 1 && lora_ok, "LoRA products: %d calls (one wanted, for layer 1's o projection)", lora_calls);
    CHECK(writes == 2 * LAYERS && write_ok, "KV writes: %d (one a layer and step wanted)", writes);
    return 0;
}
