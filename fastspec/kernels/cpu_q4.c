/* fastspec's 4-, 5-, 6- and 8-bit CPU GEMMs with int16 activations (the 8-bit and the 5- / 6-bit ones further down,
 * before the driver).
 * The 4-bit one: y = x @ w.T for a weight stored as 4-bit values with a scale and an offset per group of 32
 * (w = q * scale + offset: GGUF's Q4_0 / Q4_1 / Q4_K read as blocks), x rounded to int16 per group of 32 on the fly
 * (x ~= x16 * max |x| / 32767: within 2^-16 of the group's largest value, finer than bfloat16 for all but its
 * smallest values). The integer dot products are exact; per group
 *   y[m, n] += scale[n, g] * xs[m, g] * sum_k q[n, k] x16[m, k] + offset[n, g] * sum_k x[m, k]
 * with the offset term taken on the unrounded x (cpu_q4.py holds the torch twin).
 *
 * The packed layout (cpu_q4.pack): a tile of 16 output rows by one group of 32 inputs is 256 bytes, four 64-byte
 * vectors; vector v holds, for row j (bytes 4j..4j+3), inputs 4v..4v+3 in the low nibbles and 16+4v..16+4v+3 in
 * the high ones. Masking a nibble vector's bytes into 16-bit halves gives each row the input pairs (4v, 4v+2) and
 * (4v+1, 4v+3) (16 + those for the high nibbles), so one multiply-add of 16-bit pairs (VNNI vpdpwssd, AVX2 vpmaddwd)
 * takes two inputs of 16 rows at once and a tile's sums never need a horizontal add; the activations are rounded
 * into that pair order. Scales and offsets: float16 [N/16, K/32, 2, 16].
 * Paths: AVX-512 VNNI, AVX2, portable C; -march=native picks one at build time. */
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
/* groups ahead whose weights are prefetched (the next tile's once a tile ends; a prefetch never faults): a decode
 * step reads every weight once, from memory, and the hardware prefetcher alone left the kernel at ~15 GB/s */
#define Q4_AHEAD 16
#define Q4_PARALLEL_WORK 65536 /* multiply-adds below which the GEMM runs on the calling thread */

static inline void prefetch_group(const uint8_t *w, const uint16_t *sm, int64_t g) {
    for (int c = 0; c < 256; c += 64) __builtin_prefetch(w + g * 256 + c);
    __builtin_prefetch(sm + g * 32);
}

/* the input each of a group's 32 rounded activations is, in the kernel's pair order (see above) */
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

/* x [M, K] float32 -> x16 int16 [M, K] in pair order (x ~= x16 * xs), xs [M, K/32] = max |x| / 32767, and the
 * sums of x over each group of 32 (xsum [M, K/32], the 4-bit kernel's) and of 16 (xsum16 [M, K/16], the 8-bit's). */
static void round_rows(const float *x, int64_t M, int64_t K, int16_t *x16, float *xs, float *xsum, float *xsum16) {
    int64_t groups = M * (K / Q4_GROUP);
#pragma omp parallel for schedule(static) if (M * K >= Q4_PARALLEL_WORK)
    for (int64_t r = 0; r < groups; r++) {
        const float *v = x + r * Q4_GROUP;
        float amax = 0.f, sum = 0.f, half = 0.f;
        for (int i = 0; i < Q4_GROUP; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
            sum += v[i];
        }
        for (int i = 0; i < Q4_GROUP / 2; i++) half += v[i];
        float inv = amax > 0.f ? 32767.f / amax : 0.f;
        for (int i = 0; i < Q4_GROUP; i++) x16[r * Q4_GROUP + i] = (int16_t)lrintf(v[PAIR_ORDER[i]] * inv);
        xs[r] = amax / 32767.f;
        xsum[r] = sum;
        xsum16[2 * r] = half;
        xsum16[2 * r + 1] = 0.f;
        for (int i = Q4_GROUP / 2; i < Q4_GROUP; i++) xsum16[2 * r + 1] += v[i];
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* acc + scale * xs * (the `n` weight pair vectors q dotted with the activation pairs a, 16 rows at once) +
 * offset * xsum: one weight group's share of 16 outputs for one activation row */
static inline __attribute__((always_inline)) __m512 group_sum(__m512 acc, const __m512i *q, const int32_t *a, int n,
                                                              __m512 scale, __m512 offset, float xs, float xsum) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int p = 0; p < n; p += 2) {
        s0 = _mm512_dpwssd_epi32(s0, q[p], _mm512_set1_epi32(a[p]));
        s1 = _mm512_dpwssd_epi32(s1, q[p + 1], _mm512_set1_epi32(a[p + 1]));
    }
    __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xs)), acc);
    return _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum), acc);
}

