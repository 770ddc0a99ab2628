/* fastspec's 8-bit and 5- / 6-bit CPU GEMM tiles on int16 activations; the activations' rounding, the 4-bit kernel
 * and the driver that calls these are in cpu_q4.c (its top comment: the scheme). */
#include "cpu_q4.h"

/* The 8-bit kernel: y = x @ w.T for a weight stored as int8 values with a scale and an offset per group of 16
 * (w = q * scale + offset: GGUF's Q8_0, Q6_K and, merged beside them, 4-bit groups), the activations rounded as
 * above (int16 per group of 32; the offset term takes the sum of x over each group of 16). Layout (cpu_q4.pack): a
 * tile of 16 rows by one group of 16 inputs is 256 bytes, four 64-byte vectors; vector v holds, for row j
 * (bytes 4j..4j+3), inputs 4v..4v+3; sign-extending the low / high byte of each 16-bit half gives the pairs
 * (4v, 4v+2) / (4v+1, 4v+3), the 4-bit kernel's pair order. Scales and offsets: float16 [N/16, K/16, 2, 16], or
 * with per32 [N/16, K/32, 2, 16] (GGUF's Q8_0 as it is: two groups of 16 share one, summed against xsum, the
 * activations' sums per 32). */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static inline __attribute__((always_inline)) void tile8(const int8_t *w, const uint16_t *sm, int64_t G16,
                                                        const int per32, const int16_t *x16, const float *xs,
                                                        const float *xsum32, const float *xsum, int64_t K, float *y,
                                                        int64_t ldy, const int mb) {
    __m512 acc[Q4_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; per32 && g < G16; g += 2) { /* two groups of 16: one activation group of 32 */
        prefetch_unit((const uint8_t *)w, sm, 512, 32, g / 2 + Q4_AHEAD / 2);
        __m512i q[16];
        for (int v = 0; v < 8; v++) {
            __m512i b = _mm512_loadu_si512((const void *)(w + g * 256 + 64 * v));
            q[2 * v] = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8);
            q[2 * v + 1] = _mm512_srai_epi16(b, 8);
        }
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 16)));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 16 + 16)));
        for (int m = 0; m < mb; m++) {
            const int32_t *a = (const int32_t *)(x16 + m * K + (g / 2) * Q4_GROUP);
            acc[m] = group_sum(acc[m], q, a, 16, scale, offset, xs[m * (K / Q4_GROUP) + g / 2],
                               xsum32[m * (K / Q4_GROUP) + g / 2]);
        }
    }
    for (int64_t g = 0; !per32 && g < G16; g++) {
        prefetch_unit((const uint8_t *)w, sm, 256, 32, g + Q4_AHEAD);
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
/* `units` 32-byte halves of 64-byte vectors (w: the first), each sign-extended into its two pair vectors
 * and dotted with every row's activation pairs at once (cpu_q4.h: AVX2's 16 registers) */
static inline __attribute__((always_inline)) void dots8(const int8_t *w, int units, const int16_t *x16, int64_t K,
                                                        __m256i *s, const int mb) {
    for (int m = 0; m < mb; m++) s[m] = _mm256_setzero_si256();
    for (int v = 0; v < units; v++) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(w + 64 * v));
        __m256i q0 = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), q1 = _mm256_srai_epi16(b, 8);
        for (int m = 0; m < mb; m++) s[m] = pair_dots(s[m], q0, q1, (const int32_t *)(x16 + m * K) + 2 * v);
    }
}

