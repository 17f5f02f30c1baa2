/* What every kernel check (csrc/checks/) shares. A check is a small C program the kernel builder
 * (model/kernels.py) compiles and runs in a child process with the freshly built library's path as its
 * argument: it opens the library, takes each function it checks by the type csrc/kernels.h declares,
 * runs one small case against a direct computation and exits 0, or 1 naming the first wrong value. An
 * instruction the CPU advertises but traps on kills the child, and the server never loads the library.
 * No SIMD here and no torch: plain arithmetic in double, so a check starts and runs in milliseconds. */
#ifndef TOKENLOOM_CHECK_H
#define TOKENLOOM_CHECK_H

#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                         \
            fputc('\n', stderr);                                                  \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

/* The library named on the command line (dlopen's error and exit 1 where it does not load). */
static inline void *open_library(int argc, char **argv) {
    CHECK(argc == 2, "usage: %s LIBRARY", argv[0]);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "%s", dlerror());
    return lib;
}

/* A function of the library (its kernels.h type is the caller's cast). */
static inline void *symbol(void *lib, const char *name) {
    void *fn = dlsym(lib, name);
    CHECK(fn != NULL, "%s: %s", name, dlerror());
    return fn;
}

/* A fixed pseudo-random sequence (splitmix64): every run checks the same case. */
static uint64_t check_rng = 0x9E3779B97F4A7C15u;
static inline uint64_t next_random(void) {
    uint64_t z = (check_rng += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}
static inline double uniform(double lo, double hi) { return lo + (hi - lo) * (double)(next_random() >> 11) / 9007199254740992.0; }
static inline int64_t randrange(int64_t lo, int64_t hi) { return lo + (int64_t)(next_random() % (uint64_t)(hi - lo)); } /* [lo, hi) */

/* IEEE half <-> float, rounding to nearest even (the kernels' F16C conversions). */
static inline uint16_t half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, mant = x & 0x7FFFFFu;
    const int32_t exp = (int32_t)((x >> 23) & 0xFF) - 127 + 15;
    if (exp >= 31) return (uint16_t)(sign | 0x7C00u);
    if (exp <= 0) {  /* a subnormal half, or zero */
        if (exp < -10) return (uint16_t)sign;
        const uint32_t m = mant | 0x800000u, shift = (uint32_t)(14 - exp), rest = m & ((1u << shift) - 1);
        uint32_t h = m >> shift;
        if (rest > (1u << (shift - 1)) || (rest == (1u << (shift - 1)) && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;  /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
}
static inline float half_value(uint16_t h) {
    const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
    if (exp == 0) return sign * ldexpf((float)mant, -24);
    if (exp == 31) return mant ? NAN : sign * INFINITY;
    return sign * ldexpf((float)(mant | 0x400u), (int)exp - 25);
}
static inline float half_round(float f) { return half_value(half_bits(f)); }

/* bfloat16: the top half of a float32 (exact for a value that is a bfloat16 already). */
static inline uint16_t bf16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    return (uint16_t)(x >> 16);
}
static inline float bf16_value(uint16_t h) {
    const uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* |got - want| within tol * (1 + |want|). */
static inline int close_to(double got, double want, double tol) { return fabs(got - want) < tol * (1 + fabs(want)); }

#endif