/* One tile (16 output rows) against `mb` activation rows; y rows are `ldy` apart. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const uint16_t *sm, int64_t G,
                                                       const int16_t *x16, const float *xs, const float *xsum,
                                                       int64_t K, float *y, int64_t ldy, const int mb) {
    __m512 acc[Q4_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15), word = _mm512_set1_epi16(255);
    for (int64_t g = 0; g < G; g++) {
        prefetch_group(w, sm, g + Q4_AHEAD);
        __m512i q[16]; /* q[2u], q[2u + 1]: the pairs of nibble vector u (u < 4 low nibbles, u >= 4 high ones) */
        for (int v = 0; v < 4; v++) {
            __m512i b = _mm512_loadu_si512((const void *)(w + g * 256 + 64 * v));
            __m512i lo = _mm512_and_si512(b, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
            q[2 * v] = _mm512_and_si512(lo, word);
            q[2 * v + 1] = _mm512_srli_epi16(lo, 8);
            q[8 + 2 * v] = _mm512_and_si512(hi, word);
            q[8 + 2 * v + 1] = _mm512_srli_epi16(hi, 8);
        }
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 32)));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 32 + 16)));
        for (int m = 0; m < mb; m++) {
            const int32_t *a = (const int32_t *)(x16 + m * K + g * Q4_GROUP); /* one pair per int32 */
            int64_t r = m * (K / Q4_GROUP) + g;
            acc[m] = group_sum(acc[m], q, a, 16, scale, offset, xs[r], xsum[r]);
        }
    }
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(y + m * ldy, acc[m]);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* AVX2: a 64-byte vector is two halves of 8 rows; vpmaddwd sums the products of 16-bit pairs as vpdpwssd does. */
static inline __attribute__((always_inline)) __m256 group_sum(__m256 acc, const __m256i *q, const int32_t *a, int n,
                                                              __m256 scale, __m256 offset, float xs, float xsum) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int p = 0; p < n; p += 2) {
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(q[p], _mm256_set1_epi32(a[p])));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(q[p + 1], _mm256_set1_epi32(a[p + 1])));
    }
    __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
    acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(xs)), acc);
    return _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum), acc);
}

