/* What fastspec's fused CPU kernels (cpu_fused.c, cpu_attention.c) share: rows of a GEMM-side tensor or of a KV cache
 * read into and written from float32 in its dtype code `act`: 0 float32, 1 bfloat16, 2 float16, 3 float8 e4m3fn,
 * 4 float8 e5m2 (each rounded to nearest even, as torch's .to() rounds; the float8 ones saturated first, at 448 and
 * 57344, as fastspec.memory.kv_pool saturates them). */
#ifndef FASTSPEC_CPU_ROWS_H
#define FASTSPEC_CPU_ROWS_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* float8 e4m3fn (bias 7) and e5m2 (bias 15) as float16 bit patterns: e5m2 is a float16's top byte; an e4m3fn's
 * exponent and mantissa fields, placed where a float16's go, make 2^-8 of its value (subnormals included) */
static inline uint16_t e4m3_as_half(uint8_t b) { return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }

static inline float half_bits_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

static inline float fp8_to_f32(uint8_t b, int e5m2) {
    return e5m2 ? half_bits_to_f32((uint16_t)(b << 8)) : half_bits_to_f32(e4m3_as_half(b)) * 256.f;
}

/* float32 -> float8 (e5m2: 2 mantissa bits, bias 15; else e4m3fn: 3 bits, bias 7), saturated at the largest finite
 * value, rounded to nearest even; subnormals by adding a power of two that shifts them to the last mantissa bit. */
static inline uint8_t f32_to_fp8(float f, int e5m2) {
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const float top = e5m2 ? 57344.f : 448.f;
    f = f > top ? top : f < -top ? -top : f;
    uint32_t u, sign;
    memcpy(&u, &f, 4);
    sign = u & 0x80000000u, u ^= sign;
    uint8_t r;
    if (u < (uint32_t)(127 - bias + 1) << 23) { /* below the smallest normal: a multiple of its subnormal step */
        uint32_t magic_bits = (uint32_t)(127 - bias + 1 + 23 - mbits) << 23; /* 2^(23 - mbits + 1 - bias) */
        float magic, g;
        memcpy(&magic, &magic_bits, 4);
        memcpy(&g, &u, 4);
        g += magic; /* the sum's last mantissa bits are the subnormal's, rounded to nearest even by the add */
        memcpy(&u, &g, 4);
        r = (uint8_t)(u - magic_bits);
    } else {
        uint32_t shift = 23 - mbits, odd = (u >> shift) & 1;
        u += ((uint32_t)(bias - 127) << 23) + (1u << (shift - 1)) - 1 + odd;
        r = (uint8_t)(u >> shift);
    }
    return r | (uint8_t)(sign >> 24);
}

static inline void load_row(const void *src, int act, int64_t n, float *dst) {
    if (act == 1) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else if (act == 2) {
        const _Float16 *s = (const _Float16 *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    } else if (act >= 3) {
        const uint8_t *s = (const uint8_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = fp8_to_f32(s[i], act == 4);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

static inline void store_row(const float *src, int64_t n, void *dst, int act) {
    if (act == 1) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else if (act == 2) {
        _Float16 *d = (_Float16 *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    } else if (act >= 3) {
        uint8_t *d = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_fp8(src[i], act == 4);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

/* bytes of one value in dtype code act */
static inline int64_t code_size(int act) { return act == 0 ? 4 : act >= 3 ? 1 : 2; }

#endif
