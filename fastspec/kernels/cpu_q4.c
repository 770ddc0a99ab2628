/* fastspec's 4-, 5-, 6- and 8-bit CPU GEMMs with int16 activations: the 4-bit kernel, the activations' rounding
 * and the driver here, the 8-bit and 5- / 6-bit kernels in cpu_q8.c, what they share in cpu_q4.h.
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
 * With `levels` (16 int8 values: IQ4_NL / IQ4_XS's) each nibble is the index of a level, looked up with a byte
 * shuffle and sign-extended before the same products.
 * Paths: AVX-512 VNNI, AVX2, portable C; -march=native picks one at build time. */
#include "cpu_q4.h"

/* x [M, K] float32 -> x16 int16 [M, K] in pair order (x ~= x16 * xs), xs [M, K/32] = max |x| / 32767, and the
 * sums of x over each group of 32 (xsum [M, K/32], the 4-bit kernel's) and of 16 (xsum16 [M, K/16], the 8-bit's). */
static void round_rows(const float *x, int64_t M, int64_t K, int16_t *x16, float *xs, float *xsum, float *xsum16) {
    int64_t groups = M * (K / Q4_GROUP);
#pragma omp parallel for schedule(static) if (M * K >= Q4_PARALLEL_WORK)
    for (int64_t r = 0; r < groups; r++) {
        const float *v = x + r * Q4_GROUP;
#if defined(__AVX512F__)
        __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float half = _mm512_reduce_add_ps(a), rest = _mm512_reduce_add_ps(b);
        float inv = amax > 0.f ? 32767.f / amax : 0.f;
        __m512 scaled[2] = {_mm512_mul_ps(a, _mm512_set1_ps(inv)), _mm512_mul_ps(b, _mm512_set1_ps(inv))};
        for (int h = 0; h < 2; h++) /* each run of 4 in pair order (inputs 0, 2, 1, 3), rounded to nearest even */
            _mm256_storeu_si256((__m256i *)(x16 + r * Q4_GROUP + 16 * h),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_permute_ps(scaled[h], 0xD8))));
        xs[r] = amax / 32767.f;
        xsum[r] = half + rest;
        xsum16[2 * r] = half;
        xsum16[2 * r + 1] = rest;
