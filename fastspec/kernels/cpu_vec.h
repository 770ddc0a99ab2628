/* cpu_attention.c's vectors: LANES floats as wide as the CPU's registers, read from a KV row in any of the cache
 * dtypes (load_kv), summed across lanes (sum_lanes), and V weighted by several rows of weights at once (weighted_v). */
#ifndef FASTSPEC_CPU_VEC_H
#define FASTSPEC_CPU_VEC_H
#include <stdint.h>
#include <string.h>

#include "cpu_rows.h"
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Attention's vectors: LANES floats, as wide as the CPU's registers hold 16 accumulators and a query (AVX-512: 16
 * floats, else 8: AVX2's 16 registers; wider ones spill), loaded from any float address. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t halves __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t words __attribute__((vector_size(LANES * 4), aligned(4)));
typedef _Float16 f16s __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint8_t bytes8 __attribute__((vector_size(LANES), aligned(1)));
#define LOAD(p) (*(const vec *)(p))

/* LANES float16 bit patterns as floats: the CPU's conversion (GCC widens vectors of _Float16 lane by lane) */
static inline __attribute__((always_inline)) vec widen_halves(halves h) {
#if LANES == 16
    return (vec)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__)
    return (vec)_mm256_cvtph_ps((__m128i)h);
#else
    f16s x;
    memcpy(&x, &h, sizeof x);
    return __builtin_convertvector(x, vec);
#endif
}

/* LANES values of a KV row (dtype code kv, as cpu_rows.h: 0 float32, 1 bfloat16, 2 float16, 3 / 4 float8 e4m3fn /
 * e5m2) from element d on, as floats: a bfloat16 is a float's top half, a float16 widens exactly, a float8 through
 * the float16 it places its bits in (cpu_rows.h). kv is a constant where it is inlined. */
static inline __attribute__((always_inline)) vec load_kv(const char *row, int64_t d, int kv) {
    if (kv >= 3) {
#if LANES == 16
        __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)((const uint8_t *)row + d)));
        if (kv == 4) return (vec)_mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
        h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                            _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7));
        return (vec)_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
#else
        halves h = __builtin_convertvector(*(const bytes8 *)((const uint8_t *)row + d), halves);
        if (kv == 4) return widen_halves(h << 8);
        return widen_halves(((h & 0x80) << 8) | ((h & 0x7f) << 7)) * 256.f;
#endif
    }
    const void *at = (const uint16_t *)row + d;
    if (kv == 1) { /* widen to 32 bits, shift into the top half (the intrinsics: GCC's generic vectors do worse) */
#if LANES == 16
        return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(at)), 16));
#elif defined(__AVX2__)
        return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(at)), 16));
#else
        words w = __builtin_convertvector(*(const halves *)at, words) << 16;
        vec f;
        memcpy(&f, &w, sizeof f);
        return f;
#endif
    }
    if (kv == 2) return widen_halves(*(const halves *)at);
    return LOAD((const float *)row + d);
}

/* element d of a KV row as a float */
static inline __attribute__((always_inline)) float kv_at(const char *row, int64_t d, int kv) {
    return kv == 1 ? bf16_to_f32(((const uint16_t *)row)[d])
           : kv == 2 ? (float)((const _Float16 *)row)[d]
           : kv >= 3 ? fp8_to_f32(((const uint8_t *)row)[d], kv == 4)
                     : ((const float *)row)[d];
}

/* A KV row's D values as floats into out (load_kv's, then kv_at's past the last whole vector) */
static inline __attribute__((always_inline)) void widen_row(const char *row, int64_t D, int kv, float *out) {
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) *(vec *)(out + d) = load_kv(row, d, kv);
    for (; d < D; d++) out[d] = kv_at(row, d, kv);
}

/* r[j] = the sum of x[j]'s lanes, for LANES vectors at once: each level adds lane halves of two vectors. E.g. with 8
 * lanes, level 1 puts x0's lanes 0-3 + 4-7 in lanes 0-3 and x1's in lanes 4-7; after the last level lane j holds the
 * sum of x[j]. */