static inline __attribute__((always_inline)) void tile(const uint8_t *w, const uint16_t *sm, int64_t G,
                                                       const int16_t *x16, const float *xs, const float *xsum,
                                                       int64_t K, float *y, int64_t ldy, const int mb) {
    __m256 acc[Q4_ROWS][2];
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(15), word = _mm256_set1_epi16(255);
    for (int64_t g = 0; g < G; g++) {
        prefetch_group(w, sm, g + Q4_AHEAD);
        for (int h = 0; h < 2; h++) {
            __m256i q[16];
            for (int v = 0; v < 4; v++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(w + g * 256 + 64 * v + 32 * h));
                __m256i lo = _mm256_and_si256(b, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
                q[2 * v] = _mm256_and_si256(lo, word);
                q[2 * v + 1] = _mm256_srli_epi16(lo, 8);
                q[8 + 2 * v] = _mm256_and_si256(hi, word);
                q[8 + 2 * v + 1] = _mm256_srli_epi16(hi, 8);
            }
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 8 * h)));
            __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 16 + 8 * h)));
            for (int m = 0; m < mb; m++) {
                const int32_t *a = (const int32_t *)(x16 + m * K + g * Q4_GROUP);
                int64_t r = m * (K / Q4_GROUP) + g;
                acc[m][h] = group_sum(acc[m][h], q, a, 16, scale, offset, xs[r], xsum[r]);
            }
        }
    }
    for (int m = 0; m < mb; m++) {
        _mm256_storeu_ps(y + m * ldy, acc[m][0]);
        _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    }
}
#else
static inline void tile(const uint8_t *w, const uint16_t *sm, int64_t G, const int16_t *x16, const float *xs,
                        const float *xsum, int64_t K, float *y, int64_t ldy, const int mb) {
    for (int m = 0; m < mb; m++) {
        float acc[Q4_TILE] = {0};
        for (int64_t g = 0; g < G; g++) {
            prefetch_group(w, sm, g + Q4_AHEAD);
            const int16_t *a = x16 + m * K + g * Q4_GROUP; /* a[p] is input PAIR_ORDER[p] */
            int64_t r = m * (K / Q4_GROUP) + g;
            for (int j = 0; j < Q4_TILE; j++) {
                int32_t s = 0;
                for (int p = 0; p < Q4_GROUP; p++) {
                    int k = PAIR_ORDER[p], v = (k % 16) / 4, i = k % 4;
                    uint8_t b = w[g * 256 + 64 * v + 4 * j + i];
                    s += (k < 16 ? b & 15 : b >> 4) * a[p];
                }
                acc[j] += (float)s * (half_to_float(sm[g * 32 + j]) * xs[r]) +
                          half_to_float(sm[g * 32 + 16 + j]) * xsum[r];
            }
        }
        memcpy(y + m * ldy, acc, sizeof(acc));
    }
}
#endif

