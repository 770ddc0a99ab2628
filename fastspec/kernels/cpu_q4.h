/* What fastspec's CPU GEMMs on int16 activations share (cpu_q4.c: the 4-bit kernel, the activations' rounding and
 * the driver; cpu_q8.c: the 8-bit and 5- / 6-bit kernels): sizes, the activations' pair order, float16 reading, one
 * weight group's share of a tile (group_sum), and the per-width tile runners the driver calls. The scheme is
 * described at the top of cpu_q4.c. */
#ifndef FASTSPEC_CPU_Q4_H
#define FASTSPEC_CPU_Q4_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define Q4_GROUP 32
#define Q4_TILE 16
#define Q4_ROWS 8 /* activation rows that share one unpacking of a tile's weights */
#define Q4_ROW_BLOCK 256 /* activation rows that go through every tile before the next rows (a multiple of Q4_ROWS) */
/* groups ahead whose weights are prefetched (the next tile's once a tile ends; a prefetch never faults): a decode
 * step reads every weight once, from memory, and the hardware prefetcher alone left the kernel at ~15 GB/s */
#define Q4_AHEAD 16
#define Q4_PARALLEL_WORK 65536 /* multiply-adds below which the GEMM runs on the calling thread */

/* the tile unit `g` units on: its weights (`stride` bytes) and its scales and offsets (`halves` float16 values) */
static inline void prefetch_unit(const uint8_t *w, const uint16_t *sm, int64_t stride, int64_t halves, int64_t g) {
    for (int64_t c = 0; c < stride; c += 64) __builtin_prefetch(w + g * stride + c);
    for (int64_t c = 0; c < halves; c += 32) __builtin_prefetch(sm + g * halves + c);
}

/* the input each of a group's 32 rounded activations is, in the kernels' pair order (cpu_q4.c's top comment) */
static const int8_t PAIR_ORDER[32] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
                                      16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, u;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* acc + scale * xs * dot + offset * xsum, in that order: a weight group's float share of 16 outputs for one
 * activation row, given its exact integer dot products (as floats); every 4-bit kernel's (cpu_amx.c's too) */
static inline __attribute__((always_inline)) __m512 group_float(__m512 acc, __m512 dot, __m512 scale, __m512 offset,
                                                                float xs, float xsum) {
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xs)), acc);
    return _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum), acc);
}

/* group_float of the `n` weight pair vectors q dotted with the activation pairs a (16 rows at once): one weight
 * group's share of 16 outputs for one activation row */
static inline __attribute__((always_inline)) __m512 group_sum(__m512 acc, const __m512i *q, const int32_t *a, int n,
                                                              __m512 scale, __m512 offset, float xs, float xsum) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int p = 0; p < n; p += 2) {
        s0 = _mm512_dpwssd_epi32(s0, q[p], _mm512_set1_epi32(a[p]));
        s1 = _mm512_dpwssd_epi32(s1, q[p + 1], _mm512_set1_epi32(a[p + 1]));
    }
    return group_float(acc, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, offset, xs, xsum);
}

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* AVX2: a 64-byte vector is two halves of 8 rows; vpmaddwd sums the products of 16-bit pairs as vpdpwssd does.
 * With 16 vector registers a half-tile's 16 pair vectors do not fit beside the sums (they spilled to the stack, and
 * the unpacking, not memory, bounded a step): the tiles unpack a few pair vectors at a time and hand them to
 * pair_dots for every activation row, one integer sum per row, then group_float once per group. */
static inline __attribute__((always_inline)) __m256 group_float(__m256 acc, __m256 dot, __m256 scale, __m256 offset,
                                                                float xs, float xsum) {
    acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(xs)), acc);
    return _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum), acc);
}

/* s + q0 . (a[0], a[0]) + q1 . (a[1], a[1]) per 32-bit lane: two activation pairs against 8 rows' weight pairs */
static inline __attribute__((always_inline)) __m256i pair_dots(__m256i s, __m256i q0, __m256i q1, const int32_t *a) {
    return _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_set1_epi32(a[0])),
                                                _mm256_madd_epi16(q1, _mm256_set1_epi32(a[1]))));
}

static inline __attribute__((always_inline)) __m256 group_sum(__m256 acc, const __m256i *q, const int32_t *a, int n,
                                                              __m256 scale, __m256 offset, float xs, float xsum) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int p = 0; p < n; p += 4) {
        s0 = pair_dots(s0, q[p], q[p + 1], a + p);
        s1 = pair_dots(s1, q[p + 2], q[p + 3], a + p + 2);
    }
    return group_float(acc, _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), scale, offset, xs, xsum);
}
#endif

/* `call(rows)` with rows = mb (1..8) as a constant: each row count its own unrolled copy of an inlined tile */
#define RUN_ROWS(call)                                                                                                 \
    switch (mb) {                                                                                                      \
    case 1: call(1); break;                                                                                            \
    case 2: call(2); break;                                                                                            \
    case 3: call(3); break;                                                                                            \
    case 4: call(4); break;                                                                                            \
    case 5: call(5); break;                                                                                            \
    case 6: call(6); break;                                                                                            \
    case 7: call(7); break;                                                                                            \
    default: call(8); break;                                                                                           \
    }

/* One tile of 16 output rows against `mb` (1..8) activation rows, y rows `ldy` apart, for each weight width: 8 bits
 * (G16 groups of 16) and 5 / 6 bits (e = bits - 4 high bits; G groups of 32); per32: a scale and an offset per 32
 * values, summed against xsum, the activations' sums per 32; else per 16, against xsum16, their sums per 16. */
void q8_tiles(const int8_t *w, const uint16_t *sm, int64_t G16, int per32, const int16_t *x16, const float *xs,
              const float *xsum, const float *xsum16, int64_t K, float *y, int64_t ldy, int mb);
/* cpu_amx.c: the 4-bit product of M >= AMX_MIN_ROWS rows on AMX tiles (`split`: 4 * (M rounded up to 16) * K bytes
 * of scratch): 1 when done, 0 when not taken (no AMX, turned off, too few rows), -1 without memory */
#define AMX_MIN_ROWS 16
int amx_q4_rows(const int16_t *x16, const float *xs, const float *xsum, int64_t M, int64_t K, const uint8_t *w,
                const uint16_t *sm, int64_t N, float *y, uint8_t *split);
int amx_q4_enable(int want);
void wide_tiles(const uint8_t *w, const uint16_t *sm, int64_t G, int e, int per32, const int16_t *x16,
                const float *xs, const float *xsum, const float *xsum16, int64_t K, float *y, int64_t ldy, int mb);
#endif