static inline vec sum_lanes(const vec *x) {
#if LANES == 16
    vec y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                       29) +
               __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vec y[4], z[2];
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

#define AHEAD 16 /* keys ahead whose K / V rows are fetched early: a token's slots may be scattered over the pool */

static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
}

/* Rows of weights that share each load of a V row (weighted_v): as many as the registers hold with their 4 vectors of
 * accumulators each (AVX-512's 32: 6 rows; else 2) */
#if LANES == 16
#define VROWS 6
#else
#define VROWS 2
#endif

/* o[j][0, D) = the sum over keys a < n of p[j][a] x V row a, for MB rows j at once: one load of a V row serves them
 * all, and their 4 x MB accumulators are independent chains. Each row's sum over the keys runs in key order whatever
 * else is batched with it. prefetch: the bytes of a V row to fetch AHEAD keys on (0: none). */
static inline __attribute__((always_inline)) void weighted_v_rows(const int MB, const float *const *p, float *const *o,
                                                                  const char *const *rows, int64_t n, int64_t D,
                                                                  const int kv, int64_t prefetch) {
    const int64_t block = 4 * LANES;
    int64_t d = 0;
    for (; d + block <= D; d += block) {
        vec acc[VROWS][4];
        for (int j = 0; j < MB; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = (vec){0};
        for (int64_t a = 0; a < n; a++) {
            const char *v = rows[a];
            if (prefetch && d == 0 && a + AHEAD < n) prefetch_row(rows[a + AHEAD], prefetch);
            vec v0 = load_kv(v, d, kv), v1 = load_kv(v, d + LANES, kv), v2 = load_kv(v, d + 2 * LANES, kv),
                v3 = load_kv(v, d + 3 * LANES, kv);
            for (int j = 0; j < MB; j++) {
                float w = p[j][a];
                acc[j][0] += w * v0, acc[j][1] += w * v1, acc[j][2] += w * v2, acc[j][3] += w * v3;
            }
        }
        for (int j = 0; j < MB; j++)
            for (int i = 0; i < 4; i++) *(vec *)(o[j] + d + i * LANES) = acc[j][i];
    }
    for (; d + LANES <= D; d += LANES)
        for (int j = 0; j < MB; j++) {
            vec acc = {0};
            for (int64_t a = 0; a < n; a++) acc += p[j][a] * load_kv(rows[a], d, kv);
            *(vec *)(o[j] + d) = acc;
        }
    for (; d < D; d++)
        for (int j = 0; j < MB; j++) {
            float acc = 0.f;
            for (int64_t a = 0; a < n; a++) acc += p[j][a] * kv_at(rows[a], d, kv);
            o[j][d] = acc;
        }
}

/* weighted_v_rows for MB (<= VROWS) and kv known at compile time */
static void weighted_v(int MB, const float *const *p, float *const *o, const char *const *rows, int64_t n, int64_t D,
                       int kv, int64_t prefetch) {
#define ROWS_OF(mb)                                                                                                   \
    (kv == 1   ? weighted_v_rows(mb, p, o, rows, n, D, 1, prefetch)                                                     \
     : kv == 2 ? weighted_v_rows(mb, p, o, rows, n, D, 2, prefetch)                                                     \
     : kv == 3 ? weighted_v_rows(mb, p, o, rows, n, D, 3, prefetch)                                                     \
     : kv == 4 ? weighted_v_rows(mb, p, o, rows, n, D, 4, prefetch)                                                     \
               : weighted_v_rows(mb, p, o, rows, n, D, 0, prefetch))
    switch (MB) {
    case 1: ROWS_OF(1); break;
#if VROWS > 2
    case 3: ROWS_OF(3); break;
    case 4: ROWS_OF(4); break;
    case 5: ROWS_OF(5); break;
    case 6: ROWS_OF(6); break;
#endif
    default: ROWS_OF(2); break;
    }
#undef ROWS_OF
}

#endif