#else
        float amax = 0.f, half = 0.f, rest = 0.f;
        for (int i = 0; i < Q4_GROUP; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        for (int i = 0; i < Q4_GROUP / 2; i++) half += v[i], rest += v[Q4_GROUP / 2 + i];
        float inv = amax > 0.f ? 32767.f / amax : 0.f;
        for (int i = 0; i < Q4_GROUP; i++) x16[r * Q4_GROUP + i] = (int16_t)lrintf(v[PAIR_ORDER[i]] * inv);
        xs[r] = amax / 32767.f;
        xsum[r] = half + rest;
        xsum16[2 * r] = half;
        xsum16[2 * r + 1] = rest;
#endif
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* One tile (16 output rows) against `mb` activation rows; y rows are `ldy` apart. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const uint16_t *sm, int64_t G,
                                                       const int8_t *levels, const int16_t *x16, const float *xs,
                                                       const float *xsum, int64_t K, float *y, int64_t ldy,
                                                       const int mb) {
    __m512 acc[Q4_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15), word = _mm512_set1_epi16(255);
    const __m512i table = levels ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)levels))
                                 : _mm512_setzero_si512();
    for (int64_t g = 0; g < G; g++) {
        prefetch_unit(w, sm, 256, 32, g + Q4_AHEAD);
        __m512i q[16]; /* q[2u], q[2u + 1]: the pairs of nibble vector u (u < 4 low nibbles, u >= 4 high ones) */
        for (int v = 0; v < 4; v++) {
            __m512i b = _mm512_loadu_si512((const void *)(w + g * 256 + 64 * v));
            __m512i lo = _mm512_and_si512(b, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
            if (levels) { /* each nibble is the index of an int8 level: looked up, then sign-extended */
                lo = _mm512_shuffle_epi8(table, lo);
                hi = _mm512_shuffle_epi8(table, hi);
                q[2 * v] = _mm512_srai_epi16(_mm512_slli_epi16(lo, 8), 8);
                q[2 * v + 1] = _mm512_srai_epi16(lo, 8);
                q[8 + 2 * v] = _mm512_srai_epi16(_mm512_slli_epi16(hi, 8), 8);
                q[8 + 2 * v + 1] = _mm512_srai_epi16(hi, 8);
                continue;
            }
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
/* A 64-byte group is two halves of 8 rows each (32 bytes: rows 0-7, then 8-15). The halves run one after the other
 * over every group (the tile's weights, a few KB, are in L1 for the second), so that a row needs one float
 * accumulator, not two: with 16 vector registers, 4 rows' accumulators and sums beside the 4 pair vectors fit, where
 * both halves' spilled (4 rows cost more than 5). */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const uint16_t *sm, int64_t G,
                                                       const int8_t *levels, const int16_t *x16, const float *xs,
                                                       const float *xsum, int64_t K, float *y, int64_t ldy,
                                                       const int mb) {
    const __m256i nibble = _mm256_set1_epi8(15), low4 = _mm256_set1_epi16(15);
    const __m256i table = levels ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)levels))
                                 : _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256 acc[Q4_ROWS];
        for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            if (h == 0) prefetch_unit(w, sm, 256, 32, g + Q4_AHEAD);
            __m256i s[Q4_ROWS];
            for (int m = 0; m < mb; m++) s[m] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(w + g * 256 + 64 * v + 32 * h));
                __m256i q[4]; /* the pairs (4v, 4v+2), (4v+1, 4v+3) and the same 16 inputs on */
                if (levels) {
                    __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(b, nibble));
                    __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble));
                    q[0] = _mm256_srai_epi16(_mm256_slli_epi16(lo, 8), 8);
                    q[1] = _mm256_srai_epi16(lo, 8);
                    q[2] = _mm256_srai_epi16(_mm256_slli_epi16(hi, 8), 8);
                    q[3] = _mm256_srai_epi16(hi, 8);
                } else { /* a 16-bit word's nibbles are, low to high, pairs 0, 2, 1, 3's: a shift and a mask each */
                    q[0] = _mm256_and_si256(b, low4);
                    q[1] = _mm256_and_si256(_mm256_srli_epi16(b, 8), low4);
                    q[2] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                    q[3] = _mm256_srli_epi16(b, 12);
                }
                for (int m = 0; m < mb; m++) {
                    const int32_t *a = (const int32_t *)(x16 + m * K + g * Q4_GROUP); /* one pair per int32 */
                    s[m] = pair_dots(pair_dots(s[m], q[0], q[1], a + 2 * v), q[2], q[3], a + 8 + 2 * v);
                }
            }
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 8 * h)));
            __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + g * 32 + 16 + 8 * h)));
            for (int m = 0; m < mb; m++) {
                int64_t r = m * (K / Q4_GROUP) + g;
                acc[m] = group_float(acc[m], _mm256_cvtepi32_ps(s[m]), scale, offset, xs[r], xsum[r]);
            }
        }
        for (int m = 0; m < mb; m++) _mm256_storeu_ps(y + m * ldy + 8 * h, acc[m]);
    }
}
#else
static inline void tile(const uint8_t *w, const uint16_t *sm, int64_t G, const int8_t *levels, const int16_t *x16,
                        const float *xs, const float *xsum, int64_t K, float *y, int64_t ldy, const int mb) {
    for (int m = 0; m < mb; m++) {
        float acc[Q4_TILE] = {0};
        for (int64_t g = 0; g < G; g++) {
            prefetch_unit(w, sm, 256, 32, g + Q4_AHEAD);
            const int16_t *a = x16 + m * K + g * Q4_GROUP; /* a[p] is input PAIR_ORDER[p] */
            int64_t r = m * (K / Q4_GROUP) + g;
            for (int j = 0; j < Q4_TILE; j++) {
                int32_t s = 0;
                for (int p = 0; p < Q4_GROUP; p++) {
                    int k = PAIR_ORDER[p], v = (k % 16) / 4, i = k % 4;
                    uint8_t b = w[g * 256 + 64 * v + 4 * j + i];
                    int nib = k < 16 ? b & 15 : b >> 4;
                    s += (levels ? levels[nib] : nib) * a[p];
                }
                acc[j] += (float)s * (half_to_float(sm[g * 32 + j]) * xs[r]) +
                          half_to_float(sm[g * 32 + 16 + j]) * xsum[r];
            }
        }
        memcpy(y + m * ldy, acc, sizeof(acc));
    }
}
#endif