/* The 8-bit kernel: y = x @ w.T for a weight stored as int8 values with a scale and an offset per group of 16
 * (w = q * scale + offset: GGUF's Q8_0, Q6_K and, merged beside them, 4-bit groups), the activations rounded as
 * above (int16 per group of 32; the offset term takes the sum of x over each group of 16). Layout (cpu_q4.pack): a
 * tile of 16 rows by one group of 16 inputs is 256 bytes, four 64-byte vectors; vector v holds, for row j
 * (bytes 4j..4j+3), inputs 4v..4v+3; sign-extending the low / high byte of each 16-bit half gives the pairs
 * (4v, 4v+2) / (4v+1, 4v+3), the 4-bit kernel's pair order. Scales and offsets: float16 [N/16, K/16, 2, 16]. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static inline __attribute__((always_inline)) void tile8(const int8_t *w, const uint16_t *sm, int64_t G16,
                                                        const int16_t *x16, const float *xs, const float *xsum,
                                                        int64_t K, float *y, int64_t ldy, const int mb) {
    __m512 acc[Q4_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G16; g++) {
        prefetch_group((const uint8_t *)w, sm, g + Q4_AHEAD);
        __m512i q[8];
        for (int v = 0; v < 4; v++) {
            __m512i b = _mm512_loadu_si512((const void *)(w + g * 256 + 64 * v));
            q[2 * v] = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8);
            q[2 * v + 1] = _mm512_srai_epi16(b, 8);
        }
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 32)));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 32 + 16)));
        for (int m = 0; m < mb; m++) {
            /* group g of 16 is half (g & 1) of the activations' group g / 2 of 32, whose pair order puts inputs
             * 0..15 in its first 16 values */
            const int32_t *a = (const int32_t *)(x16 + m * K + (g / 2) * Q4_GROUP + (g & 1) * 16);
            acc[m] = group_sum(acc[m], q, a, 8, scale, offset, xs[m * (K / Q4_GROUP) + g / 2], xsum[m * (K / 16) + g]);
        }
    }
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(y + m * ldy, acc[m]);
}
#endif
#if !(defined(__AVX512VNNI__) && defined(__AVX512F__)) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
static inline __attribute__((always_inline)) void tile8(const int8_t *w, const uint16_t *sm, int64_t G16,
                                                        const int16_t *x16, const float *xs, const float *xsum,
                                                        int64_t K, float *y, int64_t ldy, const int mb) {
    __m256 acc[Q4_ROWS][2];
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G16; g++) {
        prefetch_group((const uint8_t *)w, sm, g + Q4_AHEAD);
        for (int h = 0; h < 2; h++) {
            __m256i q[8];
            for (int v = 0; v < 4; v++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(w + g * 256 + 64 * v + 32 * h));
                q[2 * v] = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
                q[2 * v + 1] = _mm256_srai_epi16(b, 8);
            }
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 8 * h)));
            __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 16 + 8 * h)));
            for (int m = 0; m < mb; m++) {
                const int32_t *a = (const int32_t *)(x16 + m * K + (g / 2) * Q4_GROUP + (g & 1) * 16);
                acc[m][h] = group_sum(acc[m][h], q, a, 8, scale, offset, xs[m * (K / Q4_GROUP) + g / 2],
                                      xsum[m * (K / 16) + g]);
            }
        }
    }
    for (int m = 0; m < mb; m++) {
        _mm256_storeu_ps(y + m * ldy, acc[m][0]);
        _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    }
}
#elif !(defined(__AVX512VNNI__) && defined(__AVX512F__))
static inline void tile8(const int8_t *w, const uint16_t *sm, int64_t G16, const int16_t *x16, const float *xs,
                         const float *xsum, int64_t K, float *y, int64_t ldy, const int mb) {
    for (int m = 0; m < mb; m++) {
        float acc[Q4_TILE] = {0};
        for (int64_t g = 0; g < G16; g++) {
            const int16_t *a = x16 + m * K + (g / 2) * Q4_GROUP + (g & 1) * 16; /* a[p]: input PAIR_ORDER[p] */
            for (int j = 0; j < Q4_TILE; j++) {
                int32_t s = 0;
                for (int p = 0; p < 16; p++) {
                    int k = PAIR_ORDER[p];
                    s += w[g * 256 + 64 * (k / 4) + 4 * j + k % 4] * a[p];
                }
                acc[j] += (float)s * (half_to_float(sm[g * 32 + j]) * xs[m * (K / Q4_GROUP) + g / 2]) +
                          half_to_float(sm[g * 32 + 16 + j]) * xsum[m * (K / 16) + g];
            }
        }
        memcpy(y + m * ldy, acc, sizeof(acc));
    }
}
#endif

/* The 5- and 6-bit kernel: y = x @ w.T for a weight of unsigned 5- or 6-bit values with a scale and an offset per
 * group of 16 (GGUF's Q5 types, Q6_K, Q3_K, Q2_K read as blocks; a signed group lifted to unsigned by its offset),
 * the activations rounded as above. Layout (cpu_q4.pack): a tile of 16 rows by one group of 32 inputs is the 4-bit
 * kernel's 256 bytes of the values' low 4 bits, then the e = bits - 4 high bits of each value in 64 e bytes, laid
 * out like the nibbles: nibble vector v's high bits are in high vector c = v e / 4, shifted by t = v e % 4; byte
 * 4j + i there holds the high bits of row j's input 16 + 4v + i (the high nibble's value) at bits t..t+e-1 and of
 * input 4v + i (the low nibble's) at bits 4+t..4+t+e-1. Shifting by t and masking gives bytes whose bits 4.. top the
 * low nibbles and whose bits 0.. (shifted up by 4) top the high ones: one select each (three ops per nibble vector
 * in all). Scales and offsets: float16 [N/16, K/16, 2, 16]; pair vectors 0..7 (inputs 0..15) take the first group's,
 * 8..15 the second's. */
