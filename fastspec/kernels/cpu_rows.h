/* What fastspec's fused CPU kernels (cpu_fused.c, cpu_attention.c) share: rows of a GEMM-side tensor or of a KV cache
 * read into and written from float32 in its dtype code `act`: 0 float32, 1 bfloat16, 2 float16 (both rounded to
 * nearest even, as torch's .to() rounds). */
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

static inline void load_row(const void *src, int act, int64_t n, float *dst) {
    if (act == 1) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else if (act == 2) {
        const _Float16 *s = (const _Float16 *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
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
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

#endif
