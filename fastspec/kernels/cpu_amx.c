/* The 4-bit GEMM of cpu_q4.c on AMX tiles, for 16 activation rows or more (a prefill chunk), bit for bit what the
 * AVX-512 VNNI kernel computes. The integer part of a group's product, sum_k q[n, k] x16[m, k], is exact in both:
 * here each int16 activation x16 = 256 hi + lo is two bfloat16 values that hold it exactly (256 hi: a signed byte
 * times 256; lo: 0..255), the nibbles are bfloat16 values 0..15, and the tile unit's fp32 sums (TDPBF16PS, over the
 * group's 32 inputs for 16 rows by 16 outputs) stay integers below 2^24 (|x16| <= 32767, q <= 15, 32 terms): the
 * same number the VNNI kernel sums in int32. The float epilogue per group is the VNNI kernel's own expression in the
 * same order (acc + dot * (scale * xs), then + offset * xsum), so a row's output depends neither on which kernel
 * took it nor on the other rows: block_gemm picks this one by row count alone.
 * Layouts: split_rows puts each 16 rows x 32 inputs of the activations' high and low parts in a tile's 1 KB each
 * (x16's pair order kept); unpack_tile turns a weight tile's nibbles into the VNNI kernel's pair vectors as bfloat16
 * (16 tile rows a group, output j's two inputs in 32-bit lane j). Needs the kernel's permission to use the tile data
 * (arch_prctl), asked once; without AMX (or refused) amx_q4_rows returns 0 and the VNNI kernel runs. */
#include "cpu_q4.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16
#define AMX_BLOCK 64 /* rows whose activation tiles (4 bytes a value: 147 KB at K = 576) stay in L2 while every
                        * weight tile passes them (256 rows ran 1.2-1.3x slower) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0: not asked yet, 1: tiles granted and wanted, -1: refused or turned off */

/* want 1: use the tiles where the kernel grants them; 0: do not; -1: leave it as it is. Returns whether they are
 * used. */
int amx_q4_enable(int want) {
    if (want == 0) amx_state = -1;
    else if (amx_state == 0 || (want == 1 && amx_state < 0))
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 1;
    return amx_state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) { /* every tile 16 rows of 64 bytes */
    tile_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* bfloat16 bits of a float that bfloat16 holds exactly (an integer below 2^8 in magnitude, times a power of two) */
static inline __m256i exact_bf16(__m512 f) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16));
}

/* x16 [M, K] -> tiles [M / 16, K / 32, 2, 16, 32] bfloat16: for each 16 rows and group of 32 inputs, 256 (x16 >> 8)
 * then x16 & 255 (exact; x16's order kept), each a tile's 1024 contiguous bytes; rows from M to `padded` zero */
static void split_rows(const int16_t *x16, int64_t M, int64_t padded, int64_t K, uint16_t *tiles) {
    const __m512i low = _mm512_set1_epi32(255);
    int64_t G = K / Q4_GROUP;
#pragma omp parallel for schedule(static) if (M * K >= Q4_PARALLEL_WORK)
    for (int64_t m = 0; m < padded; m++)
        for (int64_t g = 0; g < G; g++) {
            uint16_t *hi = tiles + ((m / AMX_ROWS * G + g) * 2 * AMX_ROWS + m % AMX_ROWS) * Q4_GROUP;
            uint16_t *lo = hi + AMX_ROWS * Q4_GROUP;
            for (int h = 0; h < 2; h++) {
                const int16_t *src = x16 + m * K + g * Q4_GROUP + 16 * h;
                __m512i v = m < M ? _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)src))
                                  : _mm512_setzero_si512();
                __m512 up = _mm512_cvtepi32_ps(_mm512_slli_epi32(_mm512_srai_epi32(v, 8), 8));
                __m512 down = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                _mm256_storeu_si256((__m256i *)(hi + 16 * h), exact_bf16(up));
                _mm256_storeu_si256((__m256i *)(lo + 16 * h), exact_bf16(down));
            }
        }
}

/* A tile's G groups of packed nibbles -> b [G, 16, 32] bfloat16: row p of group g is the VNNI kernel's pair vector
 * q[p] (output j's two inputs in 32-bit lane j, in x16's pair order), each value 0..15 as a bfloat16 */