static inline void prefetch_wide(const uint8_t *w, const uint16_t *sm, int64_t stride, int64_t g) {
    for (int64_t c = 0; c < stride; c += 64) __builtin_prefetch(w + g * stride + c);
    __builtin_prefetch(sm + g * 64);
    __builtin_prefetch(sm + g * 64 + 32);
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static inline __attribute__((always_inline)) void tile_wide(const uint8_t *w, const uint16_t *sm, int64_t G,
                                                            const int e, const int16_t *x16, const float *xs,
                                                            const float *xsum16, int64_t K, float *y, int64_t ldy,
                                                            const int mb) {
    const int64_t stride = 256 + 64 * e;
    __m512 acc[Q4_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15), word = _mm512_set1_epi16(255);
    const __m512i top = _mm512_set1_epi8((char)(((1 << e) - 1) * 0x11));
    for (int64_t g = 0; g < G; g++) {
        prefetch_wide(w, sm, stride, g + Q4_AHEAD);
        const uint8_t *wg = w + g * stride;
        __m512i q[16];
        for (int v = 0; v < 4; v++) {
            __m512i b = _mm512_loadu_si512((const void *)(wg + 64 * v));
            __m512i h = _mm512_loadu_si512((const void *)(wg + 256 + 64 * (v * e / 4)));
            h = _mm512_and_si512(_mm512_srli_epi16(h, v * e % 4), top);
            /* (A & C) | (B & ~C) with C the nibble mask: the low 4 bits from A, the high ones from B */
            __m512i lo = _mm512_ternarylogic_epi32(b, h, nibble, 0xE4);
            __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), _mm512_slli_epi16(h, 4), nibble, 0xE4);
            q[2 * v] = _mm512_and_si512(lo, word);
            q[2 * v + 1] = _mm512_srli_epi16(lo, 8);
            q[8 + 2 * v] = _mm512_and_si512(hi, word);
            q[8 + 2 * v + 1] = _mm512_srli_epi16(hi, 8);
        }
        const uint16_t *sg = sm + g * 64;
        __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
        __m512 o0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 16)));
        __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 32)));
        __m512 o1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 48)));
        for (int m = 0; m < mb; m++) {
            const int32_t *a = (const int32_t *)(x16 + m * K + g * Q4_GROUP);
            float x_scale = xs[m * G + g];
            const float *sums = xsum16 + m * 2 * G + 2 * g;
            acc[m] = group_sum(acc[m], q, a, 8, s0, o0, x_scale, sums[0]);
            acc[m] = group_sum(acc[m], q + 8, a + 8, 8, s1, o1, x_scale, sums[1]);
        }
    }
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(y + m * ldy, acc[m]);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
static inline __attribute__((always_inline)) void tile_wide(const uint8_t *w, const uint16_t *sm, int64_t G,
                                                            const int e, const int16_t *x16, const float *xs,
                                                            const float *xsum16, int64_t K, float *y, int64_t ldy,
                                                            const int mb) {
    const int64_t stride = 256 + 64 * e;
    __m256 acc[Q4_ROWS][2];
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(15), word = _mm256_set1_epi16(255);
    const __m256i top = _mm256_set1_epi8((char)(((1 << e) - 1) * 0x11));
    for (int64_t g = 0; g < G; g++) {
        prefetch_wide(w, sm, stride, g + Q4_AHEAD);
        const uint8_t *wg = w + g * stride;
        for (int half = 0; half < 2; half++) {
            __m256i q[16];
            for (int v = 0; v < 4; v++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(wg + 64 * v + 32 * half));
                __m256i h = _mm256_loadu_si256((const __m256i *)(wg + 256 + 64 * (v * e / 4) + 32 * half));
                h = _mm256_and_si256(_mm256_srli_epi16(h, v * e % 4), top);
                __m256i lo = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_andnot_si256(nibble, h));
                __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble),
                                             _mm256_andnot_si256(nibble, _mm256_slli_epi16(h, 4)));
                q[2 * v] = _mm256_and_si256(lo, word);
                q[2 * v + 1] = _mm256_srli_epi16(lo, 8);
                q[8 + 2 * v] = _mm256_and_si256(hi, word);
                q[8 + 2 * v + 1] = _mm256_srli_epi16(hi, 8);
            }
            const uint16_t *sg = sm + g * 64 + 8 * half;
            __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
            __m256 o0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 16)));
            __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 32)));
            __m256 o1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 48)));
            for (int m = 0; m < mb; m++) {
                const int32_t *a = (const int32_t *)(x16 + m * K + g * Q4_GROUP);
                float x_scale = xs[m * G + g];
                const float *sums = xsum16 + m * 2 * G + 2 * g;
                acc[m][half] = group_sum(acc[m][half], q, a, 8, s0, o0, x_scale, sums[0]);
                acc[m][half] = group_sum(acc[m][half], q + 8, a + 8, 8, s1, o1, x_scale, sums[1]);
            }
        }
    }
    for (int m = 0; m < mb; m++) {
        _mm256_storeu_ps(y + m * ldy, acc[m][0]);
        _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    }
}
#else
static inline void tile_wide(const uint8_t *w, const uint16_t *sm, int64_t G, const int e, const int16_t *x16,
                             const float *xs, const float *xsum16, int64_t K, float *y, int64_t ldy, const int mb) {
    const int64_t stride = 256 + 64 * e;
    for (int m = 0; m < mb; m++) {
        float acc[Q4_TILE] = {0};
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wg = w + g * stride;
            const int16_t *a = x16 + m * K + g * Q4_GROUP; /* a[p] is input PAIR_ORDER[p] */
            for (int j = 0; j < Q4_TILE; j++) {
                int32_t s[2] = {0, 0};
                for (int p = 0; p < Q4_GROUP; p++) {
                    int k = PAIR_ORDER[p], v = (k % 16) / 4, i = k % 4;
                    uint8_t b = wg[64 * v + 4 * j + i];
                    uint8_t h = (uint8_t)(wg[256 + 64 * (v * e / 4) + 4 * j + i] >> (v * e % 4));
                    int value = k < 16 ? (b & 15) | (((h >> 4) & ((1 << e) - 1)) << 4)
                                       : (b >> 4) | ((h & ((1 << e) - 1)) << 4);
                    s[k >= 16] += value * a[p];
                }
                const uint16_t *sg = sm + g * 64;
                for (int half = 0; half < 2; half++)
                    acc[j] += (float)s[half] * (half_to_float(sg[32 * half + j]) * xs[m * G + g]) +
                              half_to_float(sg[32 * half + 16 + j]) * xsum16[m * 2 * G + 2 * g + half];
            }
        }
        memcpy(y + m * ldy, acc, sizeof(acc));
    }
}
#endif

