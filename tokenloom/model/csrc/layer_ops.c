/* The small per-layer operations of a decode step, each one C call instead of several torch ops.
 *
 * At one sequence a step is ~30 layers x a dozen tiny ops, and torch spends 5-10 us dispatching each
 * (RMSNorm alone is 8 us for 576 floats): a millisecond a token. These do the same arithmetic in
 * about a microsecond, on float32 activations, each row on its own (a row's bits never depend on the
 * other rows of the batch). AVX2 + FMA + F16C, so they run on every x86 machine the project targets.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#include "simd_avx2.h"

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps). x and out may be the same buffer. */
void rms_norm_f32(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = out + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv)));
        for (; i < dim; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* The MLP's activation on the fused gate/up projection: out[r][i] = silu(gu[r][i]) * gu[r][inter + i],
 * silu(g) = g / (1 + exp(-g)). */
void silu_mul_f32(const float *gu, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half RoPE in place on `heads` heads of each row (Q and K side by side in the fused QKV output):
 * x[i] <- x[i] cos[i] - x[i + half] sin[i], x[i + half] <- x[i + half] cos[i + half] + x[i] sin[i + half].
 * Row r starts at x + r * row_stride; cos and sin are [rows, head_dim] (this step's positions). */
void rope_f32(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos,
              const float *sin) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + r * row_stride + h * head_dim, *b = a + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
                _mm256_storeu_ps(a + i, _mm256_fnmadd_ps(vb, _mm256_loadu_ps(s + i),
                                                         _mm256_mul_ps(va, _mm256_loadu_ps(c + i))));
                _mm256_storeu_ps(b + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(s + half + i),
                                                        _mm256_mul_ps(vb, _mm256_loadu_ps(c + half + i))));
            }
            for (; i < half; i++) {
                const float va = a[i], vb = b[i];
                a[i] = va * c[i] - vb * s[i];
                b[i] = vb * c[half + i] + va * s[half + i];
            }
        }
    }
}

/* Write each row's new K and V (`width` = kv_heads * head_dim floats at src_k + r * k_stride and
 * src_v + r * v_stride) into cache slot slots[r]. Returns 1 (nothing written) if a slot is outside
 * [0, num_slots). */
static int check_slots(const int64_t *slots, int64_t rows, int64_t num_slots) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 1;
    return 0;
}

int write_kv_f32(const float *src_k, int64_t k_stride, const float *src_v, int64_t v_stride, int64_t rows,
                 int64_t width, const int64_t *slots, int64_t num_slots, void *k_dest, void *v_dest) {
    if (check_slots(slots, rows, num_slots)) return 1;
    float *k_cache = k_dest, *v_cache = v_dest;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) {
            k_cache[slots[r] * width + i] = src_k[r * k_stride + i];
            v_cache[slots[r] * width + i] = src_v[r * v_stride + i];
        }
    return 0;
}

/* As write_kv_f32 into a float16 cache, rounding to nearest even as torch's .to(float16) does. */
int write_kv_f16(const float *src_k, int64_t k_stride, const float *src_v, int64_t v_stride, int64_t rows,
                 int64_t width, const int64_t *slots, int64_t num_slots, void *k_dest, void *v_dest) {
    if (check_slots(slots, rows, num_slots)) return 1;
    uint16_t *k_cache = k_dest, *v_cache = v_dest;
    for (int64_t r = 0; r < rows; r++) {
        const float *k = src_k + r * k_stride, *v = src_v + r * v_stride;
        uint16_t *kd = k_cache + slots[r] * width, *vd = v_cache + slots[r] * width;
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            _mm_storeu_si128((__m128i *)(kd + i), _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(vd + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
        }
        for (; i < width; i++) {
            kd[i] = (uint16_t)_cvtss_sh(k[i], _MM_FROUND_TO_NEAREST_INT);
            vd[i] = (uint16_t)_cvtss_sh(v[i], _MM_FROUND_TO_NEAREST_INT);
        }
    }
    return 0;
}

/* One row of head_dim floats as int8 codes and their scale (kernels.h's KV_SCALE_BYTES layout): scale =
 * max |x| / 127, code = x * (127 / max |x|) rounded to nearest even; a row of zeros has scale 0. The
 * same float32 operations as model/kv_quant.py's quantize, so both write the same bytes. */
static void quantize_row_q8(const float *x, int64_t head_dim, int8_t *dst) {
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < head_dim; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t i = 0; i < head_dim; i += 8) {
        __m256 c = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c = _mm256_min_ps(_mm256_max_ps(c, lo), hi);
        const __m256i w = _mm256_cvtps_epi32(c);  /* 8 x int32 in [-127, 127] -> 8 x int8 */
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_packs_epi16(w16, w16));
    }
    memcpy(dst + head_dim, &scale, KV_SCALE_BYTES);
}

/* As write_kv_f32 into an int8 cache: each (row, KV head)'s head_dim values (a multiple of 8) become one
 * cache row of codes and scale, at slot slots[r]. */
int write_kv_q8(const float *src_k, int64_t k_stride, const float *src_v, int64_t v_stride, int64_t rows,
                int64_t kv_heads, int64_t head_dim, const int64_t *slots, int64_t num_slots, void *k_dest,
                void *v_dest) {
    if (check_slots(slots, rows, num_slots)) return 1;
    const int64_t row = head_dim + KV_SCALE_BYTES;
    int8_t *k_cache = k_dest, *v_cache = v_dest;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < kv_heads; h++) {
            quantize_row_q8(src_k + r * k_stride + h * head_dim, head_dim, k_cache + (slots[r] * kv_heads + h) * row);
            quantize_row_q8(src_v + r * v_stride + h * head_dim, head_dim, v_cache + (slots[r] * kv_heads + h) * row);
        }
    return 0;
}

