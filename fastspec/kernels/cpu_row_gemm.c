/* y[M, N] = x[M, K] @ w[N, K].T for float32, bfloat16 or float16 x and w (dtype code 0 / 1 / 2 as in cpu_rows.h),
 * in float32: a linear that is row-invariant. Each output is one dot product over K in one fixed order (LANES-wide
 * partial sums taken in K order, then sum_lanes' tree, then the scalar tail past the last whole vector), whatever M is
 * and whichever rows share its tile, so a row's outputs are bit for bit the same alone and among any others. The CPU
 * BLAS's GEMMs choose kernels and blockings by M (MKL's sgemm rounds a row of 1-3 rows otherwise than among 4;
 * oneDNN's bf16 GEMM a row by the rows beside it on EPYC), which lets a verify batch, a prefix-cache hit or a chunk
 * size move a logit, and flip a greedy near-tie.
 * Where the CPU has AVX512-BF16, bfloat16 takes VDPBF16PS (32 products a vector, the pair of each 32-bit lane added
 * into it); else 16-bit values widen to float32 for a fused multiply-add, as float32 ones take it. Tiles of MR rows x
 * NR outputs (MR x NR = LANES accumulators: one sum_lanes for the tile); threads split the outputs. */
#include <stdint.h>

#include "cpu_vec.h"

#define NR 4                         /* outputs a tile: the weight rows each load of x serves (6 or 8: no faster) */
#define MR (LANES / NR)              /* rows a tile: each load of a weight serves them all */
#define PANEL 64                     /* outputs a thread takes at once: their weights stay in L2 over all rows */
#define ROW_GEMM_PARALLEL_WORK (1 << 16) /* M * N * K below which one thread is faster than waking another */

#if defined(__AVX512BF16__) && LANES == 16
#define STEP_BF16 32 /* bfloat16 values a VDPBF16PS step takes */

/* acc[i * NR + j] = x row i . w row j over [0, K) as VDPBF16PS sums: lane l adds x[2l] w[2l] + x[2l + 1] w[2l + 1] of
 * each 32 values, the last step's missing values read as zeros */