static __thread char *scratch; /* x16, xs, xsum of the calling thread, grown as needed */
static __thread size_t scratch_size;

/* y [M, N] float32 = x [M, K] float32 @ w.T for a weight packed as cpu_q4.pack lays out `bits` with a scale and an
 * offset per `group` values (4: [N/16, K/32, 256] bytes, group 32; 5 / 6: [N/16, K/32, 320 / 384], group 16 or 32;
 * 8: [N/16, K/16, 256] int8, group 16 or 32; scales [N/16, K/group, 2, 16]); `levels`: NULL, or for a 4-bit weight
 * the 16 int8 values its nibbles index (IQ4_NL / IQ4_XS's). N % 16 == 0, K % 32 == 0. Returns 0, or -1 when scratch
 * memory cannot be had. The one entry point: cpu_q4.matmul and cpu_fused.c's layer stack both call it. */
int block_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, int64_t N, float *y,
               int64_t bits, int64_t group, const int8_t *levels) {
    int64_t G = K / Q4_GROUP;
    /* amx_q4_rows' tiles first (64-byte aligned: a tile row is one cache line), then the rounded rows */
    int64_t split = 4 * (M < Q4_ROW_BLOCK ? (M + 15) / 16 * 16 : Q4_ROW_BLOCK) * K;
    size_t need = (size_t)split + (size_t)(M * K) * sizeof(int16_t) + 4 * sizeof(float) * (size_t)(M * G);
    if (need > scratch_size) {
        free(scratch);
        need = (need + 63) / 64 * 64;
        scratch = (char *)aligned_alloc(64, need);
        scratch_size = scratch ? need : 0;
        if (!scratch) return -1;
    }
    int16_t *x16 = (int16_t *)(scratch + split);
    float *xs = (float *)(x16 + M * K), *xsum = xs + M * G, *xsum16 = xsum + M * G;
    round_rows(x, M, K, x16, xs, xsum, xsum16);
    int64_t wg = bits == 8 ? 2 * G : G;                      /* weight groups (tile units) per row */
    int64_t unit = bits == 8 || bits == 4 ? 256 : 256 + 64 * (bits - 4); /* bytes of a tile unit */
    int64_t sg = K / group;                                  /* scale groups per row */
    for (int64_t r0 = 0; r0 < M; r0 += Q4_ROW_BLOCK) { /* rows a block at a time: their int16 copy stays in cache */
        int64_t r1 = M - r0 < Q4_ROW_BLOCK ? M : r0 + Q4_ROW_BLOCK;
        if (bits == 4 && !levels) { /* many rows: on AMX tiles where there are some, the same numbers */
            int done = amx_q4_rows(x16 + r0 * K, xs + r0 * G, xsum + r0 * G, r1 - r0, K, w, sm, N, y + r0 * N,
                                   (uint8_t *)scratch);
            if (done) {
                if (done < 0) return -1;
                continue;
            }
        }
#pragma omp parallel for schedule(static) if ((r1 - r0) * N * K >= Q4_PARALLEL_WORK)
        for (int64_t t = 0; t < N / Q4_TILE; t++) {
            const uint8_t *wt = w + t * wg * unit;
            const uint16_t *st = sm + t * sg * 32;
            for (int64_t m0 = r0; m0 < r1; m0 += Q4_ROWS) {
                const int16_t *a = x16 + m0 * K;
                const float *s = xs + m0 * G;
                float *yt = y + m0 * N + t * Q4_TILE;
                int mb = r1 - m0 < Q4_ROWS ? (int)(r1 - m0) : Q4_ROWS;
                if (bits == 4) {
                    const float *u = xsum + m0 * G;
#define TILE4(rows) (levels ? tile(wt, st, G, levels, a, s, u, K, yt, N, rows)                                     \
                            : tile(wt, st, G, NULL, a, s, u, K, yt, N, rows))
                    RUN_ROWS(TILE4)
                } else if (bits != 8) {
                    wide_tiles(wt, st, G, bits - 4, group == 32, a, s, xsum + m0 * G, xsum16 + m0 * 2 * G, K, yt, N,
                               mb);
                } else {
                    q8_tiles((const int8_t *)wt, st, wg, group == 32, a, s, xsum + m0 * G, xsum16 + m0 * 2 * G, K, yt,
                             N, mb);
                }
            }
        }
    }
    return 0;
}