static __thread char *scratch; /* x16, xs, xsum of the calling thread, grown as needed */
static __thread size_t scratch_size;

/* y [M, N] float32 = x [M, K] float32 @ w.T for a weight packed as cpu_q4.pack lays out `bits` (4: [N/16, K/32,
 * 256] bytes, scales [N/16, K/32, 2, 16]; 5 / 6: [N/16, K/32, 320 / 384], scales [N/16, K/16, 2, 16]; 8: [N/16,
 * K/16, 256], scales [N/16, K/16, 2, 16]). N % 16 == 0,
 * K % 32 == 0. Returns 0, or -1 when scratch memory cannot be had. */
static int gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, int64_t N, float *y,
                int bits) {
    int64_t G = K / Q4_GROUP;
    size_t need = (size_t)(M * K) * sizeof(int16_t) + 4 * sizeof(float) * (size_t)(M * G); /* K % 32: aligned */
    if (need > scratch_size) {
        char *grown = (char *)realloc(scratch, need);
        if (!grown) return -1;
        scratch = grown;
        scratch_size = need;
    }
    int16_t *x16 = (int16_t *)scratch;
    float *xs = (float *)(x16 + M * K), *xsum = xs + M * G, *xsum16 = xsum + M * G;
    round_rows(x, M, K, x16, xs, xsum, xsum16);
    int64_t wg = bits == 8 ? 2 * G : G;                      /* weight groups (tile units) per row */
    int64_t unit = bits == 8 || bits == 4 ? 256 : 256 + 64 * (bits - 4); /* bytes of a tile unit */
    int64_t sg = bits == 4 ? G : 2 * G;                      /* scale groups per row */
#pragma omp parallel for schedule(static) if (M * N * K >= Q4_PARALLEL_WORK)
    for (int64_t t = 0; t < N / Q4_TILE; t++) {
        const uint8_t *wt = w + t * wg * unit;
        const uint16_t *st = sm + t * sg * 32;
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROWS) {
            const int16_t *a = x16 + m0 * K;
            const float *s = xs + m0 * G;
            float *yt = y + m0 * N + t * Q4_TILE;
            int mb = M - m0 < Q4_ROWS ? (int)(M - m0) : Q4_ROWS;
            if (bits == 4) {
                const float *u = xsum + m0 * G;
                switch (mb) { /* each row count its own unrolled copy */
                case 1: tile(wt, st, G, a, s, u, K, yt, N, 1); break;
                case 2: tile(wt, st, G, a, s, u, K, yt, N, 2); break;
                case 3: tile(wt, st, G, a, s, u, K, yt, N, 3); break;
                case 4: tile(wt, st, G, a, s, u, K, yt, N, 4); break;
                case 5: tile(wt, st, G, a, s, u, K, yt, N, 5); break;
                case 6: tile(wt, st, G, a, s, u, K, yt, N, 6); break;
                case 7: tile(wt, st, G, a, s, u, K, yt, N, 7); break;
                default: tile(wt, st, G, a, s, u, K, yt, N, 8); break;
                }
            } else if (bits != 8) {
                const float *u = xsum16 + m0 * 2 * G;
                const int e = bits - 4; /* high bits per value */
                switch (mb) {
                case 1: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 1); break;
                case 2: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 2); break;
                case 3: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 3); break;
                case 4: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 4); break;
                case 5: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 5); break;
                case 6: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 6); break;
                case 7: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 7); break;
                default: tile_wide(wt, st, G, e, a, s, u, K, yt, N, 8); break;
                }
            } else {
                const int8_t *w8 = (const int8_t *)wt;
                const float *u = xsum16 + m0 * 2 * G;
                switch (mb) {
                case 1: tile8(w8, st, wg, a, s, u, K, yt, N, 1); break;
                case 2: tile8(w8, st, wg, a, s, u, K, yt, N, 2); break;
                case 3: tile8(w8, st, wg, a, s, u, K, yt, N, 3); break;
                case 4: tile8(w8, st, wg, a, s, u, K, yt, N, 4); break;
                case 5: tile8(w8, st, wg, a, s, u, K, yt, N, 5); break;
                case 6: tile8(w8, st, wg, a, s, u, K, yt, N, 6); break;
                case 7: tile8(w8, st, wg, a, s, u, K, yt, N, 7); break;
                default: tile8(w8, st, wg, a, s, u, K, yt, N, 8); break;
                }
            }
        }
    }
    return 0;
}

int q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, int64_t N, float *y) {
    return gemm(x, M, K, w, sm, N, y, 4);
}

int q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *sm, int64_t N, float *y) {
    return gemm(x, M, K, (const uint8_t *)w, sm, N, y, 8);
}

/* bits 5 or 6: the wide kernel above */
int qp_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, int64_t N, float *y,
            int64_t bits) {
    return gemm(x, M, K, w, sm, N, y, (int)bits);
}