static inline __attribute__((always_inline)) void dot_bf16(const int MB, const int NB, const char *const *x,
                                                           const char *const *w, int64_t K, vec *acc) {
    __m512 a[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) a[i][j] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + STEP_BF16 <= K; d += STEP_BF16) {
        __m512i wv[NR];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_si512((const uint16_t *)w[j] + d);
        for (int i = 0; i < MB; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)x[i] + d);
            for (int j = 0; j < NB; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, (__m512bh)wv[j]);
        }
    }
    if (d < K) {
        __mmask32 tail = (__mmask32)((1ull << (K - d)) - 1);
        __m512i wv[NR];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_epi16(tail, (const uint16_t *)w[j] + d);
        for (int i = 0; i < MB; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, (const uint16_t *)x[i] + d);
            for (int j = 0; j < NB; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, (__m512bh)wv[j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i * NR + j] = (vec)a[i][j];
}
#endif

static inline __attribute__((always_inline)) vec fma_vec(vec a, vec b, vec c) {
#if LANES == 16
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vec r;
    for (int l = 0; l < LANES; l++) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

/* acc[i * NR + j] = x row i . w row j over [0, K / LANES * LANES), in float32; returns where the vectors
 * stopped (the scalar tail is the caller's) */
static inline __attribute__((always_inline)) int64_t dot_wide(const int MB, const int NB, const char *const *x,
                                                              const char *const *w, int64_t K, const int code,
                                                              vec *acc) {
    vec a[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) a[i][j] = (vec){0};
    int64_t d = 0;
    for (; d + LANES <= K; d += LANES) {
        vec wv[NR];
        for (int j = 0; j < NB; j++) wv[j] = load_kv(w[j], d, code);
        for (int i = 0; i < MB; i++) {
            vec xv = load_kv(x[i], d, code);
            for (int j = 0; j < NB; j++) a[i][j] = fma_vec(xv, wv[j], a[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i * NR + j] = a[i][j];
    return d;
}

/* x . w over [d, K) added to s one product at a time: one compiled copy for every tile shape (-ffast-math may
 * vectorise a loop differently where it is inlined) */
static __attribute__((noinline)) float add_tail(float s, const char *x, const char *w, int64_t d, int64_t K, int code) {
    for (; d < K; d++) s = __builtin_fmaf(kv_at(x, d, code), kv_at(w, d, code), s);
    return s;
}

/* One tile: MB (<= MR) rows by NB (<= NR) outputs, y rows of stride N */
static inline __attribute__((always_inline)) void tile(const int MB, const int NB, const char *x, const char *w,
                                                       int64_t K, int64_t N, const int code, float *y) {
    const int64_t row = K * (code ? 2 : 4);
    const char *xr[MR], *wr[NR];
    for (int i = 0; i < MR; i++) xr[i] = x + (i < MB ? i : 0) * row;
    for (int j = 0; j < NR; j++) wr[j] = w + (j < NB ? j : 0) * row;
    vec acc[LANES];
    int64_t d = K;
#ifdef STEP_BF16
    if (code == 1)
        dot_bf16(MB, NB, xr, wr, K, acc);
    else
#endif
        d = dot_wide(MB, NB, xr, wr, K, code, acc);
    vec sums = sum_lanes(acc);
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) y[i * N + j] = d < K ? add_tail(sums[i * NR + j], xr[i], wr[j], d, K, code)
                                                          : sums[i * NR + j];
}

/* tile() with MB, NB and the dtype code known at compile time */
static void tile_of(int MB, int NB, const char *x, const char *w, int64_t K, int64_t N, int code, float *y) {
#define NB_OF(mb, c)                                                                                                   \
    switch (NB) {                                                                                                      \
    case 1: tile(mb, 1, x, w, K, N, c, y); break;                                                                      \
    case 2: tile(mb, 2, x, w, K, N, c, y); break;                                                                      \
    case 3: tile(mb, 3, x, w, K, N, c, y); break;                                                                      \
    default: tile(mb, NR, x, w, K, N, c, y); break;                                                                    \
    }
#if MR > 2
#define MB_OF(c)                                                                                                       \
    switch (MB) {                                                                                                      \
    case 1: NB_OF(1, c); break;                                                                                        \
    case 2: NB_OF(2, c); break;                                                                                        \
    case 3: NB_OF(3, c); break;                                                                                        \
    default: NB_OF(MR, c); break;                                                                                      \
    }
#else
#define MB_OF(c)                                                                                                       \
    switch (MB) {                                                                                                      \
    case 1: NB_OF(1, c); break;                                                                                        \
    default: NB_OF(MR, c); break;                                                                                      \
    }
#endif
    switch (code) {
    case 1: MB_OF(1); break;
    case 2: MB_OF(2); break;
    default: MB_OF(0); break;
    }
#undef MB_OF
#undef NB_OF
}

/* y = x @ w.T: x [M, K], w [N, K] in dtype `code` (0 float32, 1 bfloat16, 2 float16), y float32 [M, N], all
 * contiguous */
void row_gemm(const void *x, int64_t M, int64_t K, const void *w, int64_t N, int code, float *y) {
    const int64_t panels = (N + PANEL - 1) / PANEL, row = K * (code ? 2 : 4);
#pragma omp parallel for schedule(static) if (M * N * K >= ROW_GEMM_PARALLEL_WORK)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n1 = (p + 1) * PANEL < N ? (p + 1) * PANEL : N;
        for (int64_t m = 0; m < M; m += MR) {
            const int mb = M - m < MR ? (int)(M - m) : MR;
            for (int64_t n = p * PANEL; n < n1; n += NR)
                tile_of(mb, n1 - n < NR ? (int)(n1 - n) : NR, (const char *)x + m * row, (const char *)w + n * row, K,
                        N, code, y + m * N + n);
        }
    }
}

/* y[m, r] = x[m] . w[a, r] with a = at[m] (at NULL: a = m): each row against its own R weight rows (an lm_head's
 * candidate tokens rescored; the weight of the MoE expert a token's choice names), every output the same dot product
 * row_gemm computes for that row and weight row. Threads split the rows' tiles of NR outputs (a decode step's few
 * rows still fill them). */
void row_dots(const void *x, int64_t M, int64_t K, const void *w, const int64_t *at, int64_t R, int code, float *y) {
    const int64_t row = K * (code ? 2 : 4), tiles = (R + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (M * R * K >= ROW_GEMM_PARALLEL_WORK)
    for (int64_t i = 0; i < M * tiles; i++) {
        const int64_t m = i / tiles, r = i % tiles * NR, a = at ? at[m] : m;
        tile_of(1, R - r < NR ? (int)(R - r) : NR, (const char *)x + m * row, (const char *)w + (a * R + r) * row, K,
                R, code, y + m * R + r);
    }
}