/* LoRA on a projection's output, each row under its own adapter: y[r] += (x[r] A[s]) B[s] with s = slot[r]
 * (rows whose slot is negative are left alone). A [adapters, k, rank] and B [adapters, rank, n] bfloat16
 * (half the bytes of float32: a rank-16 adapter on every projection of SmolLM2 reads a quarter as many
 * bytes as its int4 weights), the adapter's scale folded into B, zero-padded to the set's widest rank
 * (model/lora.py's LoRAStacks); float32 sums. Each sum runs in one fixed order (shrink: over k; expand:
 * over the rank) for the row alone, so a row's bits never depend on which other rows or adapters share
 * the step. Rows of one adapter go in tiles (SGMV rather than a row at a time): a weight is read once per
 * tile. Returns 1 for a rank above LORA_MAX_RANK, 2 when out of memory, else 0. */
#define LORA_MAX_RANK 512
#define LORA_TILE 4

static inline __m256 bf16x8(const uint16_t *p) {  /* eight bfloat16 -> float32, exact */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float bf16x1(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* One tile: `nr` (1..LORA_TILE, a constant once inlined) rows under the same adapter. Each weight vector is
 * loaded and widened once for the tile, and the tile's rows are independent chains of FMAs (one row alone
 * waits on each FMA's latency). Per row the sums run in the same order as for a row alone. */
static inline __attribute__((always_inline)) void lora_tile(const int nr, const int64_t *rr, const float *x, int64_t k,
                                                            const uint16_t *as, const uint16_t *bs, int64_t rank,
                                                            int64_t n, float *y) {
    const float *xr[LORA_TILE];
    float *yr[LORA_TILE];
    float t[LORA_TILE][LORA_MAX_RANK];
    for (int q = 0; q < nr; q++) {
        xr[q] = x + rr[q] * k;
        yr[q] = y + rr[q] * n;
    }
    int64_t j = 0;
    for (; j + 8 <= rank; j += 8) {  /* shrink: t = x A, eight of the rank at a time */
        __m256 acc[LORA_TILE];
        for (int q = 0; q < nr; q++) acc[q] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i++) {
            const __m256 w = bf16x8(as + i * rank + j);
            for (int q = 0; q < nr; q++) acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(xr[q][i]), w, acc[q]);
        }
        for (int q = 0; q < nr; q++) _mm256_storeu_ps(t[q] + j, acc[q]);
    }
    for (; j < rank; j++)
        for (int q = 0; q < nr; q++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc = fmaf(xr[q][i], bf16x1(as[i * rank + j]), acc);
            t[q][j] = acc;
        }
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {  /* expand: y += t B, eight outputs at a time, y read and written once */
        __m256 acc[LORA_TILE];
        for (int q = 0; q < nr; q++) acc[q] = _mm256_loadu_ps(yr[q] + c);
        for (j = 0; j < rank; j++) {
            const __m256 w = bf16x8(bs + j * n + c);
            for (int q = 0; q < nr; q++) acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(t[q][j]), w, acc[q]);
        }
        for (int q = 0; q < nr; q++) _mm256_storeu_ps(yr[q] + c, acc[q]);
    }
    for (; c < n; c++)
        for (int q = 0; q < nr; q++) {
            float acc = yr[q][c];
            for (j = 0; j < rank; j++) acc = fmaf(t[q][j], bf16x1(bs[j * n + c]), acc);
            yr[q][c] = acc;
        }
}

int lora_add_bf16(const float *x, int64_t rows, int64_t k, const int64_t *slot, const uint16_t *a,
                  const uint16_t *b, int64_t rank, int64_t n, float *y) {
    if (rank > LORA_MAX_RANK) return 1;
    /* The rows grouped by adapter (a counting sort on the slot), cut into tiles of up to LORA_TILE rows. */
    int64_t num_slots = 0;
    for (int64_t r = 0; r < rows; r++)
        if (slot[r] >= num_slots) num_slots = slot[r] + 1;
    if (num_slots == 0) return 0;
    int64_t *start = calloc((size_t)num_slots + 1, sizeof *start), *order = malloc((size_t)rows * sizeof *order);
    int64_t *tiles = malloc(((size_t)rows + 1) * sizeof *tiles);
    if (!start || !order || !tiles) {
        free(start); free(order); free(tiles);
        return 2;
    }
    for (int64_t r = 0; r < rows; r++)
        if (slot[r] >= 0) start[slot[r] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
    int64_t placed = start[num_slots];
    for (int64_t r = 0, *next = start; r < rows; r++)
        if (slot[r] >= 0) order[next[slot[r]]++] = r;  /* `start` now holds each slot's end */
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < placed; i++)
        if (i == 0 || slot[order[i]] != slot[order[i - 1]] || i - tiles[num_tiles - 1] == LORA_TILE)
            tiles[num_tiles++] = i;
    tiles[num_tiles] = placed;
#pragma omp parallel for schedule(dynamic, 1) if (num_tiles >= 4)
    for (int64_t tile = 0; tile < num_tiles; tile++) {
        const int64_t *rr = order + tiles[tile];
        const int64_t s = slot[rr[0]];
        const uint16_t *as = a + s * k * rank, *bs = b + s * rank * n;
        switch (tiles[tile + 1] - tiles[tile]) {
            case 4: lora_tile(4, rr, x, k, as, bs, rank, n, y); break;
            case 3: lora_tile(3, rr, x, k, as, bs, rank, n, y); break;
            case 2: lora_tile(2, rr, x, k, as, bs, rank, n, y); break;
            default: lora_tile(1, rr, x, k, as, bs, rank, n, y); break;
        }
    }
    free(start); free(order); free(tiles);
    return 0;
}