static void unpack_tile(const uint8_t *w, int64_t G, uint16_t *b) {
    /* the bfloat16 bits of 0..15, twice over (the word permute reads an index's low 5 bits) */
    static const uint16_t bf16_of[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
                                         0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i nibble = _mm512_set1_epi8(15), word = _mm512_set1_epi16(255);
    const __m512i values = _mm512_loadu_si512((const void *)bf16_of);
    for (int64_t g = 0; g < G; g++)
        for (int v = 0; v < 4; v++) {
            __m512i x = _mm512_loadu_si512((const void *)(w + g * 256 + 64 * v));
            __m512i lo = _mm512_and_si512(x, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble);
            __m512i q[4] = {_mm512_and_si512(lo, word), _mm512_srli_epi16(lo, 8), _mm512_and_si512(hi, word),
                            _mm512_srli_epi16(hi, 8)};
            for (int u = 0; u < 4; u++) /* rows 2v, 2v + 1 (low nibbles), 8 + 2v, 9 + 2v (high ones) */
                _mm512_storeu_si512((void *)(b + g * 512 + 32 * ((u >> 1) * 8 + 2 * v + (u & 1))),
                                    _mm512_permutexvar_epi16(q[u], values));
        }
}

/* the float epilogue of one group for 16 rows: cpu_q4.h's group_float, as the VNNI kernel adds it */
static inline __attribute__((always_inline)) void add_group(__m512 *acc, const float *c, __m512 scale,
                                                            __m512 offset, const float *xs, const float *xsum,
                                                            int64_t G, int mb) {
    for (int m = 0; m < AMX_ROWS; m++) {
        int64_t r = (m < mb ? m : 0) * G;
        acc[m] = group_float(acc[m], _mm512_load_ps(c + 16 * m), scale, offset, xs[r], xsum[r]);
    }
}

/* one group's tile products for 16 rows: tiles (hi, lo, b, c) = (high bytes, low bytes, weights, sums) */
#define GROUP_TILES(g, hi, lo, b, c, out)                                                                              \
    do {                                                                                                               \
        _tile_zero(c);                                                                                                 \
        _tile_loadd(b, w + (g) * 512, 64);                                                                             \
        _tile_loadd(hi, x + (g) * 1024, 64);                                                                           \
        _tile_loadd(lo, x + (g) * 1024 + 512, 64);                                                                     \
        _tile_dpbf16ps(c, hi, b);                                                                                      \
        _tile_dpbf16ps(c, lo, b);                                                                                      \
        _tile_stored(c, out, 64);                                                                                      \
    } while (0)

/* 16 outputs of one tile (`w`: unpack_tile's) for 16 rows (`x`: split_rows' tiles; mb of them real, the others
 * zeros, read but not stored). Tiles hold no renamed copies, so consecutive groups use disjoint ones (2-3, 6, 0 and
 * 4-5, 7, 1): one group's loads do not wait for the last one's products; a group's sums are added once the next
 * group's are under way (vector loads right after a tile store of the same bytes stall). */
static void rows_tile(const uint16_t *w, const uint16_t *sm, int64_t G, const uint16_t *x, const float *xs,
                      const float *xsum, float *y, int64_t ldy, int mb) {
    float c[2][AMX_ROWS * 16] __attribute__((aligned(64))); /* [group parity] */
    __m512 acc[AMX_ROWS];
    for (int m = 0; m < AMX_ROWS; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g <= G; g++) {
        if (g < G && g % 2 == 0) GROUP_TILES(g, 2, 3, 6, 0, c[0]);
        if (g < G && g % 2 == 1) GROUP_TILES(g, 4, 5, 7, 1, c[1]);
        if (g == 0) continue;
        int64_t p = g - 1; /* the group whose sums are ready */
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + p * 32)));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + p * 32 + 16)));
        add_group(acc, c[p & 1], scale, offset, xs + p, xsum + p, G, mb);
    }
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

static __thread uint16_t *unpacked; /* a thread's unpacked tile, grown as needed */
static __thread size_t unpacked_size;

int amx_q4_rows(const int16_t *x16, const float *xs, const float *xsum, int64_t M, int64_t K, const uint8_t *w,
                const uint16_t *sm, int64_t N, float *y, uint8_t *split) {
    if (!amx_q4_enable(-1) || M < AMX_MIN_ROWS) return 0; /* (asks for the tiles on the first call) */
    int64_t G = K / Q4_GROUP, padded = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    uint16_t *a = (uint16_t *)split;
    split_rows(x16, M, padded, K, a);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        if (unpacked_size < (size_t)G * 1024) {
            free(unpacked);
            unpacked = (uint16_t *)aligned_alloc(64, G * 1024);
            unpacked_size = unpacked ? (size_t)G * 1024 : 0;
        }
        failed = !unpacked;
        if (!failed) configure_tiles();
        for (int64_t s0 = 0; s0 < M; s0 += AMX_BLOCK) {
            int64_t s1 = M - s0 < AMX_BLOCK ? M : s0 + AMX_BLOCK;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < N / Q4_TILE; t++) {
                if (failed) continue;
                unpack_tile(w + t * G * 256, G, unpacked);
                for (int64_t m0 = s0; m0 < s1; m0 += AMX_ROWS)
                    rows_tile(unpacked, sm + t * G * 32, G, a + m0 * 2 * K, xs + m0 * G, xsum + m0 * G,
                              y + m0 * N + t * Q4_TILE, N, s1 - m0 < AMX_ROWS ? (int)(s1 - m0) : AMX_ROWS);
            }
        }
        if (!failed) _tile_release();
    }
    return failed ? -1 : 1;
}
#else
int amx_q4_enable(int want) {
    (void)want;
    return 0;
}

int amx_q4_rows(const int16_t *x16, const float *xs, const float *xsum, int64_t M, int64_t K, const uint8_t *w,
                const uint16_t *sm, int64_t N, float *y, uint8_t *split) {
    (void)x16, (void)xs, (void)xsum, (void)M, (void)K, (void)w, (void)sm, (void)N, (void)y, (void)split;
    return 0;
}
#endif