static inline __attribute__((always_inline)) void tile8(const int8_t *w, const uint16_t *sm, int64_t G16,
                                                        const int per32, const int16_t *x16, const float *xs,
                                                        const float *xsum32, const float *xsum, int64_t K, float *y,
                                                        int64_t ldy, const int mb) {
    __m256 acc[Q4_ROWS][2];
    __m256i s[Q4_ROWS];
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; per32 && g < G16; g += 2) { /* two groups of 16: one activation group of 32 */
        prefetch_unit((const uint8_t *)w, sm, 512, 32, g / 2 + Q4_AHEAD / 2);
        for (int h = 0; h < 2; h++) {
            dots8(w + g * 256 + 32 * h, 8, x16 + (g / 2) * Q4_GROUP, K, s, mb);
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 16 + 8 * h)));
            __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 16 + 16 + 8 * h)));
            for (int m = 0; m < mb; m++)
                acc[m][h] = group_float(acc[m][h], _mm256_cvtepi32_ps(s[m]), scale, offset,
                                        xs[m * (K / Q4_GROUP) + g / 2], xsum32[m * (K / Q4_GROUP) + g / 2]);
        }
    }
    for (int64_t g = 0; !per32 && g < G16; g++) {
        prefetch_unit((const uint8_t *)w, sm, 256, 32, g + Q4_AHEAD);
        for (int h = 0; h < 2; h++) {
            dots8(w + g * 256 + 32 * h, 4, x16 + (g / 2) * Q4_GROUP + (g & 1) * 16, K, s, mb);
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 8 * h)));
            __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 16 + 8 * h)));
            for (int m = 0; m < mb; m++)
                acc[m][h] = group_float(acc[m][h], _mm256_cvtepi32_ps(s[m]), scale, offset,
                                        xs[m * (K / Q4_GROUP) + g / 2], xsum[m * (K / 16) + g]);
        }
    }
    for (int m = 0; m < mb; m++) {
        _mm256_storeu_ps(y + m * ldy, acc[m][0]);
        _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    }
}
#elif !(defined(__AVX512VNNI__) && defined(__AVX512F__))
static inline void tile8(const int8_t *w, const uint16_t *sm, int64_t G16, const int per32, const int16_t *x16,
                         const float *xs, const float *xsum32, const float *xsum, int64_t K, float *y, int64_t ldy,
                         const int mb) {
    for (int m = 0; m < mb; m++) {
        float acc[Q4_TILE] = {0};
        for (int64_t g = 0; per32 && g < G16; g += 2) {
            const int16_t *a = x16 + m * K + (g / 2) * Q4_GROUP; /* a[p]: input PAIR_ORDER[p] of the 32 */
            for (int j = 0; j < Q4_TILE; j++) {
                int32_t s = 0;
                for (int p = 0; p < Q4_GROUP; p++) {
                    int k = PAIR_ORDER[p];
                    s += w[(g + k / 16) * 256 + 64 * ((k % 16) / 4) + 4 * j + k % 4] * a[p];
                }
                acc[j] += (float)s * (half_to_float(sm[g * 16 + j]) * xs[m * (K / Q4_GROUP) + g / 2]) +
                          half_to_float(sm[g * 16 + 16 + j]) * xsum32[m * (K / Q4_GROUP) + g / 2];
            }
        }
        for (int64_t g = 0; !per32 && g < G16; g++) {
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

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static inline __attribute__((always_inline)) void tile_wide(const uint8_t *w, const uint16_t *sm, int64_t G,
                                                            const int e, const int per32, const int16_t *x16,
                                                            const float *xs, const float *xsum,
                                                            const float *xsum16, int64_t K, float *y, int64_t ldy,
                                                            const int mb) {
    const int64_t stride = 256 + 64 * e;
    __m512 acc[Q4_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15), word = _mm512_set1_epi16(255);
    const __m512i top = _mm512_set1_epi8((char)(((1 << e) - 1) * 0x11));
    for (int64_t g = 0; g < G; g++) {
        prefetch_unit(w, sm, stride, per32 ? 32 : 64, g + Q4_AHEAD);
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
        if (per32) { /* one scale and offset per group of 32: the 4-bit kernel's sums */
            __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 32)));
            __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + g * 32 + 16)));
            for (int m = 0; m < mb; m++)
                acc[m] = group_sum(acc[m], q, (const int32_t *)(x16 + m * K + g * Q4_GROUP), 16, s, o,
                                   xs[m * G + g], xsum[m * G + g]);
            continue;
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
                                                            const int e, const int per32, const int16_t *x16,
                                                            const float *xs, const float *xsum,
                                                            const float *xsum16, int64_t K, float *y, int64_t ldy,
                                                            const int mb) {
    const int64_t stride = 256 + 64 * e;
    __m256 acc[Q4_ROWS][2];
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(15), word = _mm256_set1_epi16(255);
    const __m256i top = _mm256_set1_epi8((char)(((1 << e) - 1) * 0x11));
    for (int64_t g = 0; g < G; g++) {
        prefetch_unit(w, sm, stride, per32 ? 32 : 64, g + Q4_AHEAD);
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
            if (per32) {
                __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 8 * half)));
                __m256 o = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 16 + 8 * half)));
                for (int m = 0; m < mb; m++)
                    acc[m][half] = group_sum(acc[m][half], q, (const int32_t *)(x16 + m * K + g * Q4_GROUP), 16, s,
                                             o, xs[m * G + g], xsum[m * G + g]);
                continue;
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
static inline void tile_wide(const uint8_t *w, const uint16_t *sm, int64_t G, const int e, const int per32,
                             const int16_t *x16, const float *xs, const float *xsum, const float *xsum16, int64_t K,
                             float *y, int64_t ldy, const int mb) {
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
                if (per32) {
                    acc[j] += (float)(s[0] + s[1]) * (half_to_float(sm[g * 32 + j]) * xs[m * G + g]) +
                              half_to_float(sm[g * 32 + 16 + j]) * xsum[m * G + g];
                    continue;
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

void q8_tiles(const int8_t *w, const uint16_t *sm, int64_t G16, int per32, const int16_t *x16, const float *xs,
              const float *xsum, const float *xsum16, int64_t K, float *y, int64_t ldy, int mb) {
#define PER(P, rows) tile8(w, sm, G16, P, x16, xs, xsum, xsum16, K, y, ldy, rows)
#define TILE8(rows) (per32 ? PER(1, rows) : PER(0, rows))
    RUN_ROWS(TILE8)
}

void wide_tiles(const uint8_t *w, const uint16_t *sm, int64_t G, int e, int per32, const int16_t *x16,
                const float *xs, const float *xsum, const float *xsum16, int64_t K, float *y, int64_t ldy, int mb) {
#define WIDE(E, P, rows) tile_wide(w, sm, G, E, P, x16, xs, xsum, xsum16, K, y, ldy, rows)
#define TILE_WIDE(rows) (e == 1 ? (per32 ? WIDE(1, 1, rows) : WIDE(1, 0, rows))                                      \
                                : (per32 ? WIDE(2, 1, rows) : WIDE(2, 0, rows)))
    RUN_ROWS(TILE_WIDE)
}
